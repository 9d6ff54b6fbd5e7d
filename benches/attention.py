"""Paged decode attention on the GPU: pagedkv's kernel vs contiguous torch SDPA on the same
data, and vs the device-to-device copy bandwidth measured in the same run. Prints one table.

    python benches/attention.py                        # GQA 32q/8kv, head dim 128, bf16
    python benches/attention.py --batches 1 64 --contexts 2048
    python benches/attention.py --kv-cache-dtype fp8_e4m3     # float8 cache (SDPA on its widened values)

Times are GPU times: ten calls captured in one CUDA graph, replayed (the median of ten
replays, divided by ten), for both kernels. Bytes moved per call = the K and V rows read (each once for all GQA query heads) plus queries
and outputs; GB/s = bytes / time. The ceiling is a large device-to-device `copy_`, counted as
bytes read + bytes written per second (how CUDA's bandwidthTest reports it).
"""

from __future__ import annotations

import argparse
import math
import sys
from datetime import date

import torch
import torch.nn.functional as F


def time_cuda(fn, iterations: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def time_graph(fn, calls: int = 10, iterations: int = 10) -> float:
    """Median seconds per call of `calls` calls captured in one CUDA graph and replayed: the
    GPU's time, without the host's launch overhead (the engine replays decode steps as graphs)."""
    fn()  # compiles and allocates outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_cuda(graph.replay, iterations=iterations) / calls


def copy_ceiling_gbps(num_bytes: int = 2 << 30) -> float:
    source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    seconds = time_cuda(lambda: target.copy_(source), iterations=10)
    return 2 * num_bytes / seconds / 1e9


def bench_one(batch, context, num_heads, num_kv_heads, head_dim, block_size, dtype, ceiling, cache_dtype=None,
              partition_size=None):
    from pagedkv.attention.torch_ref import to_cache_dtype
    from pagedkv.kernels import paged_attention

    generator = torch.Generator(device="cuda").manual_seed(batch * 100003 + context)
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=generator, device="cuda", dtype=dtype)
    value_cache = torch.randn(shape, generator=generator, device="cuda", dtype=dtype)
    if cache_dtype is not None:  # the kernel reads float8 codes; SDPA gets their exact values
        key_cache, value_cache = to_cache_dtype(key_cache, cache_dtype), to_cache_dtype(value_cache, cache_dtype)
    # Random, non-contiguous block tables, as after a while of allocating and freeing.
    permutation = torch.randperm(num_blocks, generator=generator, device="cuda")
    block_tables = permutation.view(batch, blocks_per_seq).int()
    query = torch.randn((batch, num_heads, head_dim), generator=generator, device="cuda", dtype=dtype)
    seq_index = torch.arange(batch, dtype=torch.int32, device="cuda")
    context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)
    scale = head_dim**-0.5

    def paged():
        paged_attention(query, key_cache, value_cache, block_tables, seq_index, context_lens, context, scale,  # noqa: F821
                        out=out, partition_size=partition_size)  # (the del below empties these cells after timing)

    # The same K/V, contiguous per sequence, for SDPA: [B, Hkv, context, D].
    def contiguous(cache):
        rows = cache.view(torch.uint8)[block_tables.long()].view(cache.dtype) if cache.element_size() == 1 else \
            cache[block_tables.long()]
        rows = rows.permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, head_dim)
        return rows[:, :, :context].to(dtype).contiguous()

    keys, values = contiguous(key_cache), contiguous(value_cache)
    sdpa_query = query.view(batch, num_heads, 1, head_dim)

    def sdpa():
        F.scaled_dot_product_attention(sdpa_query, keys, values, scale=scale, enable_gqa=True)  # noqa: F821

    paged()
    expected = F.scaled_dot_product_attention(sdpa_query, keys, values, scale=scale, enable_gqa=True)
    error = ((out.float() - expected.view_as(out).float()).norm() / expected.float().norm()).item()
    paged_seconds, sdpa_seconds = time_graph(paged), time_graph(sdpa)
    moved = 2 * batch * context * num_kv_heads * head_dim * key_cache.element_size() + 2 * query.numel() * query.element_size()
    gbps = moved / paged_seconds / 1e9
    del key_cache, value_cache, keys, values
    return {
        "batch": batch,
        "context": context,
        "paged_us": paged_seconds * 1e6,
        "sdpa_us": sdpa_seconds * 1e6,
        "gbps": gbps,
        "ceiling_pct": 100 * gbps / ceiling,
        "vs_sdpa": paged_seconds / sdpa_seconds,
        "error": error,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"],
                        help="the paged cache's element type (auto: --dtype)")
    parser.add_argument("--partition-size", type=int, default=None,
                        help="force the split-K partition (tokens; default: the kernel's automatic choice)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benches/attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    cache_dtype = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[args.kv_cache_dtype]
    ceiling = copy_ceiling_gbps()
    device = torch.cuda.get_device_name()
    print(f"{device}, {date.today()}, {args.dtype}, KV cache {args.kv_cache_dtype}, {args.num_heads}q/{args.num_kv_heads}kv heads, "
          f"head dim {args.head_dim}, block size {args.block_size}, partition {args.partition_size or 'auto'}; "
          f"copy ceiling {ceiling:.0f} GB/s")
    print()
    print("| batch | context | paged µs | SDPA (contiguous) µs | paged / SDPA time | paged GB/s | % of copy | rel. error |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        for context in args.contexts:
            row = bench_one(batch, context, args.num_heads, args.num_kv_heads, args.head_dim, args.block_size,
                            dtype, ceiling, cache_dtype, args.partition_size)
            print(f"| {row['batch']} | {row['context']} | {row['paged_us']:.1f} | {row['sdpa_us']:.1f} | "
                  f"{row['vs_sdpa']:.2f} | {row['gbps']:.0f} | {row['ceiling_pct']:.0f}% | {row['error']:.1e} |",
                  flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

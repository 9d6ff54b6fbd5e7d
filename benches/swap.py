"""Swap bandwidth on the GPU: KVCache.swap_out / swap_in (pinned CPU blocks, dedicated swap
stream) vs one plain pinned `copy_` of the same bytes, and how much of a swap hides behind
compute running on the compute stream. Prints one table.

    python benches/swap.py                  # SmolLM2-135M's KV shape, bf16, 16-token blocks
    python benches/swap.py --layers 32 --kv-heads 8 --head-dim 128   # a Llama-8B-like shape
"""

from __future__ import annotations

import argparse
import random
import sys
from datetime import date

import torch


def timed(fn, iterations: int = 10) -> float:
    """Median wall seconds per call (the call synchronizes the device itself)."""
    fn()
    times = []
    for _ in range(iterations):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benches/swap.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from pagedkv.runner.kv_cache import KVCache

    dtype = getattr(torch, args.dtype)
    most = max(args.blocks)
    cache = KVCache(args.layers, args.kv_heads, args.head_dim, args.block_size, 2 * most, 2 * most, dtype, "cuda")
    block_bytes = cache.device_cache[0].numel() * cache.device_cache.element_size()
    print(f"{torch.cuda.get_device_name()}, {date.today()}, {args.dtype}, block = {args.layers} layers x K/V x "
          f"{args.kv_heads} heads x {args.block_size} tokens x {args.head_dim} = {block_bytes / 1024:.0f} KiB")
    print()
    print("| method | blocks | MiB | plain copy_ out GB/s | swap_out GB/s | % | plain copy_ in GB/s | swap_in GB/s | % "
          "| compute ms | compute + swap_in ms | hidden |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    methods = ["kernel", "memcpy", "torch"] if cache.swap_method == "kernel" else [cache.swap_method]
    rng = random.Random(0)
    matrix = torch.randn(4096, 4096, device="cuda", dtype=dtype)
    for method, count in ((method, count) for count in args.blocks for method in methods):
        cache.swap_method = method
        num_bytes = count * block_bytes
        # Scattered blocks, as a preempted group's blocks are (no long runs to coalesce).
        device_blocks = rng.sample(range(2 * most), count)
        cpu_blocks = rng.sample(range(2 * most), count)
        out_pairs = list(zip(device_blocks, cpu_blocks))
        in_pairs = list(zip(cpu_blocks, device_blocks))
        gpu_source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
        pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)

        plain_out = timed(lambda: pinned.copy_(gpu_source, non_blocking=True))
        plain_in = timed(lambda: gpu_source.copy_(pinned, non_blocking=True))

        def swap_out():
            cache.swap_out(out_pairs)

        def swap_in():
            cache.swap_in(in_pairs)
            cache.wait_for_swap_in()

        swap_out_seconds, swap_in_seconds = timed(swap_out), timed(swap_in)

        # Overlap: compute that does not touch the swapped blocks, issued right after the
        # swap-in on the compute stream (swap_in only orders *later* readers after it).
        def compute():
            for _ in range(8):
                torch.mm(matrix, matrix)

        def swap_in_and_compute():
            cache.swap_in(in_pairs)
            compute()
            cache.wait_for_swap_in()

        compute_seconds = timed(compute)
        both_seconds = timed(swap_in_and_compute)
        hidden = (compute_seconds + swap_in_seconds - both_seconds) / min(compute_seconds, swap_in_seconds)

        def gbps(seconds):
            return num_bytes / seconds / 1e9

        print(f"| {method} | {count} | {num_bytes / 2**20:.0f} | {gbps(plain_out):.1f} | {gbps(swap_out_seconds):.1f} | "
              f"{100 * plain_out / swap_out_seconds:.0f}% | {gbps(plain_in):.1f} | {gbps(swap_in_seconds):.1f} | "
              f"{100 * plain_in / swap_in_seconds:.0f}% | {compute_seconds * 1e3:.2f} | {both_seconds * 1e3:.2f} | "
              f"{100 * max(0.0, hidden):.0f}% |", flush=True)
    print()
    print("method: kernel = one launch that reads/writes the pinned blocks directly (the default with CuPy); "
          "memcpy = one cudaMemcpyAsync per run of blocks; torch = one copy_ per run.")
    print("hidden: how much of the shorter of (swap_in, compute) ran concurrently with the other; "
          "the overlap column measures swap_in issued on the swap stream while compute runs.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

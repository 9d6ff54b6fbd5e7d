"""The CPU's fused layers (rust/cpu_kernels/layer_ops.rs) and its KV write (kv_write.rs) against the
same work in torch ops, same run, on SmolLM2-135M's shapes (hidden 576, MLP 1536, 9 query + 3 KV
heads of 64) for decode batches and a prefill chunk. Prints one table: median microseconds per
call and the speed-up.

    python benches/cpu_layers.py [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedkv.attention import cpu as cpu_attention
from pagedkv.attention import torch_ref
from pagedkv.layers import cpu_fused
from pagedkv.layers.activation import silu_and_mul
from pagedkv.layers.rms_norm import RMSNorm
from pagedkv.layers.rotary_embedding import split_and_rotate

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def median_us(call, repeats: int = 30) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def layer_calls(num_tokens: int, dtype: torch.dtype):
    """(name, call) for each fused layer; every call copies its inputs first (both paths pay it),
    as the fused ops work in place."""
    norm = RMSNorm(HIDDEN, 1e-5).to(dtype)
    hidden, residual = torch.randn(num_tokens, HIDDEN, dtype=dtype), torch.randn(num_tokens, HIDDEN, dtype=dtype)
    gate_up = torch.randn(num_tokens, 2 * INTERMEDIATE, dtype=dtype)
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
    cos_sin = (torch.randn(num_tokens, HEAD_DIM, dtype=dtype), torch.randn(num_tokens, HEAD_DIM, dtype=dtype))
    return [
        ("residual add + RMSNorm", lambda: norm(hidden.clone(), residual.clone())),
        ("SiLU-and-mul", lambda: silu_and_mul(gate_up)),
        ("rotary (q and k)", lambda: split_and_rotate(qkv.clone(), cos_sin, HEADS, KV_HEADS, HEAD_DIM)),
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads; median µs per call, torch ops vs fused, same run")
    print("| layer | dtype | tokens | torch µs | fused µs | speed-up |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for dtype in (torch.bfloat16, torch.float32):
        for num_tokens in (64, 2048):
            for name, call in layer_calls(num_tokens, dtype):
                cpu_fused.enabled = False
                unfused = median_us(call)
                cpu_fused.enabled = True
                fused = median_us(call)
                dtype_name = str(dtype).removeprefix("torch.")
                print(f"| {name} | {dtype_name} | {num_tokens} | {unfused:.0f} | {fused:.0f} | {unfused / fused:.2f}x |")
        for num_tokens in (1, 64, 2048):
            caches = [torch.zeros(num_tokens // 16 + 8, KV_HEADS, 16, HEAD_DIM, dtype=dtype) for _ in range(2)]
            rows = [torch.randn(num_tokens, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(2)]
            slots = torch.randperm(caches[0].shape[0] * 16)[:num_tokens]
            unfused = median_us(lambda: torch_ref.write_kv(*caches, *rows, slots))
            fused = median_us(lambda: cpu_attention.write_kv(*caches, *rows, slots))
            dtype_name = str(dtype).removeprefix("torch.")
            print(f"| KV write (k and v) | {dtype_name} | {num_tokens} | {unfused:.0f} | {fused:.0f} | "
                  f"{unfused / fused:.2f}x |")


if __name__ == "__main__":
    main()

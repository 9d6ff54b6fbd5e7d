"""The CPU's paged prefill attention (rust/cpu_kernels/prefill_attention.rs) against the path it
replaced, same run: the torch reference's gather of the sequence's K/V through the block table
plus torch's causal `scaled_dot_product_attention`. SmolLM2-135M's attention shape (9 query
heads, 3 KV heads of 64, 16-token blocks scattered over a block-major cache). Prints one table:
median microseconds per layer call, achieved GFLOP/s (causal: half the score matrix), speed-up.

    python benches/cpu_prefill_attention.py [--threads N] [--lengths 16 115 400 1024 2048]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from pagedkv.attention.cpu import paged_prefill_attention
from pagedkv.attention.torch_ref import prefill_one

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 30


def median_us(call, budget_s: float = 1.5) -> float:
    call()
    times = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def calls(prompt_len: int, dtype: torch.dtype):
    """(torch reference call, Rust call) for one whole prompt of prompt_len tokens."""
    generator = torch.Generator().manual_seed(prompt_len)
    num_blocks = 2 * math.ceil(prompt_len / BLOCK_SIZE) + 2
    cache = torch.randn((num_blocks, 2, 2, KV_HEADS, BLOCK_SIZE, HEAD_DIM), generator=generator).to(dtype)
    key_cache, value_cache = cache[:, 1, 0], cache[:, 1, 1]
    table = torch.randperm(num_blocks, generator=generator)[: math.ceil(prompt_len / BLOCK_SIZE)].int()
    query = torch.randn((prompt_len, HEADS, HEAD_DIM), generator=generator).to(dtype)
    starts, contexts = torch.tensor([0, prompt_len], dtype=torch.int32), torch.tensor([prompt_len], dtype=torch.int32)
    scale = HEAD_DIM**-0.5

    def reference():
        return prefill_one(query, key_cache, value_cache, table, prompt_len, scale)

    def rust():
        return paged_prefill_attention(query, key_cache, value_cache, table[None], starts, contexts, scale)

    error = (rust().double() - reference().double()).abs().max().item()
    return reference, rust, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 115, 400, 1024, 2048])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"prompt attention per layer, {HEADS} query / {KV_HEADS} KV heads x {HEAD_DIM}, "
          f"{BLOCK_SIZE}-token blocks, {torch.get_num_threads()} threads")
    print("| prompt tokens | dtype | gather + SDPA µs | Rust µs | Rust GFLOP/s | speed-up | max abs diff |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for prompt_len in args.lengths:
        for dtype in (torch.bfloat16, torch.float32):
            reference, rust, error = calls(prompt_len, dtype)
            reference_us, rust_us = median_us(reference), median_us(rust)
            flops = 4 * HEADS * HEAD_DIM * prompt_len * (prompt_len + 1) / 2
            print(f"| {prompt_len} | {str(dtype).removeprefix('torch.')} | {reference_us:.0f} | {rust_us:.0f} "
                  f"| {flops / rust_us / 1e3:.1f} | {reference_us / rust_us:.2f}x | {error:.1e} |")


if __name__ == "__main__":
    main()

"""Sliding-window decode attention on the CPU (the Rust kernel): a decode step over long contexts
with a window (Mistral's 4096, Gemma 3's 512 or 1024) against the same step attending to the
whole context, in one run. A windowed kernel reads only the window's blocks, so its time should
follow the window, not the context.

    python benches/sliding_window.py                   # Mistral-7B's heads: 32 q / 8 kv, d=128
    python benches/sliding_window.py --heads 4 --kv-heads 1 --head-dim 256 --windows 512   # Gemma-3-1B's
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from pagedkv.attention.cpu import paged_decode_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_layers import median_us  # noqa: E402


def decode_step_arguments(description: str, heads: int, kv_heads: int, head_dim: int,
                          repeats: int) -> argparse.ArgumentParser:
    """The command line of a decode-step benchmark (this one's and attention_variants.py's)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--kv-heads", type=int, default=kv_heads)
    parser.add_argument("--head-dim", type=int, default=head_dim)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser


def random_decode_step(args, context: int, generator: torch.Generator):
    """(query, key_cache, value_cache, block_tables, context_lens) of one bfloat16 decode step of
    args.batch sequences over `context` tokens each, their blocks shuffled over the pool."""
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = blocks_per_seq * args.batch
    shape = (num_blocks, args.kv_heads, args.block_size, args.head_dim)
    key_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    value_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=generator).view(args.batch, blocks_per_seq).int()
    contexts = torch.full((args.batch,), context, dtype=torch.int32)
    query = torch.randn((args.batch, args.heads, args.head_dim), generator=generator).to(torch.bfloat16)
    return query, key_cache, value_cache, tables, contexts


def main() -> None:
    parser = decode_step_arguments(__doc__, heads=32, kv_heads=8, head_dim=128, repeats=7)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--windows", type=int, nargs="+", default=[4096, 1024])
    args = parser.parse_args()

    print(f"# decode, batch {args.batch}, {args.heads} q / {args.kv_heads} kv heads, d={args.head_dim}, "
          f"bfloat16 cache, {torch.get_num_threads()} threads, CPU")
    print("| context | window | µs per step | vs whole context |")
    print("| ---: | ---: | ---: | ---: |")
    generator = torch.Generator().manual_seed(0)
    for context in args.contexts:
        query, key_cache, value_cache, tables, contexts = random_decode_step(args, context, generator)
        scale = args.head_dim**-0.5

        def step(window):
            return lambda: paged_decode_attention(query, key_cache, value_cache, tables, contexts, scale, window)

        whole = median_us(step(None), args.repeats) / 1e6
        print(f"| {context} | whole | {whole * 1e6:,.0f} | 1.00× |")
        for window in args.windows:
            if window < context:
                seconds = median_us(step(window), args.repeats) / 1e6
                print(f"| {context} | {window} | {seconds * 1e6:,.0f} | {whole / seconds:.2f}× |")


if __name__ == "__main__":
    main()

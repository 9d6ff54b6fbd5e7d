"""What Gemma 2's soft-capped logits and GPT-OSS's attention sinks cost the CPU decode attention
(the Rust kernel): the same decode step plain, soft-capped and with sinks, in one run.

    python benches/attention_variants.py                      # Gemma-2-2B's heads: 8 q / 4 kv, d=256
    python benches/attention_variants.py --heads 64 --kv-heads 8 --head-dim 64    # GPT-OSS-20B's
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from pagedkv.attention.cpu import paged_decode_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_layers import median_us  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    block = args.block_size
    print(f"# decode, batch {args.batch}, {args.heads} q / {args.kv_heads} kv heads, d={args.head_dim}, "
          f"bfloat16 cache, {torch.get_num_threads()} threads, CPU")
    print("| context | variant | µs per step | vs plain |")
    print("| ---: | --- | ---: | ---: |")
    generator = torch.Generator().manual_seed(0)
    for context in args.contexts:
        blocks_per_seq = -(-context // block)
        num_blocks = blocks_per_seq * args.batch
        shape = (num_blocks, args.kv_heads, block, args.head_dim)
        key_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
        value_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
        tables = torch.randperm(num_blocks, generator=generator).view(args.batch, blocks_per_seq).int()
        contexts = torch.full((args.batch,), context, dtype=torch.int32)
        query = torch.randn((args.batch, args.heads, args.head_dim), generator=generator).to(torch.bfloat16)
        scale = args.head_dim**-0.5
        variants = {
            "plain": {},
            "soft cap 50 (Gemma 2)": {"logit_softcap": 50.0},
            "sinks (GPT-OSS)": {"sinks": torch.randn(args.heads, generator=generator)},
        }
        plain = None
        for name, options in variants.items():
            def step(options=options):
                return paged_decode_attention(query, key_cache, value_cache, tables, contexts, scale, **options)

            micros = median_us(step, args.repeats)
            plain = plain or micros
            print(f"| {context} | {name} | {micros:,.0f} | {micros / plain:.2f}× |")


if __name__ == "__main__":
    main()

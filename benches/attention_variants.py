"""What Gemma 2's soft-capped logits and GPT-OSS's attention sinks cost the CPU decode attention
(the Rust kernel): the same decode step plain, soft-capped and with sinks, in one run.

    python benches/attention_variants.py                      # Gemma-2-2B's heads: 8 q / 4 kv, d=256
    python benches/attention_variants.py --heads 64 --kv-heads 8 --head-dim 64    # GPT-OSS-20B's
"""

from __future__ import annotations

import os
import sys

import torch

from pagedkv.attention.cpu import paged_decode_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_layers import median_us  # noqa: E402
from sliding_window import decode_step_arguments, random_decode_step  # noqa: E402


def main() -> None:
    parser = decode_step_arguments(__doc__, heads=8, kv_heads=4, head_dim=256, repeats=9)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    args = parser.parse_args()

    print(f"# decode, batch {args.batch}, {args.heads} q / {args.kv_heads} kv heads, d={args.head_dim}, "
          f"bfloat16 cache, {torch.get_num_threads()} threads, CPU")
    print("| context | variant | µs per step | vs plain |")
    print("| ---: | --- | ---: | ---: |")
    generator = torch.Generator().manual_seed(0)
    for context in args.contexts:
        query, key_cache, value_cache, tables, contexts = random_decode_step(args, context, generator)
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

"""Mixture-of-experts layer cost: pagedkv's SparseMoE (a step's token-expert pairs sorted by
expert, one matmul pair per expert hit) against HF transformers' own MoE block (one mask pass per
expert hit) with the same weights, in one run. The ceiling is a roofline measured in the same
run: the slower of (a) the same FLOPs with no routing at all, every routed row through one
expert's matmuls in a single call (a perfectly grouped GEMM), and (b) reading the weights of the
experts the step hits at this machine's copy bandwidth (what bounds small, decode-sized steps).

    python benches/moe.py                        # Qwen3-30B-A3B's layer: 128 experts, top 8, 2048 -> 768
    python benches/moe.py --experts 8 --top-k 2 --intermediate 14336 --hidden 4096   # Mixtral-8x7B's
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from pagedkv.layers.activation import silu_and_mul
from pagedkv.layers.fused_moe import SparseMoE

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_layers import median_us  # noqa: E402


def copy_bandwidth(repeats: int) -> float:
    """Bytes per second of a 256 MiB tensor copy (read + write counted)."""
    source = torch.ones(256 << 20, dtype=torch.uint8)
    destination = torch.empty_like(source)
    return 2 * source.numel() / (median_us(lambda: destination.copy_(source), repeats) / 1e6)


def hf_block(ours: SparseMoE, hidden_size: int, intermediate: int, num_experts: int, top_k: int):
    """transformers' Qwen3-MoE block sharing our weights (no copy)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=hidden_size, moe_intermediate_size=intermediate, num_experts=num_experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True)
    with torch.device("meta"):
        block = Qwen3MoeSparseMoeBlock(config)
    block.gate.weight = ours.gate.weight
    block.experts.gate_up_proj = ours.expert_gate_up
    block.experts.down_proj = ours.expert_down
    return block.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    ours = SparseMoE(args.hidden, args.intermediate, args.experts, args.top_k, renormalize=True).to(dtype).eval()
    with torch.no_grad():
        ours.gate.weight.normal_(std=0.02)
        ours.expert_gate_up.normal_(std=0.02)
        ours.expert_down.normal_(std=0.02)
    hf = hf_block(ours, args.hidden, args.intermediate, args.experts, args.top_k)
    bandwidth = copy_bandwidth(args.repeats)
    expert_bytes = (ours.expert_gate_up[0].numel() + ours.expert_down[0].numel()) * ours.expert_down.element_size()
    print(f"# {args.experts} experts, top {args.top_k}, {args.hidden} -> {args.intermediate}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, CPU; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("| tokens | experts hit | HF block µs | pagedkv µs | speed-up | grouped GEMM µs | weight reads µs "
          "| % of roofline |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with torch.inference_mode():
        for num_tokens in args.tokens:
            hidden = torch.randn(num_tokens, args.hidden, dtype=dtype)
            torch.testing.assert_close(ours(hidden), hf(hidden.unsqueeze(0))[0], rtol=2e-2, atol=2e-3)
            routed = hidden.repeat(args.top_k, 1)  # the same number of rows, all through expert 0

            def ceiling():
                F.linear(silu_and_mul(F.linear(routed, ours.expert_gate_up[0])), ours.expert_down[0])

            hf_s = median_us(lambda: hf(hidden.unsqueeze(0)), args.repeats) / 1e6
            ours_s = median_us(lambda: ours(hidden), args.repeats) / 1e6
            grouped_s = median_us(ceiling, args.repeats) / 1e6
            experts_hit = ours.route(hidden)[1].unique().numel()
            reads_s = experts_hit * expert_bytes / bandwidth
            print(f"| {num_tokens} | {experts_hit} | {hf_s * 1e6:,.0f} | {ours_s * 1e6:,.0f} | {hf_s / ours_s:.2f}× | "
                  f"{grouped_s * 1e6:,.0f} | {reads_s * 1e6:,.0f} | {100 * max(grouped_s, reads_s) / ours_s:.0f}% |")


if __name__ == "__main__":
    main()

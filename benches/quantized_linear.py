"""GGUF weights kept quantized (rust/cpu_kernels/quantized/) against the float32 weights pagedkv
dequantizes at load today, same run, on SmolLM2-135M's linear shapes. Prints one table: per
format, shape (out x in) and token count M, median microseconds of

- float32: torch F.linear on the weight dequantized once beforehand (today's baseline),
- kernel: `quantized_linear` (8-bit activations, integer dot products per block),
- dequant+linear: dequantize the blocks, then F.linear (QuantizedLinear's path above its
  crossover, MAX_KERNEL_TOKENS),

the speed-up of the kernel over float32, and the kernel's GB/s of blocks streamed (block bytes /
time). The K-quants need in_features divisible by 256: of SmolLM2's shapes only the MLP's down
projection (1536) takes them; `--shapes llama-7b` gives Llama 2 7B's, all of which do. Noisy when other jobs share the cores: compare columns within one run.

    python benches/quantized_linear.py [--threads N] [--formats Q4_1 Q8_0] [--tokens 1 4 16 64]
                                       [--shapes smollm2|llama-7b]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedkv.layers.quantized_linear import GGML_TYPES, dequantize, quantized_linear, row_bytes
from pagedkv_core import _core

# (name, out_features, in_features) of each model's linear layers
SHAPES = {
    "smollm2": [("q/o proj", 576, 576), ("gate/up", 1536, 576), ("down", 576, 1536), ("lm head", 49152, 576)],
    "llama-7b": [("q/o proj", 4096, 4096), ("gate/up", 11008, 4096), ("down", 4096, 11008), ("lm head", 32000, 4096)],
}


def median_us(call, budget_s: float = 0.3, max_repeats: int = 30) -> float:
    call()
    times, started = [], time.perf_counter()
    while len(times) < 3 or (len(times) < max_repeats and time.perf_counter() - started < budget_s):
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e6


def random_blocks(ggml_type: str, out_features: int, in_features: int) -> torch.Tensor:
    """Random codes with small, finite f16 scales (speed does not depend on the values)."""
    block_len, block_bytes = _core.ggml_block_size(ggml_type)
    blocks = torch.randint(0, 256, (out_features * in_features // block_len, block_bytes), dtype=torch.uint8)
    scale_offsets = {"Q6_K": [208], "Q4_1": [0, 2], "Q4_K": [0, 2]}.get(ggml_type, [0])
    for offset in scale_offsets:
        scales = (torch.rand(len(blocks)) * 0.01).half().view(torch.uint8).reshape(-1, 2)
        blocks[:, offset : offset + 2] = scales
    return blocks.reshape(out_features, row_bytes(ggml_type, in_features))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--formats", nargs="+", default=list(GGML_TYPES), choices=GGML_TYPES)
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--shapes", choices=SHAPES, default="smollm2", help="whose linear layers")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, isa {_core.cpu_attention_build()[0]}; medians, microseconds; noisy on shared cores")
    print(f"{'format':6} {'shape':>18} {'M':>3} {'float32':>9} {'kernel':>9} {'speed-up':>8} {'GB/s':>6} {'dequant+linear':>14}")
    for ggml_type in args.formats:
        block_len, _ = _core.ggml_block_size(ggml_type)
        for name, out_features, in_features in SHAPES[args.shapes]:
            if in_features % block_len:
                continue
            blocks = random_blocks(ggml_type, out_features, in_features)
            weight = dequantize(blocks, ggml_type, (out_features, in_features))
            for num_tokens in args.tokens:
                x = torch.randn(num_tokens, in_features)
                baseline = median_us(lambda: F.linear(x, weight))
                kernel = median_us(lambda: quantized_linear(x, blocks, ggml_type, out_features))
                dequantized = median_us(lambda: F.linear(x, dequantize(blocks, ggml_type, weight.shape)))
                gb_per_s = blocks.numel() / (kernel * 1e-6) / 1e9
                shape = f"{name} {out_features}x{in_features}"
                print(
                    f"{ggml_type:6} {shape:>18} {num_tokens:>3} {baseline:>9.1f} {kernel:>9.1f} "
                    f"{baseline / kernel:>7.2f}x {gb_per_s:>6.1f} {dequantized:>14.1f}"
                )


if __name__ == "__main__":
    main()

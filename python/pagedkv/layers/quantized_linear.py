"""A linear layer whose weight stays in GGUF's quantized blocks (`rust/cpu_kernels/quantized/`).

The forward pass is the core's kernel: activations quantized to 8 bits per block as llama.cpp
does, integer dot products per block, weights streamed at 4-8 bits. For the blocks of 32 (Q4_0,
Q4_1, Q8_0) it reads eight rows at a time for four tokens and beats torch's float32 GEMM at every
token count, so it runs at every count and a token's output does not depend on its batch; so do
the K-quants' (Q4_K, Q5_K, Q6_K) on x86 with AVX2 or AVX-512 VNNI: a row or two at a time for a
few tokens, then eight (AVX2) or sixteen (VNNI) rows interleaved (the same bits). Without an
integer path (no AVX2) the scalar kernel is slower above MAX_KERNEL_TOKENS, where the layer
dequantizes the weight and calls F.linear: the float weight is a temporary, so memory stays at
the quantized size.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv_core import _core

GGML_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

# Where the kernel runs at every token count (`_core.quantized_kernel_at_every_token_count`):
# benches/quantized_linear.py --threads 2 on the 2-core AVX-512 VNNI dev machine (2026-11-29), Q4_1
# kernel vs float32 F.linear on the dequantized weight, gate/up 1536x576: 14 vs 47 us at M = 1, 97
# vs 217 at 16, 367 vs 594 at 64, 773 vs 1281 at 128, 2989 vs 4419 at 512 (q/o 576x576 at 512:
# 1587 vs 1584); Q4_K, `--shapes llama-7b`, gate/up 11008x4096: 18 vs 42 ms at 64 (dequantize +
# F.linear 90).
# Q4_K on AVX2 (k_quant_tiles_avx2.rs, the same bench with the AVX2 path forced on the AVX-512
# machine, 2026-11-29): 7.7 vs 58 ms at 128 tokens on q/o 4096x4096 (F.linear on the float weight
# alone: 30).
# Elsewhere (no integer path), the K-quants' largest token count on the kernel; above it,
# dequantize + F.linear.
MAX_KERNEL_TOKENS = 16
# The K-quants' LM head: its 49,152 rows keep the kernel ahead to M ~ 64 (same bench). A step's
# head reads only the rows it samples, so this covers every decode step of up to 64 sequences.
MAX_HEAD_KERNEL_TOKENS = 64


@functools.cache
def _at_every_token_count(ggml_type: str) -> bool:
    return _core.quantized_kernel_at_every_token_count(ggml_type)


def kernel_takes(ggml_type: str, num_tokens: int, *, lm_head: bool = False) -> bool:
    """Whether `num_tokens` rows of activations go through the kernel (else dequantize + F.linear)."""
    if _at_every_token_count(ggml_type):
        return True
    return num_tokens <= (MAX_HEAD_KERNEL_TOKENS if lm_head else MAX_KERNEL_TOKENS)


def row_bytes(ggml_type: str, in_features: int) -> int:
    """Bytes of one weight row of `in_features` elements in `ggml_type` blocks."""
    block_len, block_bytes = _core.ggml_block_size(ggml_type)
    if in_features <= 0 or in_features % block_len:
        raise ValueError(f"in_features={in_features} is not a positive multiple of {ggml_type}'s block of {block_len}")
    return in_features // block_len * block_bytes


def dequantize(blocks: torch.Tensor, ggml_type: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of `shape` whose values `blocks` (uint8, GGUF's layout, row-major) hold."""
    if blocks.dtype != torch.uint8 or blocks.device.type != "cpu" or not blocks.is_contiguous():
        raise ValueError(f"blocks must be a contiguous uint8 CPU tensor, got {blocks.dtype} on {blocks.device}")
    out = torch.empty(shape, dtype=torch.float32)
    _core.dequantize_cpu(
        out.data_ptr(), out.numel(), blocks.data_ptr(), blocks.numel(), ggml_type, torch.get_num_threads()
    )
    return out


def quantized_linear(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: str, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] float32 @ dequantize(blocks)^T (+ bias) with the core's kernel: blocks uint8
    [out_features, K / block_len * block_bytes]."""
    in_features = x.shape[-1]
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU tensor, got {x.dtype} on {x.device}")
    if blocks.dtype != torch.uint8 or blocks.device.type != "cpu" or not blocks.is_contiguous():
        raise ValueError(f"blocks must be a contiguous uint8 CPU tensor, got {blocks.dtype} on {blocks.device}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous float32 [{out_features}], got {bias.dtype} {tuple(bias.shape)}")
    rows = x.reshape(-1, in_features).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    _core.quantized_linear_cpu(
        out.data_ptr(), rows.data_ptr(), blocks.data_ptr(), blocks.numel(),
        None if bias is None else bias.data_ptr(), ggml_type,
        (rows.shape[0], out_features, in_features), torch.get_num_threads(),
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], out_features)


class QuantizedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W [out_features, in_features] kept as GGUF blocks: the buffer
    `blocks` uint8 [out_features, bytes_per_row] (a GGUF tensor's bytes as stored) and its
    `ggml_type` (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K). Float32 CPU activations only."""

    def __init__(self, in_features: int, out_features: int, ggml_type: str, bias: bool = False):
        super().__init__()
        if ggml_type not in GGML_TYPES:
            raise ValueError(f"ggml_type must be one of {', '.join(GGML_TYPES)}, got {ggml_type!r}")
        self.in_features, self.out_features, self.ggml_type = in_features, out_features, ggml_type
        shape = (out_features, row_bytes(ggml_type, in_features))
        self.register_buffer("blocks", torch.zeros(shape, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 weight [out_features, in_features] (a new tensor each call)."""
        return dequantize(self.blocks, self.ggml_type, (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_takes(self.ggml_type, x.numel() // self.in_features):
            return quantized_linear(x, self.blocks, self.ggml_type, self.out_features, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, ggml_type={self.ggml_type}, bias={self.bias is not None}"


class StackedQuantizedLinear(nn.Module):
    """A fused projection (q, k and v) whose parts a GGUF stores as different types (a Q4_K_M
    file's Q6_K v beside Q4_K q and k): each part a QuantizedLinear, their outputs side by side,
    then the fused `bias` [out_features] (unlike a dequantized float32 stack, 7x the bytes)."""

    def __init__(self, parts: list[QuantizedLinear], bias: bool = False):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(part.out_features for part in parts)
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 weight [out_features, in_features] (a new tensor each call)."""
        return torch.cat([part.weight for part in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"bias={self.bias is not None}"


class QuantizedLMHeadProduct:
    """`model.lm_head_linear` (called as F.linear(hidden, weight, bias)) over the LM head's GGUF
    blocks: float32 rows through the kernel where it takes them (`kernel_takes`), which streams the
    blocks (a Q8_0 head is 3.8x fewer bytes than its float32 weight); others through F.linear on
    the float weight passed in (the same values), or on the blocks dequantized where none is (a
    tied table kept as blocks: layers.quantized_embedding)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: str, vocab_size: int):
        self.blocks, self.ggml_type, self.vocab_size = blocks, ggml_type, vocab_size

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens = hidden.numel() // hidden.shape[-1]
        if hidden.dtype == torch.float32 and kernel_takes(self.ggml_type, num_tokens, lm_head=True):
            return quantized_linear(hidden, self.blocks, self.ggml_type, self.vocab_size, bias)
        if weight is None:
            weight = dequantize(self.blocks, self.ggml_type, (self.vocab_size, hidden.shape[-1])).to(hidden.dtype)
        return F.linear(hidden, weight, bias)

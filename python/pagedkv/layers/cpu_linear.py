"""The CPU models' linear layers and LM head at decode sizes: `rust/cpu_kernels/small_m_linear.rs`
reads each weight row once for all of a step's rows, near the memory bandwidth, where torch's
matrix-vector products reach well under half of it. Above `MAX_KERNEL_ROWS` rows torch's GEMM
(which reuses each weight many times from cache) is faster and runs instead.

`use_cpu_linear(model)` turns it on for a loaded CPU model (the runner calls it unless
`EngineConfig.cpu_linear_kernel` is False); CUDA models and other dtypes keep torch's code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv_core import _core
from pagedkv.config import cpu_has_native_bfloat16
from pagedkv.layers.quantized_linear import QuantizedLMHeadProduct

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

# Rows up to which the kernel runs, by dtype; measured with benches/cpu_linear.py --threads 1 on
# SmolLM2-135M's shapes on a 2-core AVX2 machine (no AVX-512), torch 2.15: float32 at 16 rows the
# kernel's speed-up is 0.90-1.46x by shape and ahead summed over a layer; at 32 rows 0.82-1.28x, behind.
# bfloat16: torch's bfloat16 GEMM is emulated without AVX512-BF16 / AMX, 4-5x slower than the kernel
# at every size measured (1 to 512 rows). With those instructions (config.cpu_has_native_bfloat16)
# torch's bfloat16 GEMM is the fast one: float32's limit there, not measured.
MAX_KERNEL_ROWS = {torch.float32: 16, torch.bfloat16: 16 if cpu_has_native_bfloat16() else 512}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the kernel where it is faster (`supports`)."""
    if supports(x, weight, bias):
        return small_m_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear` runs the kernel: CPU tensors of one float32/bfloat16 dtype and at most
    MAX_KERNEL_ROWS rows. (Per call on every layer, so the cheapest checks only.)"""
    dtype = x.dtype
    max_rows = MAX_KERNEL_ROWS.get(dtype, 0)
    return (
        x.is_cpu
        and weight.dtype == dtype
        and (bias is None or bias.dtype == dtype)
        and x.numel() <= max_rows * x.shape[-1]
    )


def small_m_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, portable: bool = False
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, by the kernel at any
    number of rows; x float32 or bfloat16, weight and bias float32 or bfloat16, all on the CPU.
    `portable` runs the kernel's code without SIMD (tests). Raises ValueError naming the tensor
    that does not fit."""
    out_features, in_features = weight.shape if weight.dim() == 2 else (-1, -1)
    fits = (
        x.dtype in DTYPES
        and weight.dtype in DTYPES
        and x.is_cpu
        and weight.is_cpu
        and x.dim() >= 1
        and x.shape[-1] == in_features
        and (bias is None or (bias.shape == (out_features,) and bias.dtype == weight.dtype and bias.is_cpu))
    )
    if not fits:
        _refuse(x, weight, bias)
    # (a decode step makes ~100 of these calls: the common 2-D contiguous case skips the reshapes)
    rows = (x if x.dim() == 2 else x.reshape(-1, in_features)).contiguous()
    weight, bias = weight.contiguous(), None if bias is None else bias.contiguous()  # (kept alive for the call)
    out = x.new_empty(rows.shape[0], out_features)
    _core.small_m_linear_cpu(
        out.data_ptr(), rows.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        (rows.shape[0], in_features, out_features), torch.get_num_threads(), DTYPES[x.dtype],
        DTYPES[weight.dtype], portable,
    )  # fmt: skip
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def _refuse(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if not (x.is_cpu and weight.is_cpu and (bias is None or bias.is_cpu)):
        raise ValueError(f"tensors must be on the CPU, got x on {x.device} and weight on {weight.device}")
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        raise ValueError(f"x and weight must be float32 or bfloat16, got {x.dtype} and {weight.dtype}")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} (want x [..., K], weight [N, K])")
    raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}")


class CpuLinear(nn.Linear):
    """nn.Linear whose forward is `linear` (same parameters, state dict and LoRA targets)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class BFloat16Linear(nn.Module):
    """y = x @ W^T for float32 x with W kept in bfloat16 (a BF16 GGUF's linears as stored, on a CPU
    whose engine computes in float32: half the bytes a decode step streams). Up to
    MAX_KERNEL_ROWS[float32] rows through the kernel (float32 math on the widened weights); more
    through `wide_product` (torch's GEMM). No bias (the checkpoints that have one keep float32
    weights)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # The bits as int16, so that casting the model to its float dtype (Module.to) leaves them be
        self.register_buffer("weight_bits", torch.zeros(out_features, in_features, dtype=torch.int16))
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:
        """[out_features, in_features] bfloat16 (a view of the bits: writes go through)."""
        return self.weight_bits.view(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.numel() <= MAX_KERNEL_ROWS[torch.float32] * self.in_features:
            return small_m_linear(x, self.weight)
        return wide_product(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight bfloat16"


def wide_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for many rows of x and a bfloat16 weight: on a CPU with bfloat16 instructions
    torch's bfloat16 GEMM on x rounded to bfloat16 (the bfloat16 model's own arithmetic; float32
    GEMM on the widened weight ran 2.5-3.5x slower: a BF16 file's prefill at 0.37x llama.cpp's);
    elsewhere float32 GEMM on the weight widened (a temporary)."""
    if cpu_has_native_bfloat16():
        return F.linear(x.to(torch.bfloat16), weight).to(x.dtype)
    return F.linear(x, weight.to(x.dtype))


class BFloat16LMHeadProduct:
    """`model.lm_head_linear` over the LM head's bfloat16 weight (a BF16 GGUF's; a tied embedding
    table kept bfloat16 shares it: layers.quantized_embedding.BFloat16Embedding): up to
    MAX_KERNEL_ROWS[float32] rows through the kernel, more through `wide_product`; with a bias,
    F.linear on the float weight passed in (the same values), or on this one widened where none is."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is None and hidden.dtype == torch.float32 and hidden.numel() <= MAX_KERNEL_ROWS[torch.float32] * hidden.shape[-1]:
            return small_m_linear(hidden, self.weight)
        if bias is None:
            return wide_product(hidden, self.weight)
        return F.linear(hidden, self.weight.to(hidden.dtype) if weight is None else weight, bias)


def use_cpu_linear(model: nn.Module) -> None:
    """Routes a CPU model's nn.Linear layers (the LM head too: `model.lm_head_linear`) through
    `linear`; subclasses of nn.Linear (another layer's own forward) and an LM head kept as GGUF
    blocks are left alone."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = CpuLinear
    if hasattr(model, "lm_head_linear") and not isinstance(model.lm_head_linear, (QuantizedLMHeadProduct, BFloat16LMHeadProduct)):
        model.lm_head_linear = linear

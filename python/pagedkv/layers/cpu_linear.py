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

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

# Rows up to which the kernel beats F.linear. Measured with benches/cpu_linear.py on SmolLM2-135M's
# shapes (2 AVX2 cores, torch 2.x's oneDNN/MKL): MAX_KERNEL_ROWS_BY_DTYPE is filled in below.
MAX_KERNEL_ROWS = {torch.float32: 16, torch.bfloat16: 64}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the kernel where it is faster (`supports`)."""
    if not supports(x, weight, bias):
        return F.linear(x, weight, bias)
    return small_m_linear(x, weight, bias)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear` runs the kernel: CPU tensors of one float32/bfloat16 dtype, a contiguous
    weight, and at most MAX_KERNEL_ROWS rows."""
    dtype = x.dtype
    return (
        x.device.type == "cpu"
        and dtype in DTYPES
        and weight.dtype == dtype
        and weight.dim() == 2
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == dtype and bias.is_contiguous()))
        and x.numel() // max(1, x.shape[-1]) <= MAX_KERNEL_ROWS[dtype]
    )


def small_m_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, portable: bool = False
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, by the kernel at any
    number of rows; x float32 or bfloat16, weight and bias float32 or bfloat16, all on the CPU.
    `portable` runs the kernel's code without SIMD (tests). Raises ValueError naming the tensor
    that does not fit."""
    _check(x.device.type == weight.device.type == "cpu", f"tensors must be on the CPU, got {x.device} and {weight.device}")
    _check(x.dtype in DTYPES and weight.dtype in DTYPES, f"dtypes must be float32 or bfloat16, got {x.dtype} and {weight.dtype}")
    _check(weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1],
           f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} (want x [..., K], weight [N, K])")
    out_features, in_features = weight.shape
    if bias is not None:
        _check(bias.shape == (out_features,) and bias.dtype == weight.dtype,
               f"bias {tuple(bias.shape)} {bias.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}")
        bias = bias.contiguous()
    rows = x.reshape(-1, in_features).contiguous()
    weight = weight.contiguous()
    out = x.new_empty(rows.shape[0], out_features)
    _core.small_m_linear_cpu(
        out.data_ptr(), rows.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        (rows.shape[0], in_features, out_features), torch.get_num_threads(), DTYPES[x.dtype],
        DTYPES[weight.dtype], portable,
    )  # fmt: skip
    return out.view(*x.shape[:-1], out_features)


class CpuLinear(nn.Linear):
    """nn.Linear whose forward is `linear` (same parameters, state dict and LoRA targets)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_cpu_linear(model: nn.Module) -> None:
    """Routes a CPU model's nn.Linear layers (the LM head too: `model.lm_head_linear`) through
    `linear`; subclasses of nn.Linear (another layer's own forward) are left alone."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = CpuLinear
    if hasattr(model, "lm_head_linear"):
        model.lm_head_linear = linear


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)

"""The CPU's fused elementwise layers (`rust/cpu_kernels/layer_ops.rs`): residual add + RMSNorm,
SiLU-and-mul and rotary embedding, one pass over memory each on torch's OpenMP threads, where
torch runs 3 to 7 ops with float32 temporaries. Rounding follows the unfused ops.

For contiguous float32 / bfloat16 CPU tensors (`supports`); the layers keep their torch code
for everything else (GPUs, float16). `enabled = False` turns them off (benchmarks compare).
"""

from __future__ import annotations

import torch

from pagedkv_core import _core

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

enabled = True


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the fused ops take these tensors: CPU, contiguous, one float32/bfloat16 dtype."""
    dtype = tensors[0].dtype
    return enabled and dtype in DTYPES and all(
        t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors
    )


def rms_norm_(hidden: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> None:
    """In place on hidden [T, H] (and residual [T, H]): residual += hidden, then hidden =
    weight * normalize(residual); without a residual, hidden = weight * normalize(hidden)."""
    width = weight.shape[0]
    _check(hidden.dim() == 2 and hidden.shape[1] == width, f"hidden {tuple(hidden.shape)} for weight [{width}]")
    _check(residual is None or residual.shape == hidden.shape, "residual and hidden differ in shape")
    _core.rms_norm_cpu(
        hidden.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
        (hidden.shape[0], width), eps, torch.get_num_threads(), DTYPES[hidden.dtype],
    )  # fmt: skip


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] holding [gate | up] -> silu(gate) * up, [T, I]."""
    _check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, f"gate_up {tuple(gate_up.shape)} is not [T, 2I]")
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, width)
    _core.silu_and_mul_cpu(
        out.data_ptr(), gate_up.data_ptr(), (rows, width), torch.get_num_threads(), DTYPES[gate_up.dtype]
    )
    return out


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """Rotates the first num_heads heads of each row of qkv [T, W] in place by cos/sin [T, head_dim]."""
    num_tokens = qkv.shape[0]
    _check(
        qkv.dim() == 2 and cos.shape == sin.shape == (num_tokens, head_dim) and num_heads * head_dim <= qkv.shape[1],
        f"qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)} for {num_heads} heads of {head_dim}",
    )
    _core.rotary_cpu(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), (num_tokens, qkv.shape[1], num_heads, head_dim),
        torch.get_num_threads(), DTYPES[qkv.dtype],
    )  # fmt: skip


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)

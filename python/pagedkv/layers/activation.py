"""Gated MLP activations over the fused gate/up projection: SiLU-and-mul (Llama) and
tanh-approximated GELU-and-mul (Gemma)."""

import torch
import torch.nn.functional as F

from pagedkv.layers import cpu_fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] holding [gate | up] -> silu(gate) * up, [T, I]."""
    if cpu_fused.supports(gate_up):
        return cpu_fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] holding [gate | up] -> gelu(gate, tanh approximation) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up

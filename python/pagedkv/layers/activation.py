"""Gated MLP activations over the fused gate/up projection: SiLU-and-mul (Llama) and GELU-and-mul,
tanh-approximated or exact (Gemma)."""

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


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] holding [gate | up] -> gelu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


GATED_ACTIVATIONS = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "gelu_new": gelu_tanh_and_mul,
    "gelu": gelu_and_mul,
}


def gated_activation(name: str):
    """The act-and-mul function of a config's `hidden_act` / `hidden_activation` name."""
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(GATED_ACTIVATIONS)})")
    return GATED_ACTIVATIONS[name]

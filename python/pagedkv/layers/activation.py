"""Gated MLP activations over the fused gate/up projection: SiLU-and-mul (Llama), GELU-and-mul,
tanh-approximated or exact (Gemma), and GPT-OSS's clamped SwiGLU."""

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


def clamped_swiglu_and_mul(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's: [T, 2I] holding [gate | up] -> (up + 1) * gate * sigmoid(alpha * gate), the gate
    clamped to at most `limit` and up to [-limit, limit]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)


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

"""SiLU-and-mul, Llama's MLP activation over the fused gate/up projection."""

import torch
import torch.nn.functional as F

from pagedkv.layers import cpu_fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] holding [gate | up] -> silu(gate) * up, [T, I]."""
    if cpu_fused.supports(gate_up):
        return cpu_fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

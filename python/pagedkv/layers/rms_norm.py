"""RMSNorm, computed in float32 as HF transformers does, with vLLM's fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.layers import cpu_fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(hidden); with a residual, (norm(hidden + residual), hidden + residual). Takes
        ownership of hidden and residual: the CPU's fused op writes them in place."""
        if cpu_fused.supports(hidden, self.weight, *([] if residual is None else [residual])):
            if residual is None:
                hidden = hidden.clone()  # the caller keeps hidden as the residual stream
            cpu_fused.rms_norm_(hidden, residual, self.weight, self.eps)
            return hidden if residual is None else (hidden, residual)
        if residual is not None:
            hidden = residual = hidden + residual
        dtype = hidden.dtype
        normalized = hidden.float()
        variance = normalized.pow(2).mean(-1, keepdim=True)
        normalized = normalized * torch.rsqrt(variance + self.eps)
        out = self.weight * normalized.to(dtype)
        return out if residual is None else (out, residual)

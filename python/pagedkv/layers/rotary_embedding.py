"""Rotary position embedding with the checkpoint's rope settings (theta, llama3/linear/... scaling
through transformers' own rope initialisers), applied to flat [T, heads, D] tensors."""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.layers import cpu_fused


def rope_inverse_frequencies(hf_config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) exactly as transformers computes them for this config (for
    one `layer_type`'s settings in models whose `rope_parameters` are per layer type, as Gemma 3's)."""
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        parameters = parameters[layer_type]
    rope_type = parameters.get("rope_type", "default")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        extra = {} if layer_type is None else {"layer_type": layer_type}
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", **extra)
    base = parameters.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_positions`, cached in the model dtype."""

    def __init__(self, hf_config, max_positions: int, dtype: torch.dtype, layer_type: str | None = None):
        super().__init__()
        with torch.device("cpu"):  # real values even while the loader builds the model on "meta"
            inv_freq, scaling = rope_inverse_frequencies(hf_config, layer_type)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq.float())
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, D], for these positions: looked up once per forward pass and
        shared by every layer."""
        return self.cos[positions], self.sin[positions]


def split_and_rotate(qkv: torch.Tensor, cos_sin, num_heads: int, num_kv_heads: int, head_dim: int):
    """qkv [T, (Hq + 2 Hkv) D] -> query [T, Hq, D] and key [T, Hkv, D] rotated by the (cos, sin)
    of their positions, value [T, Hkv, D]. On the CPU, rotates qkv in place."""
    num_tokens = qkv.shape[0]
    cos, sin = cos_sin
    if cpu_fused.supports(qkv, cos, sin):
        cpu_fused.rotary_(qkv, cos, sin, num_heads + num_kv_heads, head_dim)
        query, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
        return (
            query.view(num_tokens, num_heads, head_dim),
            key.view(num_tokens, num_kv_heads, head_dim),
            value.view(num_tokens, num_kv_heads, head_dim),
        )
    query, key, value = split_heads(qkv, num_heads, num_kv_heads, head_dim)
    query, key = apply_rotary(cos_sin, query, key)
    return query, key, value


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """qkv [T, (Hq + 2 Hkv) D] -> views query [T, Hq, D], key and value [T, Hkv, D] (for layers
    without rotary embedding, e.g. SmolLM3's NoPE layers)."""
    return qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, head_dim).split([num_heads, num_kv_heads, num_kv_heads], 1)


def apply_rotary(cos_sin: tuple[torch.Tensor, torch.Tensor], query: torch.Tensor, key: torch.Tensor):
    """Rotates query [T, Hq, D] and key [T, Hkv, D] by the (cos, sin) [T, D] of their positions."""
    cos, sin = cos_sin[0].unsqueeze(1), cos_sin[1].unsqueeze(1)
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

"""Rotary position embedding with the checkpoint's rope settings (theta, llama3/linear/longrope/...
scaling through transformers' own rope initialisers, partial rotary factors), applied to flat
[T, heads, D] tensors."""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.layers import cpu_fused


def rope_inverse_frequencies(hf_config, layer_type: str | None = None, seq_len: int | None = None):
    """(inv_freq, attention_scaling) exactly as transformers computes them for this config (for
    one `layer_type`'s settings in models whose `rope_parameters` are per layer type, as Gemma 3's;
    at `seq_len` for types that depend on it, as LongRoPE's). A partial rotary factor (Phi's)
    gives frequencies for the rotated part of the head only."""
    parameters = rope_parameters(hf_config, layer_type)
    rope_type = parameters.get("rope_type", "default")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        extra = {} if layer_type is None else {"layer_type": layer_type}
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=seq_len, **extra)
    base = parameters.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    dim = int(head_dim * parameters.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, 1.0


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    return parameters[layer_type] if layer_type is not None else parameters


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_positions`, cached in the model dtype."""

    def __init__(self, hf_config, max_positions: int, dtype: torch.dtype, layer_type: str | None = None):
        super().__init__()
        with torch.device("cpu"):  # real values even while the loader builds the model on "meta"
            inv_freq, scaling = rope_inverse_frequencies(hf_config, layer_type)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq.float())
            parameters = rope_parameters(hf_config, layer_type)
            if parameters.get("rope_type") == "longrope" and parameters["original_max_position_embeddings"] < max_positions:
                # Short factors up to the pretraining length, long ones past it: a position's
                # rotation never depends on what else is in the batch (HF switches the whole
                # sequence at once, vLLM the whole batch; all agree below that length).
                original = parameters["original_max_position_embeddings"]
                long_inv_freq, _ = rope_inverse_frequencies(hf_config, layer_type, seq_len=original + 1)
                freqs[original:] = torch.outer(torch.arange(original, max_positions, dtype=torch.float),
                                               long_inv_freq.float())
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, D], for these positions: looked up once per forward pass and
        shared by every layer."""
        return self.cos[positions], self.sin[positions]


def split_and_rotate(qkv: torch.Tensor, cos_sin, num_heads: int, num_kv_heads: int, head_dim: int,
                     interleaved: bool = False):
    """qkv [T, (Hq + 2 Hkv) D] -> query [T, Hq, D] and key [T, Hkv, D] rotated by the (cos, sin)
    of their positions, value [T, Hkv, D]; `interleaved`: see apply_rotary. On the CPU, rotates
    qkv in place."""
    num_tokens = qkv.shape[0]
    cos, sin = cos_sin
    if cos.shape[-1] == head_dim and not interleaved and cpu_fused.supports(qkv, cos, sin):
        cpu_fused.rotary_(qkv, cos, sin, num_heads + num_kv_heads, head_dim)
        query, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
        return (
            query.view(num_tokens, num_heads, head_dim),
            key.view(num_tokens, num_kv_heads, head_dim),
            value.view(num_tokens, num_kv_heads, head_dim),
        )
    query, key, value = split_heads(qkv, num_heads, num_kv_heads, head_dim)
    query, key = apply_rotary(cos_sin, query, key, interleaved)
    return query, key, value


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """qkv [T, (Hq + 2 Hkv) D] -> views query [T, Hq, D], key and value [T, Hkv, D] (for layers
    without rotary embedding, e.g. SmolLM3's NoPE layers)."""
    return qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, head_dim).split([num_heads, num_kv_heads, num_kv_heads], 1)


def apply_rotary(cos_sin: tuple[torch.Tensor, torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                 interleaved: bool = False):
    """Rotates query [T, Hq, D] and key [T, Hkv, D] by the (cos, sin) [T, R] of their positions:
    the first R dims of each head (R < D: a partial rotary factor), the rest passed through.
    Frequency i turns dims (i, i + R/2), or with `interleaved` (GPT-J's and GLM's layout) dims
    (2i, 2i + 1)."""
    cos, sin = cos_sin[0].unsqueeze(1), cos_sin[1].unsqueeze(1)
    rotary_dim = cos.shape[-1]
    if rotary_dim < query.shape[-1]:
        (query, query_pass), (key, key_pass) = (x.split([rotary_dim, x.shape[-1] - rotary_dim], -1) for x in (query, key))
        query, key = apply_rotary(cos_sin, query, key, interleaved)
        return torch.cat([query, query_pass], -1), torch.cat([key, key_pass], -1)
    if interleaved:  # the tables hold each frequency twice, (f0..fn, f0..fn): make it (f0, f0, f1, f1, ...)
        cos = cos[..., : rotary_dim // 2].repeat_interleave(2, -1)
        sin = sin[..., : rotary_dim // 2].repeat_interleave(2, -1)
        return query * cos + _rotate_pairs(query) * sin, key * cos + _rotate_pairs(key) * sin
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

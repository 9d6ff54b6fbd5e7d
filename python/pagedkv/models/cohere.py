"""Cohere (`cohere`: Command-R, Aya Expanse) over the paged cache.

Llama's projections in parallel blocks: one norm per layer feeds attention and the MLP side by
side, and both add to the residual stream. Cohere's norms subtract the mean (a LayerNorm without
bias), its rotary embedding turns adjacent pairs of dims (GPT-J's layout), optional query/key
norms have weights per head, and the logits are scaled by `logit_scale`.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.models.blocks import ParallelBlock
from pagedkv.models.llama import LlamaAttention, LlamaMLP, PlainLayersForCausalLM
from pagedkv.models.registry import Traits


class CohereLayerNorm(nn.Module):
    """(x - mean) / std · weight over the last dim, in float32, no bias; `shape` (heads, head_dim)
    gives each head its own weights (the query/key norms)."""

    def __init__(self, shape, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float()
        centered = x - x.mean(-1, keepdim=True)
        normalized = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normalized).to(hidden.dtype)


class PerHeadNormAttention(LlamaAttention):
    """Llama's attention with optional query/key LayerNorms (no bias) whose weights differ per head
    (Cohere's, StableLM's)."""

    def __init__(self, hf_config, traits: Traits, layer_index: int, qk_norm: bool, eps: float):
        super().__init__(hf_config, traits, layer_index)
        if qk_norm:
            self.q_norm = CohereLayerNorm((self.num_heads, self.head_dim), eps)
            self.k_norm = CohereLayerNorm((self.num_kv_heads, self.head_dim), eps)

    def _normalize_query_and_key_(self, qkv: torch.Tensor) -> None:
        """Each query and key head normalized with its own weights, before the rotation."""
        num_tokens = qkv.shape[0]
        query, key = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        qkv[:, : self.q_size] = self.q_norm(query.reshape(num_tokens, self.num_heads, self.head_dim)).flatten(1)
        qkv[:, self.q_size : self.q_size + self.kv_size] = self.k_norm(
            key.reshape(num_tokens, self.num_kv_heads, self.head_dim)).flatten(1)


def cohere_layer(hf_config, traits: Traits, layer_index: int) -> ParallelBlock:
    return ParallelBlock(
        CohereLayerNorm(hf_config.hidden_size, hf_config.layer_norm_eps),
        # (rotating pairs of dims: a trait)
        PerHeadNormAttention(hf_config, traits, layer_index, hf_config.use_qk_norm, hf_config.layer_norm_eps),
        LlamaMLP(hf_config, layer_index),
    )


class CohereForCausalLM(PlainLayersForCausalLM):
    """Cohere, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = staticmethod(cohere_layer)
    norm_class = CohereLayerNorm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.hf_config.logit_scale

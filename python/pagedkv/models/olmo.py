"""OLMo 1 (`olmo`: OLMo-1B/7B in transformers' format) over the paged cache.

Llama's blocks with LayerNorms that learn nothing (no weight, no bias) and, optionally, q/k/v
clipped to [-clip_qkv, clip_qkv].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class OlmoLayerNorm(nn.Module):
    """LayerNorm without weight or bias, in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(hidden.float(), self.normalized_shape, None, None, self.eps).to(hidden.dtype)


class OlmoDecoderLayer(nn.Module):
    is_moe = False

    def __init__(self, hf_config, layer_index: int):
        super().__init__()
        self.input_layernorm = OlmoLayerNorm(hf_config.hidden_size)
        self.self_attn = LlamaAttention(hf_config, layer_index)  # (with clip_qkv)
        self.post_attention_layernorm = OlmoLayerNorm(hf_config.hidden_size)
        self.mlp = LlamaMLP(hf_config, layer_index)

    def forward(self, hidden, cos_sin, metadata, kv_cache, backend, lora=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos_sin, metadata, kv_cache, backend, lora)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), lora)


class OlmoForCausalLM(LlamaForCausalLM):
    """OLMo 1, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = OlmoDecoderLayer
    norm_class = OlmoLayerNorm

    def forward(self, input_ids, positions, metadata: AttentionMetadata, kv_cache, backend, lora=None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer, cos_sin in zip(self.layers, self.layer_rotations(positions)):
            hidden = layer(hidden, cos_sin, metadata, kv_cache, backend, lora)
        return self.norm(hidden)

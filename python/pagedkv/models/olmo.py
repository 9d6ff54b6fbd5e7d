"""OLMo 1 (`olmo`: OLMo-1B/7B in transformers' format) over the paged cache.

Llama's blocks with LayerNorms that learn nothing (no weight, no bias) and, optionally, q/k/v
clipped to [-clip_qkv, clip_qkv].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.models.blocks import PreNormBlock
from pagedkv.models.llama import LlamaAttention, LlamaMLP, PlainLayersForCausalLM
from pagedkv.models.registry import Traits


class OlmoLayerNorm(nn.Module):
    """LayerNorm without weight or bias, in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(hidden.float(), self.normalized_shape, None, None, self.eps).to(hidden.dtype)


def olmo_layer(hf_config, traits: Traits, layer_index: int) -> PreNormBlock:
    return PreNormBlock(OlmoLayerNorm(hf_config.hidden_size), LlamaAttention(hf_config, traits, layer_index),  # (with clip_qkv)
                        OlmoLayerNorm(hf_config.hidden_size), LlamaMLP(hf_config, layer_index))


class OlmoForCausalLM(PlainLayersForCausalLM):
    """OLMo 1, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = staticmethod(olmo_layer)
    norm_class = OlmoLayerNorm

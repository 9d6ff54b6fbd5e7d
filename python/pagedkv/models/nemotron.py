"""Nemotron (`nemotron`: Nemotron-3/4, Minitron, Nemotron-Mini) over the paged cache.

Llama's attention (rotary embedding on half of each head) in pre-norm blocks with LayerNorms whose
weights are stored as offsets from 1 ("1P"), and a two-matrix MLP with squared ReLU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models.llama import LlamaAttention, LlamaForCausalLM


class LayerNorm1P(nn.LayerNorm):
    """LayerNorm with weight (1 + w) and a bias, in float32."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(hidden.float(), self.normalized_shape, self.weight.float() + 1.0, self.bias.float(),
                            self.eps).to(hidden.dtype)


class NemotronDecoderLayer(nn.Module):
    is_moe = False

    def __init__(self, hf_config, layer_index: int):
        super().__init__()
        self.input_layernorm = LayerNorm1P(hf_config.hidden_size, hf_config.norm_eps)
        self.self_attn = LlamaAttention(hf_config, layer_index)
        self.post_attention_layernorm = LayerNorm1P(hf_config.hidden_size, hf_config.norm_eps)
        self.mlp = UngatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act, layer_index,
                              bias=hf_config.mlp_bias)

    def forward(self, hidden, cos_sin, metadata, kv_cache, backend, lora=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos_sin, metadata, kv_cache, backend, lora)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), lora)


class NemotronForCausalLM(LlamaForCausalLM):
    """Nemotron, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = NemotronDecoderLayer
    norm_class = LayerNorm1P

    def forward(self, input_ids, positions, metadata: AttentionMetadata, kv_cache, backend, lora=None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer, cos_sin in zip(self.layers, self.layer_rotations(positions)):
            hidden = layer(hidden, cos_sin, metadata, kv_cache, backend, lora)
        return self.norm(hidden)

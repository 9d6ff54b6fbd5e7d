"""StarCoder2 (`starcoder2`) over the paged cache.

Llama's attention, with biases on every projection, in GPT-style blocks: LayerNorms (with bias)
before attention and MLP, a two-matrix MLP with GELU, tied embeddings. Every layer attends to a
sliding window (4,096 positions in the released models), so the scheduler releases each
sequence's blocks behind it.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models.llama import LlamaAttention, LlamaForCausalLM


class Starcoder2DecoderLayer(nn.Module):
    is_moe = False

    def __init__(self, hf_config, layer_index: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hf_config.hidden_size, hf_config.norm_epsilon)
        self.self_attn = LlamaAttention(hf_config, layer_index)
        self.post_attention_layernorm = nn.LayerNorm(hf_config.hidden_size, hf_config.norm_epsilon)
        self.mlp = UngatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act, layer_index,
                              bias=hf_config.use_bias)

    def forward(self, hidden, cos_sin, metadata, kv_cache, backend, lora=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos_sin, metadata, kv_cache, backend, lora)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), lora)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """StarCoder2, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = Starcoder2DecoderLayer
    norm_class = nn.LayerNorm

    def forward(self, input_ids, positions, metadata: AttentionMetadata, kv_cache, backend, lora=None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer, cos_sin in zip(self.layers, self.layer_rotations(positions)):
            hidden = layer(hidden, cos_sin, metadata, kv_cache, backend, lora)
        return self.norm(hidden)

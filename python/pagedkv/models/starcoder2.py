"""StarCoder2 (`starcoder2`) over the paged cache.

Llama's attention, with biases on every projection, in GPT-style blocks: LayerNorms (with bias)
before attention and MLP, a two-matrix MLP with GELU, tied embeddings. Every layer attends to a
sliding window (4,096 positions in the released models), so the scheduler releases each
sequence's blocks behind it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.models.llama import LlamaAttention, LlamaForCausalLM


class Starcoder2MLP(nn.Module):
    """c_proj(gelu(c_fc(x))); GELU's tanh approximation for `gelu_pytorch_tanh` (the released
    models') and `gelu_new`, exact for `gelu`. Phi-2's fc1/fc2 MLP is the same."""

    def __init__(self, hf_config, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        if hf_config.hidden_act not in ("gelu_pytorch_tanh", "gelu_new", "gelu"):
            raise ValueError(f"StarCoder2 hidden_act {hf_config.hidden_act!r} is not supported "
                             "(gelu_pytorch_tanh, gelu_new or gelu)")
        self.approximate = "none" if hf_config.hidden_act == "gelu" else "tanh"
        bias = getattr(hf_config, "use_bias", True)
        self.c_fc = nn.Linear(hf_config.hidden_size, hf_config.intermediate_size, bias=bias)
        self.c_proj = nn.Linear(hf_config.intermediate_size, hf_config.hidden_size, bias=bias)

    def forward(self, hidden, lora=None):
        up = self.c_fc(hidden)
        if lora is not None:
            lora.add(self.layer_index, "c_fc", hidden, up)
        activated = F.gelu(up, approximate=self.approximate)
        out = self.c_proj(activated)
        if lora is not None:
            lora.add(self.layer_index, "c_proj", activated, out)
        return out


class Starcoder2DecoderLayer(nn.Module):
    is_moe = False

    def __init__(self, hf_config, layer_index: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hf_config.hidden_size, hf_config.norm_epsilon)
        self.self_attn = LlamaAttention(hf_config, layer_index)
        self.post_attention_layernorm = nn.LayerNorm(hf_config.hidden_size, hf_config.norm_epsilon)
        self.mlp = Starcoder2MLP(hf_config, layer_index)

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

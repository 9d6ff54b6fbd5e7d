"""GPT-NeoX (`gpt_neox`: Pythia, GPT-NeoX-20B, Dolly v2) over the paged cache.

Two LayerNorms (with bias) per layer, attention and a GELU MLP side by side off them (parallel
residual, Pythia's) or one after the other, biased projections, rotary embedding on a quarter of
each head. The checkpoint's fused query_key_value holds q, k and v interleaved per head; it is
split at load into Llama's attention; its MLP is the ungated one (layers/ungated_mlp.py).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models.llama import LlamaAttention, LlamaForCausalLM

_CHECKPOINT_NAMES = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
                     ("gpt_neox.", "model."), ("embed_out.", "lm_head."), (".attention.dense.", ".self_attn.o_proj."),
                     (".mlp.dense_h_to_4h.", ".mlp.c_fc."), (".mlp.dense_4h_to_h.", ".mlp.c_proj."))


class GPTNeoXLayer(nn.Module):
    is_moe = False

    def __init__(self, hf_config, layer_index: int):
        super().__init__()
        self.use_parallel_residual = hf_config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(hf_config.hidden_size, hf_config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(hf_config.hidden_size, hf_config.layer_norm_eps)
        self.self_attn = LlamaAttention(hf_config, layer_index)
        self.mlp = UngatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act, layer_index)

    def forward(self, hidden, cos_sin, metadata, kv_cache, backend, lora=None):
        attended = self.self_attn(self.input_layernorm(hidden), cos_sin, metadata, kv_cache, backend, lora)
        if self.use_parallel_residual:
            return hidden + attended + self.mlp(self.post_attention_layernorm(hidden), lora)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden), lora)


class GPTNeoXForCausalLM(LlamaForCausalLM):
    """GPT-NeoX, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = GPTNeoXLayer
    norm_class = nn.LayerNorm

    def forward(self, input_ids, positions, metadata: AttentionMetadata, kv_cache, backend, lora=None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer, cos_sin in zip(self.layers, self.layer_rotations(positions)):
            hidden = layer(hidden, cos_sin, metadata, kv_cache, backend, lora)
        return self.norm(hidden)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        attention = self.layers[0].self_attn
        renamed = {}
        for name, tensor in state.items():
            for theirs, ours in _CHECKPOINT_NAMES:
                name = name.replace(theirs, ours)
            if ".attention.query_key_value." in name:  # [heads, (q, k, v), head_dim, ...] -> q, k, v
                per_head = tensor.view(attention.num_heads, 3, attention.head_dim, *tensor.shape[1:])
                for index, part in enumerate("qkv"):
                    renamed[name.replace(".attention.query_key_value.", f".self_attn.{part}_proj.")] = (
                        per_head[:, index].reshape(-1, *tensor.shape[1:]))
                continue
            renamed[name] = tensor
        super().load_hf_state_dict(renamed)

"""Falcon (`falcon`: Falcon-7B/40B/180B, Falcon 2) over the paged cache.

LayerNorm (with bias) before attention and a GELU MLP that run side by side off it (Falcon-7B's
parallel attention, one norm), off a norm each (`new_decoder_architecture`: Falcon-40B/180B), or
off one shared norm again (Falcon 2's `num_ln_in_parallel_attn=1`); or one after the other. Rotary
embedding on whole heads; one KV head (`multi_query`, Falcon-7B) or grouped ones (the new
architecture). The checkpoint's fused query_key_value orders heads per KV group (new
architecture: each group's queries, then its key and value), queries then the one key and value
(multi-query), or q, k, v per head (multi-head); it is split at load into Llama's attention.
ALiBi checkpoints (Falcon-RW) are refused.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models.blocks import ParallelBlock, PreNormBlock
from pagedkv.models.gpt_neox import split_per_head_qkv
from pagedkv.models.llama import LlamaAttention, PlainLayersForCausalLM
from pagedkv.models.registry import Traits


def num_kv_heads(hf_config) -> int:
    if hf_config.new_decoder_architecture:
        return hf_config.num_kv_heads
    return 1 if hf_config.multi_query else hf_config.num_attention_heads


def falcon_layer(hf_config, traits: Traits, layer_index: int) -> nn.Module:
    if hf_config.alibi:
        raise ValueError("Falcon with ALiBi positions (alibi=true, Falcon-RW) is not supported")
    hidden, eps = hf_config.hidden_size, hf_config.layer_norm_epsilon
    attention_config = copy.copy(hf_config)  # in the names LlamaAttention reads
    attention_config.num_key_value_heads, attention_config.attention_bias = num_kv_heads(hf_config), hf_config.bias
    attention = LlamaAttention(attention_config, traits, layer_index)
    mlp = UngatedMLP(hidden, hf_config.ffn_hidden_size, hf_config.activation, layer_index, bias=hf_config.bias)
    if hf_config.new_decoder_architecture:
        if not hf_config.parallel_attn:
            raise ValueError("Falcon's new decoder architecture runs attention and MLP in parallel (parallel_attn=true)")
        two_norms = (hf_config.num_ln_in_parallel_attn or 2) == 2
        return ParallelBlock(nn.LayerNorm(hidden, eps), attention, mlp,
                             post_attention_layernorm=nn.LayerNorm(hidden, eps) if two_norms else None)
    if hf_config.parallel_attn:
        return ParallelBlock(nn.LayerNorm(hidden, eps), attention, mlp)
    return PreNormBlock(nn.LayerNorm(hidden, eps), attention, nn.LayerNorm(hidden, eps), mlp)


class FalconForCausalLM(PlainLayersForCausalLM):
    """Falcon, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = staticmethod(falcon_layer)
    norm_class = nn.LayerNorm
    checkpoint_names = (("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
                        ("transformer.h.", "model.layers."), (".self_attention.dense.", ".self_attn.o_proj."),
                        (".mlp.dense_h_to_4h.", ".mlp.c_fc."), (".mlp.dense_4h_to_h.", ".mlp.c_proj."),
                        (".ln_attn.", ".input_layernorm."), (".ln_mlp.", ".post_attention_layernorm."))

    def own_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | list]:
        attention = self.layers[0].self_attn
        heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        split = {}
        for name, tensor in state.items():
            if ".self_attention.query_key_value." not in name:
                split[name] = tensor
                continue
            rest = tensor.shape[1:]
            if self.hf_config.new_decoder_architecture:  # [kv group, (its queries, key, value), head_dim]
                grouped = tensor.view(kv_heads, heads // kv_heads + 2, head_dim, *rest)
                parts = grouped[:, :-2], grouped[:, -2], grouped[:, -1]
            elif self.hf_config.multi_query:  # [queries, key, value] heads
                rows = tensor.view(heads + 2, head_dim, *rest)
                parts = rows[:-2], rows[-2], rows[-1]
            else:
                parts = split_per_head_qkv(tensor, heads, head_dim)
            for part, values in zip("qkv", parts):
                split[name.replace(".self_attention.query_key_value.", f".self_attn.{part}_proj.")] = (
                    values.reshape(-1, *rest))
        return super().own_weights(split)

"""GPT-NeoX (`gpt_neox`: Pythia, GPT-NeoX-20B, Dolly v2) over the paged cache.

Two LayerNorms (with bias) per layer, attention and a GELU MLP side by side off them (parallel
residual, Pythia's) or one after the other, biased projections, rotary embedding on a quarter of
each head. The checkpoint's fused query_key_value holds q, k and v interleaved per head; it is
split at load into Llama's attention; its MLP is the ungated one (layers/ungated_mlp.py).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models.blocks import ParallelBlock, PreNormBlock
from pagedkv.models.llama import LlamaAttention, PlainLayersForCausalLM
from pagedkv.models.registry import Traits


def gpt_neox_layer(hf_config, traits: Traits, layer_index: int) -> nn.Module:
    hidden, eps = hf_config.hidden_size, hf_config.layer_norm_eps
    attention = LlamaAttention(hf_config, traits, layer_index)
    mlp = UngatedMLP(hidden, hf_config.intermediate_size, hf_config.hidden_act, layer_index)
    if hf_config.use_parallel_residual:
        return ParallelBlock(nn.LayerNorm(hidden, eps), attention, mlp, post_attention_layernorm=nn.LayerNorm(hidden, eps))
    return PreNormBlock(nn.LayerNorm(hidden, eps), attention, nn.LayerNorm(hidden, eps), mlp)


class GPTNeoXForCausalLM(PlainLayersForCausalLM):
    """GPT-NeoX, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = staticmethod(gpt_neox_layer)
    norm_class = nn.LayerNorm
    checkpoint_names = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
                        ("gpt_neox.", "model."), ("embed_out.", "lm_head."), (".attention.dense.", ".self_attn.o_proj."),
                        (".mlp.dense_h_to_4h.", ".mlp.c_fc."), (".mlp.dense_4h_to_h.", ".mlp.c_proj."))

    def own_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | list]:
        attention = self.layers[0].self_attn
        split = {}
        for name, tensor in state.items():
            if ".attention.query_key_value." in name:
                for part, values in zip("qkv", split_per_head_qkv(tensor, attention.num_heads, attention.head_dim)):
                    split[name.replace(".attention.query_key_value.", f".self_attn.{part}_proj.")] = values
            else:
                split[name] = tensor
        return super().own_weights(split)


def split_per_head_qkv(tensor: torch.Tensor, num_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """q, k, v weights (or biases) of a fused projection stored [heads, (q, k, v), head_dim, ...]
    (GPT-NeoX's and multi-head Falcon's layout)."""
    per_head = tensor.view(num_heads, 3, head_dim, *tensor.shape[1:])
    return tuple(per_head[:, index].reshape(-1, *tensor.shape[1:]) for index in range(3))

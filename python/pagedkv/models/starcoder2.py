"""StarCoder2 (`starcoder2`) over the paged cache.

Llama's attention, with biases on every projection, in GPT-style blocks: LayerNorms (with bias)
before attention and MLP, a two-matrix MLP with GELU, tied embeddings. Every layer attends to a
sliding window (4,096 positions in the released models), so the scheduler releases each
sequence's blocks behind it.
"""

from __future__ import annotations

from torch import nn

from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models.blocks import PreNormBlock
from pagedkv.models.llama import LlamaAttention, PlainLayersForCausalLM
from pagedkv.models.registry import Traits


def starcoder2_layer(hf_config, traits: Traits, layer_index: int) -> PreNormBlock:
    return PreNormBlock(
        nn.LayerNorm(hf_config.hidden_size, hf_config.norm_epsilon),
        LlamaAttention(hf_config, traits, layer_index),
        nn.LayerNorm(hf_config.hidden_size, hf_config.norm_epsilon),
        UngatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act, layer_index,
                   bias=hf_config.use_bias),
    )


class Starcoder2ForCausalLM(PlainLayersForCausalLM):
    """StarCoder2, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = staticmethod(starcoder2_layer)
    norm_class = nn.LayerNorm

"""Nemotron (`nemotron`: Nemotron-3/4, Minitron, Nemotron-Mini) over the paged cache.

Llama's attention (rotary embedding on half of each head) in pre-norm blocks with LayerNorms whose
weights are stored as offsets from 1 ("1P"), and a two-matrix MLP with squared ReLU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models.blocks import PreNormBlock
from pagedkv.models.llama import LlamaAttention, PlainLayersForCausalLM
from pagedkv.models.registry import Traits


class LayerNorm1P(nn.LayerNorm):
    """LayerNorm with weight (1 + w) and a bias, in float32."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(hidden.float(), self.normalized_shape, self.weight.float() + 1.0, self.bias.float(),
                            self.eps).to(hidden.dtype)


def nemotron_layer(hf_config, traits: Traits, layer_index: int) -> PreNormBlock:
    return PreNormBlock(
        LayerNorm1P(hf_config.hidden_size, hf_config.norm_eps),
        LlamaAttention(hf_config, traits, layer_index),
        LayerNorm1P(hf_config.hidden_size, hf_config.norm_eps),
        UngatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act, layer_index,
                   bias=hf_config.mlp_bias),
    )


class NemotronForCausalLM(PlainLayersForCausalLM):
    """Nemotron, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = staticmethod(nemotron_layer)
    norm_class = LayerNorm1P

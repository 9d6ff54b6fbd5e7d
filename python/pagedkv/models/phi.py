"""Phi-1, Phi-1.5 and Phi-2 (`phi`) over the paged cache.

Parallel blocks: one LayerNorm (with bias) per layer feeds attention and a GELU MLP side by side,
both adding to the residual stream; biases on every projection and on the LM head, rotary
embedding on part of each head (40% in Phi-2). Checkpoint names map onto the ungated MLP
(fc1, fc2 -> c_fc, c_proj) and Llama's attention (dense -> o_proj).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models.blocks import ParallelBlock
from pagedkv.models.llama import LlamaAttention, PlainLayersForCausalLM
from pagedkv.models.registry import Traits


class PhiAttention(LlamaAttention):
    def __init__(self, hf_config, traits: Traits, layer_index: int):
        if getattr(hf_config, "qk_layernorm", False):
            raise ValueError("Phi with qk_layernorm=True is not supported")
        super().__init__(hf_config, traits, layer_index)
        self.qkv_proj = nn.Linear(hf_config.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = nn.Linear(self.q_size, hf_config.hidden_size, bias=True)


def phi_layer(hf_config, traits: Traits, layer_index: int) -> ParallelBlock:
    return ParallelBlock(
        nn.LayerNorm(hf_config.hidden_size, hf_config.layer_norm_eps),
        PhiAttention(hf_config, traits, layer_index),
        UngatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act, layer_index),
    )


class PhiForCausalLM(PlainLayersForCausalLM):
    """Phi-1/1.5/2, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp); its LM head has a bias."""

    decoder_layer_class = staticmethod(phi_layer)
    norm_class = nn.LayerNorm
    checkpoint_names = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.c_fc."),
                        (".mlp.fc2.", ".mlp.c_proj."), ("model.final_layernorm.", "model.norm."))

    def __init__(self, hf_config, traits: Traits, max_positions: int, dtype: torch.dtype):
        super().__init__(hf_config, traits, max_positions, dtype)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=True)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tie_word_embeddings:
            return super().compute_logits(hidden)
        return self.lm_head_linear(hidden, self.lm_head.weight, self.lm_head.bias).float()

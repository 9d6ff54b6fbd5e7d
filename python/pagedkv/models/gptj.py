"""GPT-J (`gptj`: GPT-J-6B and its fine-tunes) over the paged cache.

Parallel blocks as Phi-2's (one LayerNorm feeds attention and the GELU MLP side by side), but
q/k/v and output projections without bias, and rotary embedding over adjacent pairs of the
first `rotary_dim` dims of each head. The LM head has a bias.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models.blocks import ParallelBlock
from pagedkv.models.llama import LlamaAttention
from pagedkv.models.phi import PhiForCausalLM
from pagedkv.models.registry import Traits


def gptj_layer(hf_config, traits: Traits, layer_index: int) -> ParallelBlock:
    hidden = hf_config.hidden_size
    return ParallelBlock(
        nn.LayerNorm(hidden, hf_config.layer_norm_epsilon),
        LlamaAttention(hf_config, traits, layer_index),  # (pairs rotated: a trait)
        UngatedMLP(hidden, hf_config.n_inner or 4 * hidden, hf_config.activation_function, layer_index),
    )


class GPTJForCausalLM(PhiForCausalLM):
    """GPT-J, with the interface of LlamaForCausalLM (Phi-2's biased LM head)."""

    decoder_layer_class = staticmethod(gptj_layer)
    checkpoint_names = (("transformer.wte.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
                        ("transformer.h.", "model.layers."), (".ln_1.", ".input_layernorm."), (".attn.", ".self_attn."),
                        (".self_attn.out_proj.", ".self_attn.o_proj."), (".mlp.fc_in.", ".mlp.c_fc."),
                        (".mlp.fc_out.", ".mlp.c_proj."))

    def __init__(self, hf_config, traits: Traits, max_positions: int, dtype: torch.dtype):
        # (the rotary tables read the rotated share of a head as Phi's partial_rotary_factor)
        hf_config.partial_rotary_factor = hf_config.rotary_dim / (hf_config.hidden_size // hf_config.num_attention_heads)
        super().__init__(hf_config, traits, max_positions, dtype)

    def own_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | list]:
        # (old checkpoints carry causal-mask buffers)
        return super().own_weights({n: t for n, t in state.items() if not n.endswith((".attn.bias", ".attn.masked_bias"))})

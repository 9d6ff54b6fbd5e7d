"""OPT (`opt`: Meta's OPT-125M to 66B, the vLLM paper's models) over the paged cache.

GPT-2's shape with its own names: learned absolute positions (offset by 2, OPT's convention),
pre-LayerNorm blocks with biased projections, a ReLU MLP, tied embeddings. OPT-350M's post-norm
blocks and projected embeddings are not supported.
"""

from __future__ import annotations

from torch import nn

from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models.blocks import PreNormBlock
from pagedkv.models.gpt2 import AbsolutePositionAttention, GPT2ForCausalLM
from pagedkv.models.registry import Traits


def opt_layer(hf_config, traits: Traits, layer_index: int) -> PreNormBlock:
    if not hf_config.do_layer_norm_before or hf_config.word_embed_proj_dim != hf_config.hidden_size:
        raise ValueError("OPT with post-norm blocks or projected embeddings (OPT-350M) is not supported")
    hidden, bias = hf_config.hidden_size, hf_config.enable_bias
    return PreNormBlock(
        nn.LayerNorm(hidden), AbsolutePositionAttention(hf_config, traits, layer_index, bias=bias), nn.LayerNorm(hidden),
        UngatedMLP(hidden, hf_config.ffn_dim, hf_config.activation_function, layer_index, bias=bias),
    )


class OPTForCausalLM(GPT2ForCausalLM):
    """OPT, with the interface of LlamaForCausalLM (GPT-2's learned positions, offset by 2)."""

    decoder_layer_class = staticmethod(opt_layer)
    checkpoint_names = (("model.decoder.final_layer_norm.", "model.norm."),  # (the model's, before a layer's)
                        ("model.decoder.embed_positions.", "model.position_embeddings."), ("model.decoder.", "model."),
                        (".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn_layer_norm.", ".input_layernorm."),
                        (".final_layer_norm.", ".post_attention_layernorm."), (".fc1.", ".mlp.c_fc."),
                        (".fc2.", ".mlp.c_proj."))
    conv1d_weights = False
    position_offset = 2

"""GPT-2 (`gpt2`) over the paged cache.

Learned absolute position embeddings (no rotary), pre-LayerNorm blocks with biased projections,
the ungated GELU MLP, tied embeddings. Checkpoints store projections as Conv1D ([in, out]
weights, transposed at load) and q/k/v fused as `c_attn`.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models.blocks import PreNormBlock
from pagedkv.models.llama import LlamaAttention, PlainLayersForCausalLM
from pagedkv.models.registry import Traits

_CONV1D = (".self_attn.qkv_proj.weight", ".self_attn.o_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


class AbsolutePositionAttention(LlamaAttention):
    """Llama's attention without rotary embedding, biased q/k/v and output projections (GPT-2's,
    OPT's)."""

    def __init__(self, hf_config, traits: Traits, layer_index: int, bias: bool = True):
        super().__init__(hf_config, traits, layer_index)
        self.use_rope = False
        self.qkv_proj = nn.Linear(hf_config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hf_config.hidden_size, bias=bias)


def gpt2_layer(hf_config, traits: Traits, layer_index: int) -> PreNormBlock:
    if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False) or not getattr(hf_config, "scale_attn_weights", True):
        raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx or without scale_attn_weights is not supported")
    hidden, eps = hf_config.hidden_size, hf_config.layer_norm_epsilon
    return PreNormBlock(
        nn.LayerNorm(hidden, eps), AbsolutePositionAttention(hf_config, traits, layer_index), nn.LayerNorm(hidden, eps),
        UngatedMLP(hidden, hf_config.n_inner or 4 * hidden, hf_config.activation_function, layer_index),
    )


class GPT2ForCausalLM(PlainLayersForCausalLM):
    """GPT-2, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = staticmethod(gpt2_layer)
    norm_class = nn.LayerNorm
    checkpoint_names = (("transformer.wte.", "model.embed_tokens."), ("transformer.wpe.", "model.position_embeddings."),
                        ("transformer.ln_f.", "model.norm."), ("transformer.h.", "model.layers."),
                        (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
                        (".attn.c_attn.", ".self_attn.qkv_proj."), (".attn.c_proj.", ".self_attn.o_proj."))
    conv1d_weights = True  # projections stored [in, out] (GPT-2's Conv1D), transposed at load
    position_offset = 0

    def __init__(self, hf_config, traits: Traits, max_positions: int, dtype: torch.dtype):
        super().__init__(hf_config, traits, max_positions, dtype)
        self.position_embeddings = nn.Embedding(hf_config.max_position_embeddings + self.position_offset,
                                                hf_config.hidden_size)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) + self.position_embeddings(positions + self.position_offset)

    def renamed(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # (old checkpoints carry causal-mask buffers)
        state = {n: t for n, t in state.items() if not n.endswith((".attn.bias", ".attn.masked_bias"))}
        return {name: tensor.t() if self.conv1d_weights and name.endswith(_CONV1D) else tensor
                for name, tensor in super().renamed(state).items()}

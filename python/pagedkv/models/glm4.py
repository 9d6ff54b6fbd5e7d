"""GLM-4 (`glm4`: GLM-4-9B-0414, GLM-Z1) over the paged cache.

Llama's blocks with Zhipu's changes: norms on what attention and the MLP add to the residual
stream besides those before them (four per layer), rotary embedding on the first half of each
head only and over adjacent pairs of dims (GPT-J's layout), biases on q/k/v but not on the output
projection, and gate/up stored fused.
"""

from __future__ import annotations

from torch import nn

from pagedkv.attention.step_context import StepContext
from pagedkv.layers.rms_norm import RMSNorm
from pagedkv.models.llama import LlamaAttention, LlamaMLP, PlainLayersForCausalLM
from pagedkv.models.registry import Traits


class Glm4DecoderLayer(nn.Module):
    is_moe = False

    def __init__(self, hf_config, traits: Traits, layer_index: int):
        super().__init__()
        self.self_attn = LlamaAttention(hf_config, traits, layer_index)  # (pairs rotated, o_proj unbiased: traits)
        self.mlp = LlamaMLP(hf_config, layer_index)
        norm = lambda: RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_self_attn_layernorm = norm(), norm()
        self.post_attention_layernorm, self.post_mlp_layernorm = norm(), norm()

    def forward(self, hidden, cos_sin, context: StepContext):
        attended = self.self_attn(self.input_layernorm(hidden), cos_sin, context)
        hidden = hidden + self.post_self_attn_layernorm(attended)
        return hidden + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(hidden), context.lora))


class Glm4ForCausalLM(PlainLayersForCausalLM):
    """GLM-4, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = Glm4DecoderLayer

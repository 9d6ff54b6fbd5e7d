"""OLMo 2 (`olmo2`), OLMo 3 (`olmo3`) and EXAONE 4 (`exaone4`) over the paged cache.

Llama's blocks with AllenAI's changes: the norms come after attention and after the MLP (on
what each adds to the residual stream, none before), and queries and keys are RMS-normalized
over the whole projection (all heads together) before the rotation. OLMo 3 adds sliding-window
layers (`layer_types`), with rope settings of their own. EXAONE 4 has the same post-norm blocks,
with per-head query/key norms (Qwen3's) and full layers without rotary embedding beside its
windowed ones.
"""

from __future__ import annotations

from torch import nn

from pagedkv.attention.step_context import StepContext
from pagedkv.layers.rms_norm import RMSNorm
from pagedkv.models.llama import LlamaAttention, LlamaMLP, PlainLayersForCausalLM
from pagedkv.models.registry import Traits


class Olmo2DecoderLayer(nn.Module):
    is_moe = False

    def __init__(self, hf_config, traits: Traits, layer_index: int):
        super().__init__()
        self.self_attn = LlamaAttention(hf_config, traits, layer_index)  # with OLMo's whole-projection q/k norms
        self.mlp = LlamaMLP(hf_config, layer_index)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, hidden, cos_sin, context: StepContext):
        attended = self.self_attn(hidden, cos_sin, context)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden, context.lora))


class Olmo2ForCausalLM(PlainLayersForCausalLM):
    """OLMo 2 and 3, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = Olmo2DecoderLayer

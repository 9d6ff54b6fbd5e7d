"""Gemma (`gemma`), Gemma 2 (`gemma2`) and Gemma 3 text models (`gemma3_text`: Gemma-3-270M and
-1B) over the paged cache.

Llama's blocks with Gemma's changes: RMSNorm weights stored as offsets from 1, the embeddings
scaled by sqrt(hidden), a GELU MLP. Gemma 1 stops there. Gemma 2 and 3 add norms after both
attention and MLP, attention scaled by `query_pre_attn_scalar`, layers of two kinds, sliding (a
local window) and full, and soft-capped final logits; Gemma 2 soft-caps the attention logits too
(every backend takes `logit_softcap`), Gemma 3 instead normalizes query and key heads and gives
its sliding layers a rope base of their own.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.attention.step_context import StepContext
from pagedkv.layers.activation import gated_activation
from pagedkv.models.llama import LlamaAttention, LlamaMLP, PlainLayersForCausalLM
from pagedkv.models.registry import Traits


class GemmaRMSNorm(nn.Module):
    """x / rms(x) · (1 + weight), in float32, rounded once (Gemma's order, unlike Llama's)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normalized = hidden.float()
        normalized = normalized * torch.rsqrt(normalized.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normalized * (1.0 + self.weight.float())).to(hidden.dtype)


class GemmaAttention(LlamaAttention):
    def __init__(self, hf_config, traits: Traits, layer_index: int):
        super().__init__(hf_config, traits, layer_index)
        self.scale = (getattr(hf_config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        if self.qk_norm_per_head:  # (Gemma 3's: Gemma's norms)
            self.q_norm = GemmaRMSNorm(self.head_dim, hf_config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, hf_config.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    is_moe = False

    def __init__(self, hf_config, traits: Traits, layer_index: int):
        super().__init__()
        self.self_attn = GemmaAttention(hf_config, traits, layer_index)
        activation = getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act
        self.mlp = LlamaMLP(hf_config, layer_index, act_and_mul=gated_activation(activation))
        norm = lambda: GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.sandwich_norms = traits.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, hidden, cos_sin, context: StepContext):
        attended = self.self_attn(self.input_layernorm(hidden), cos_sin, context)
        if not self.sandwich_norms:  # Gemma 1: Llama's layout, post_attention_layernorm feeds the MLP
            hidden = hidden + attended
            return hidden + self.mlp(self.post_attention_layernorm(hidden), context.lora)
        hidden = hidden + self.post_attention_layernorm(attended)
        fed = self.mlp(self.pre_feedforward_layernorm(hidden), context.lora)
        return hidden + self.post_feedforward_layernorm(fed)


class GemmaForCausalLM(PlainLayersForCausalLM):
    """Gemma 1, 2 and 3, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp), so the runner, LoRA and the loader treat
    them alike."""

    decoder_layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, hf_config, traits: Traits, max_positions: int, dtype: torch.dtype):
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (an encoder) is not supported")
        super().__init__(hf_config, traits, max_positions, dtype)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    def compute_buffers(self, max_positions: int, dtype: torch.dtype) -> None:
        """The rotary tables and the embedding scale, sqrt(hidden) rounded to the model dtype as
        transformers rounds it."""
        super().compute_buffers(max_positions, dtype)
        self.register_buffer("embed_scale", torch.tensor(self.hf_config.hidden_size**0.5).to(dtype), persistent=False)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_logit_softcapping is not None:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits

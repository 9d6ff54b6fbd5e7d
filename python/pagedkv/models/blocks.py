"""The two residual forms of GPT-style decoder layers, assembled from each model's own parts
(norms, attention, MLP) so that a model file only says which parts it uses. Parameter names
follow the parts' attribute names: input_layernorm, self_attn, post_attention_layernorm, mlp."""

from __future__ import annotations

from typing import Optional

from torch import nn

from pagedkv.attention.step_context import StepContext


class PreNormBlock(nn.Module):
    """x + attn(norm_1(x)), then that + mlp(norm_2(that)) (StarCoder2, GPT-2, OPT, OLMo 1,
    Nemotron; GPT-NeoX's and StableLM's sequential layers)."""

    is_moe = False

    def __init__(self, input_layernorm: nn.Module, self_attn: nn.Module, post_attention_layernorm: nn.Module,
                 mlp: nn.Module):
        super().__init__()
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp

    def forward(self, hidden, cos_sin, context: StepContext):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos_sin, context)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), context.lora)


class ParallelBlock(nn.Module):
    """x + attn(norm(x)) + mlp(norm(x)) (GPT-J, Phi-2, Cohere, StableLM-2-12B), or with a norm of
    its own for the MLP, x + attn(norm_1(x)) + mlp(norm_2(x)) (GPT-NeoX's Pythia)."""

    is_moe = False

    def __init__(self, input_layernorm: nn.Module, self_attn: nn.Module, mlp: nn.Module,
                 post_attention_layernorm: Optional[nn.Module] = None):
        super().__init__()
        self.input_layernorm, self.self_attn, self.mlp = input_layernorm, self_attn, mlp
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, hidden, cos_sin, context: StepContext):
        normalized = self.input_layernorm(hidden)
        attended = self.self_attn(normalized, cos_sin, context)
        mlp_input = normalized if self.post_attention_layernorm is None else self.post_attention_layernorm(hidden)
        return hidden + attended + self.mlp(mlp_input, context.lora)

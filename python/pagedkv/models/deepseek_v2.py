"""DeepSeek-V2 (`deepseek_v2`: DeepSeek-V2, V2-Lite, V2.5) and DeepSeek-V3 (`deepseek_v3`: V3, R1,
and checkpoints of that architecture such as Kimi K2) over the paged cache.

Multi-head latent attention (MLA): keys and values of every head are projections of one small
latent per token, `c = norm(W_DKV x)` (kv_lora_rank wide), plus one rotary key `k_pe` shared by
the heads. The cache holds `[c, k_pe]` per token, as one KV head: with the per-head key
projection absorbed into the query (`q_latent = W_UK^T q_nope`), each head's logits are
`q_latent . c + q_pe . k_pe`, and its output is `W_UV` applied to the weighted sum of the
latents, so attention is multi-query over `kv_lora_rank + qk_rope_head_dim` dims and the cache
is 2 x 576 numbers per token and layer for DeepSeek-V2 instead of 128 heads x (192 + 128).
(The value rows repeat the keys: the attention backends keep K and V of one width; the output's
rotary part is dropped.) Rotary embedding turns adjacent pairs of dims; YaRN's mscale also
scales the softmax.

Mixture of experts (DeepSeekMoE): after `first_k_dense_replace` dense layers, a router picks
the top k of the routed experts, weights scaled by `routed_scaling_factor`, plus always-on
shared experts. V2's router is a softmax (`group_limited_greedy`: within the best `topk_group`
of `n_group` expert groups); V3's is a sigmoid whose choice (not weights) adds a per-expert
bias, within the groups of best two-expert sums. V3's multi-token-prediction layers (past
`num_hidden_layers`) are not loaded.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.step_context import StepContext
from pagedkv.layers.activation import silu_and_mul
from pagedkv.layers.fused_moe import SparseMoE
from pagedkv.layers.rms_norm import RMSNorm
from pagedkv.layers.rotary_embedding import apply_rotary
from pagedkv.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pagedkv.models.registry import Traits


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def softmax_scale(hf_config) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim) squared (as transformers)."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    if parameters.get("rope_type", "default") != "default" and parameters.get("mscale_all_dim"):
        scale *= _yarn_mscale(parameters["factor"], parameters["mscale_all_dim"]) ** 2
    return scale


class MLAAttention(nn.Module):
    """Multi-head latent attention; weights under the checkpoint's names."""

    sliding_window = None

    def __init__(self, hf_config, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        hidden = hf_config.hidden_size
        self.num_heads = hf_config.num_attention_heads
        self.nope_dim, self.rope_dim = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
        self.v_dim, self.latent_dim = hf_config.v_head_dim, hf_config.kv_lora_rank
        self.num_kv_heads, self.head_dim = 1, self.latent_dim + self.rope_dim  # what the cache holds
        self.scale = softmax_scale(hf_config)
        self.rope_interleaved = bool(getattr(hf_config, "rope_interleave", True))  # (V2 always interleaves)
        bias = bool(getattr(hf_config, "attention_bias", False))
        query_width = self.num_heads * (self.nope_dim + self.rope_dim)
        self.q_lora_rank = hf_config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, query_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, hf_config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, query_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, hf_config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.latent_dim, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)

    def forward(self, hidden, cos_sin, context: StepContext):
        num_tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            query = self.q_proj(hidden)
        else:
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = query.view(num_tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.latent_dim, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = apply_rotary(cos_sin, q_pe, k_pe.unsqueeze(1), interleaved=self.rope_interleaved)

        up = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.latent_dim)
        w_uk, w_uv = up[:, : self.nope_dim], up[:, self.nope_dim :]
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        query = torch.cat([q_latent, q_pe], -1)
        key = torch.cat([latent.unsqueeze(1), k_pe], -1)
        out = context.attend(self.layer_index, query, key, key, self.scale)
        latent_out = out.reshape(num_tokens, self.num_heads, self.head_dim)[..., : self.latent_dim]
        values = torch.einsum("thl,hvl->thv", latent_out, w_uv)
        return self.o_proj(values.reshape(num_tokens, self.num_heads * self.v_dim))


class DeepseekMoE(SparseMoE):
    """SparseMoE with DeepSeek's routers (float32 scores: V2's softmax, greedy or group-limited;
    V3's biased sigmoid, also GLM-4.5's, and ERNIE 4.5's biased softmax; scaled weights) and
    ungated shared experts; `traits.router` says which router."""

    def __init__(self, hf_config, traits: Traits):
        num_shared = getattr(hf_config, "n_shared_experts", None) or getattr(hf_config, "moe_num_shared_experts", 0)
        num_experts = (getattr(hf_config, "n_routed_experts", None) or getattr(hf_config, "num_local_experts", None)
                       or hf_config.num_experts)
        expert_size = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size  # (MiniMax's)
        super().__init__(hf_config.hidden_size, expert_size, num_experts, hf_config.num_experts_per_tok,
                         traits.renormalize_experts, shared_intermediate_size=expert_size * (num_shared or 0))
        if self.has_shared_expert:
            del self.shared_expert_gate
        self.scoring = "softmax"
        if traits.router in ("biased_sigmoid", "biased_softmax"):
            self.topk_method = "noaux_tc"
            self.scoring = "sigmoid" if traits.router == "biased_sigmoid" else "softmax"
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))
        else:
            self.topk_method = getattr(hf_config, "topk_method", "greedy") or "greedy"
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"DeepSeek router topk_method={self.topk_method!r} is not supported")
        self.num_groups = getattr(hf_config, "n_group", None) or 1
        self.topk_groups = getattr(hf_config, "topk_group", None) or 1
        self.routed_scaling_factor = getattr(hf_config, "routed_scaling_factor", 1.0)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.float(), self.gate.weight.float())
        if self.topk_method == "noaux_tc":
            scores = logits.sigmoid() if self.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
            return self._route_v3(scores, hidden.dtype)
        scores = torch.softmax(logits, dim=-1)
        if self.topk_method == "group_limited_greedy":
            grouped = scores.view(scores.shape[0], self.num_groups, -1)
            best_groups = grouped.max(dim=-1).values.topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
            scores = grouped.masked_fill(~keep.unsqueeze(-1), 0.0).view_as(scores)
        weights, experts = torch.topk(scores, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.routed_scaling_factor).to(hidden.dtype), experts

    def _route_v3(self, scores: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        for_choice = (scores + self.gate.e_score_correction_bias.float()).view(scores.shape[0], self.num_groups, -1)
        group_scores = for_choice.topk(min(2, for_choice.shape[-1]), dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(self.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        for_choice = for_choice.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(scores)
        experts = for_choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.routed_scaling_factor).to(dtype), experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(hidden)
        out = self._experts(hidden, weights, experts)
        if self.has_shared_expert:
            out = out + self.shared_down(silu_and_mul(self.shared_gate_up(hidden)))
        return out


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, hf_config, traits: Traits, layer_index: int):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.self_attn = MLAAttention(hf_config, layer_index)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.residual_multiplier = 1.0
        self.is_moe = layer_index >= hf_config.first_k_dense_replace
        self.mlp = DeepseekMoE(hf_config, traits) if self.is_moe else LlamaMLP(hf_config, layer_index)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = DeepseekV2DecoderLayer

    def own_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | list]:
        num_layers = len(self.layers)
        own = {}
        for name, tensor in state.items():
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
                continue  # V3's multi-token-prediction layers
            own[name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")] = tensor
        return super().own_weights(own)

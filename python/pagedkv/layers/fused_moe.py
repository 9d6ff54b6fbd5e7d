"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE, OLMoE, GPT-OSS): a router
picks each token's top-k experts, and every expert runs once per step, on all the tokens routed
to it.

The step's (token, expert) pairs are sorted by expert, so each expert's tokens are one contiguous
slice: one gate/up matmul, one down matmul per expert hit, then a weighted scatter-add back to the
tokens. HF transformers instead masks the whole batch once per expert.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.layers.activation import clamped_swiglu_and_mul, silu_and_mul

if TYPE_CHECKING:
    from pagedkv.models.registry import Traits


def is_moe_layer(hf_config, traits: Traits, layer_index: int) -> bool:
    """Whether this decoder layer's MLP is sparse (Qwen MoEs may keep some layers dense:
    `mlp_only_layers`, `decoder_sparse_step`)."""
    if not traits.sparse_moe or layer_index in (getattr(hf_config, "mlp_only_layers", None) or []):
        return False
    return (layer_index + 1) % (getattr(hf_config, "decoder_sparse_step", 1) or 1) == 0


def sparse_moe(hf_config, traits: Traits) -> "SparseMoE":
    """The MoE MLP of a checkpoint whose traits say `sparse_moe`. Experts are
    `moe_intermediate_size` wide where the config has it (Qwen's MoEs), else `intermediate_size`
    (Mixtral's, Granite MoE's, GPT-OSS's, and OLMoE's, which has no dense MLP); Qwen2-MoE's configs
    add a shared expert (`shared_expert_intermediate_size`)."""
    num_experts = getattr(hf_config, "num_local_experts", None) or hf_config.num_experts
    intermediate_size = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    top_k, renormalize = hf_config.num_experts_per_tok, traits.renormalize_experts
    if not traits.gpt_oss_experts:
        shared = getattr(hf_config, "shared_expert_intermediate_size", None) or 0
        return SparseMoE(hf_config.hidden_size, intermediate_size, num_experts, top_k, renormalize, shared)
    # Older transformers releases fix alpha at 1.702 and have no swiglu_alpha in the config.
    activation = functools.partial(clamped_swiglu_and_mul, alpha=getattr(hf_config, "swiglu_alpha", 1.702),
                                   limit=getattr(hf_config, "swiglu_limit", 7.0))
    return SparseMoE(hf_config.hidden_size, intermediate_size, num_experts, top_k, renormalize, bias=True,
                     act_and_mul=activation)


class SparseMoE(nn.Module):
    """forward(hidden [T, H]) -> [T, H]: the sum over each token's top-k experts of
    weight · down(act(gate(x)) · up(x)), plus Qwen2-MoE's sigmoid-gated shared expert.

    Weights: `gate` (the router, [E, H]), `expert_gate_up` [E, 2I, H] ([gate; up] per expert),
    `expert_down` [E, H, I]; with `bias` (GPT-OSS), the router's bias and `expert_gate_up_bias`
    [E, 2I], `expert_down_bias` [E, H]; with a shared expert, `shared_gate_up`, `shared_down`,
    `shared_expert_gate` ([1, H]). `act_and_mul` takes [T, 2I] = [gate | up] to [T, I]."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
                 shared_intermediate_size: int = 0, bias: bool = False, act_and_mul=silu_and_mul):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.act_and_mul = act_and_mul
        self.gate = nn.Linear(hidden_size, num_experts, bias=bias)
        self.expert_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.expert_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        if bias:
            self.expert_gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
            self.expert_down_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        else:
            self.expert_gate_up_bias = self.expert_down_bias = None
        self.has_shared_expert = shared_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_gate_up = nn.Linear(hidden_size, 2 * shared_intermediate_size, bias=False)
            self.shared_down = nn.Linear(shared_intermediate_size, hidden_size, bias=False)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in the hidden dtype, expert ids [T, k]): the softmax over all experts
        (float32), its top k, renormalized to sum to 1 where the model says so."""
        probabilities = torch.softmax(self.gate(hidden).float(), dim=-1)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(hidden.dtype), experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(hidden)
        out = self._experts(hidden, weights, experts)
        if self.has_shared_expert:
            shared = self.shared_down(silu_and_mul(self.shared_gate_up(hidden)))
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * shared
        return out

    def _experts(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        flat_experts = experts.flatten()
        order = torch.argsort(flat_experts, stable=True)
        token_of_pair = order // self.top_k
        routed = hidden[token_of_pair]
        expert_outputs = torch.empty_like(routed)
        # one host sync per layer: the slice bounds (also why MoE steps are not graph-captured)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = routed[start : start + count]
            gate_up_bias, down_bias = (None, None) if self.expert_down_bias is None else (
                self.expert_gate_up_bias[expert], self.expert_down_bias[expert])
            activated = self.act_and_mul(F.linear(tokens, self.expert_gate_up[expert], gate_up_bias))
            expert_outputs[start : start + count] = F.linear(activated, self.expert_down[expert], down_bias)
            start += count
        expert_outputs *= weights.flatten()[order].unsqueeze(1)
        return torch.zeros_like(hidden).index_add_(0, token_of_pair, expert_outputs)

"""StableLM (`stablelm`: StableLM-2, StableLM-3B-4E1T, StableCode, Zephyr) over the paged cache.

Llama's attention and gated MLP in blocks with LayerNorms (with bias): one norm feeding attention
and MLP side by side (`use_parallel_residual`, StableLM-2-12B) or one before each; optional q/k/v
biases, query/key LayerNorms per head (the 12B's; stored as one LayerNorm per head), rotary
embedding on a quarter of each head.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.models.blocks import ParallelBlock, PreNormBlock
from pagedkv.models.cohere import PerHeadNormAttention
from pagedkv.models.llama import LlamaMLP, PlainLayersForCausalLM
from pagedkv.models.registry import Traits


def stablelm_layer(hf_config, traits: Traits, layer_index: int) -> nn.Module:
    hidden, eps = hf_config.hidden_size, hf_config.layer_norm_eps
    attention = PerHeadNormAttention(hf_config, traits, layer_index, hf_config.qk_layernorm, eps)
    if hf_config.use_parallel_residual:
        return ParallelBlock(nn.LayerNorm(hidden, eps), attention, LlamaMLP(hf_config, layer_index))
    return PreNormBlock(nn.LayerNorm(hidden, eps), attention, nn.LayerNorm(hidden, eps), LlamaMLP(hf_config, layer_index))


class StableLmForCausalLM(PlainLayersForCausalLM):
    """StableLM, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = staticmethod(stablelm_layer)
    norm_class = nn.LayerNorm

    def own_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | list]:
        """The checkpoint's per-head query/key LayerNorms (`q_layernorm.norms.{head}.weight`) are
        stacked into one [heads, head_dim] weight each."""
        renamed, per_head = {}, {}
        for name, tensor in state.items():
            for norm in ("q", "k"):
                marker = f".self_attn.{norm}_layernorm.norms."
                if marker in name:
                    prefix, _, head = name.partition(marker)
                    per_head.setdefault(f"{prefix}.self_attn.{norm}_norm.weight", {})[int(head.split(".")[0])] = tensor
                    break
            else:
                renamed[name] = tensor
        for name, heads in per_head.items():
            renamed[name] = torch.stack([heads[head] for head in sorted(heads)])
        return super().own_weights(renamed)

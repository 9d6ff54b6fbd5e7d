"""StableLM (`stablelm`: StableLM-2, StableLM-3B-4E1T, StableCode, Zephyr) over the paged cache.

Llama's attention and gated MLP in blocks with LayerNorms (with bias): one norm feeding attention
and MLP side by side (`use_parallel_residual`, StableLM-2-12B) or one before each; optional q/k/v
biases, query/key LayerNorms per head (the 12B's; stored as one LayerNorm per head), rotary
embedding on a quarter of each head.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.models.cohere import PerHeadNormAttention
from pagedkv.models.llama import LlamaForCausalLM, LlamaMLP


class StableLmDecoderLayer(nn.Module):
    is_moe = False

    def __init__(self, hf_config, layer_index: int):
        super().__init__()
        self.use_parallel_residual = hf_config.use_parallel_residual
        hidden, eps = hf_config.hidden_size, hf_config.layer_norm_eps
        self.input_layernorm = nn.LayerNorm(hidden, eps)
        self.self_attn = PerHeadNormAttention(hf_config, layer_index, hf_config.qk_layernorm, eps)
        self.post_attention_layernorm = None if self.use_parallel_residual else nn.LayerNorm(hidden, eps)
        self.mlp = LlamaMLP(hf_config, layer_index)

    def forward(self, hidden, cos_sin, metadata, kv_cache, backend, lora=None):
        normalized = self.input_layernorm(hidden)
        attended = self.self_attn(normalized, cos_sin, metadata, kv_cache, backend, lora)
        if self.use_parallel_residual:
            return hidden + attended + self.mlp(normalized, lora)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden), lora)


class StableLmForCausalLM(LlamaForCausalLM):
    """StableLM, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = StableLmDecoderLayer
    norm_class = nn.LayerNorm

    def forward(self, input_ids, positions, metadata: AttentionMetadata, kv_cache, backend, lora=None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer, cos_sin in zip(self.layers, self.layer_rotations(positions)):
            hidden = layer(hidden, cos_sin, metadata, kv_cache, backend, lora)
        return self.norm(hidden)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
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
        super().load_hf_state_dict(renamed)

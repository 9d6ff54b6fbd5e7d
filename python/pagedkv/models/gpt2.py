"""GPT-2 (`gpt2`) over the paged cache.

Learned absolute position embeddings (no rotary), pre-LayerNorm blocks with biased projections,
the ungated GELU MLP, tied embeddings. Checkpoints store projections as Conv1D ([in, out]
weights, transposed at load) and q/k/v fused as `c_attn`.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models.llama import LlamaAttention, LlamaForCausalLM

_CHECKPOINT_NAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.wpe.", "model.position_embeddings."),
                     ("transformer.ln_f.", "model.norm."), ("transformer.h.", "model.layers."),
                     (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
                     (".attn.c_attn.", ".self_attn.qkv_proj."), (".attn.c_proj.", ".self_attn.o_proj."))
_CONV1D = (".self_attn.qkv_proj.weight", ".self_attn.o_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


class AbsolutePositionAttention(LlamaAttention):
    """Llama's attention without rotary embedding, biased q/k/v and output projections (GPT-2's,
    OPT's)."""

    def __init__(self, hf_config, layer_index: int, bias: bool = True):
        super().__init__(hf_config, layer_index)
        self.use_rope = False
        self.qkv_proj = nn.Linear(hf_config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hf_config.hidden_size, bias=bias)


class GPT2Block(nn.Module):
    is_moe = False

    def __init__(self, hf_config, layer_index: int):
        super().__init__()
        if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False) or not getattr(hf_config, "scale_attn_weights", True):
            raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx or without scale_attn_weights is not supported")
        hidden = hf_config.hidden_size
        self.input_layernorm = nn.LayerNorm(hidden, hf_config.layer_norm_epsilon)
        self.self_attn = AbsolutePositionAttention(hf_config, layer_index)
        self.post_attention_layernorm = nn.LayerNorm(hidden, hf_config.layer_norm_epsilon)
        self.mlp = UngatedMLP(hidden, hf_config.n_inner or 4 * hidden, hf_config.activation_function, layer_index)

    def forward(self, hidden, cos_sin, metadata, kv_cache, backend, lora=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos_sin, metadata, kv_cache, backend, lora)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), lora)


class GPT2ForCausalLM(LlamaForCausalLM):
    """GPT-2, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = GPT2Block
    norm_class = nn.LayerNorm
    conv1d_weights = True  # projections stored [in, out] (GPT-2's Conv1D), transposed at load

    def __init__(self, hf_config, max_positions: int, dtype: torch.dtype):
        super().__init__(hf_config, max_positions, dtype)
        self.position_embeddings = nn.Embedding(hf_config.max_position_embeddings, hf_config.hidden_size)

    def forward(self, input_ids, positions, metadata: AttentionMetadata, kv_cache, backend, lora=None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) + self.position_embeddings(positions)
        for layer in self.layers:
            hidden = layer(hidden, None, metadata, kv_cache, backend, lora)
        return self.norm(hidden)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        renamed = {}
        for name, tensor in state.items():
            if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
                continue  # (old checkpoints' causal-mask buffers)
            for theirs, ours in _CHECKPOINT_NAMES:
                name = name.replace(theirs, ours)
            renamed[name] = tensor.t() if self.conv1d_weights and name.endswith(_CONV1D) else tensor
        super().load_hf_state_dict(renamed)

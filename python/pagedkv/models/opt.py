"""OPT (`opt`: Meta's OPT-125M to 66B, the vLLM paper's models) over the paged cache.

GPT-2's shape with its own names: learned absolute positions (offset by 2, OPT's convention),
pre-LayerNorm blocks with biased projections, a ReLU MLP, tied embeddings. OPT-350M's post-norm
blocks and projected embeddings are not supported.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models.gpt2 import AbsolutePositionAttention
from pagedkv.models.llama import LlamaForCausalLM

_POSITION_OFFSET = 2
_CHECKPOINT_NAMES = (("model.decoder.embed_positions.", "model.position_embeddings."), ("model.decoder.", "model."),
                     (".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn_layer_norm.", ".input_layernorm."),
                     (".final_layer_norm.", ".post_attention_layernorm."), (".fc1.", ".mlp.c_fc."),
                     (".fc2.", ".mlp.c_proj."))


class OPTDecoderLayer(nn.Module):
    is_moe = False

    def __init__(self, hf_config, layer_index: int):
        super().__init__()
        if not hf_config.do_layer_norm_before or hf_config.word_embed_proj_dim != hf_config.hidden_size:
            raise ValueError("OPT with post-norm blocks or projected embeddings (OPT-350M) is not supported")
        hidden = hf_config.hidden_size
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attn = AbsolutePositionAttention(hf_config, layer_index, bias=hf_config.enable_bias)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = UngatedMLP(hidden, hf_config.ffn_dim, hf_config.activation_function, layer_index,
                              bias=hf_config.enable_bias)

    def forward(self, hidden, cos_sin, metadata, kv_cache, backend, lora=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos_sin, metadata, kv_cache, backend, lora)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), lora)


class OPTForCausalLM(LlamaForCausalLM):
    """OPT, with the interface of LlamaForCausalLM (forward, compute_logits,
    load_hf_state_dict, layers with self_attn and mlp)."""

    decoder_layer_class = OPTDecoderLayer
    norm_class = nn.LayerNorm

    def __init__(self, hf_config, max_positions: int, dtype: torch.dtype):
        super().__init__(hf_config, max_positions, dtype)
        self.position_embeddings = nn.Embedding(hf_config.max_position_embeddings + _POSITION_OFFSET,
                                                hf_config.hidden_size)

    def forward(self, input_ids, positions, metadata: AttentionMetadata, kv_cache, backend, lora=None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) + self.position_embeddings(positions + _POSITION_OFFSET)
        for layer in self.layers:
            hidden = layer(hidden, None, metadata, kv_cache, backend, lora)
        return self.norm(hidden)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        renamed = {}
        for name, tensor in state.items():
            if name.startswith("model.decoder.final_layer_norm."):  # the model's, not a layer's
                renamed[name.replace("model.decoder.final_layer_norm.", "model.norm.")] = tensor
                continue
            for theirs, ours in _CHECKPOINT_NAMES:
                name = name.replace(theirs, ours)
            renamed[name] = tensor
        super().load_hf_state_dict(renamed)

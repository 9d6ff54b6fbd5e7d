"""GPTBigCode (`gpt_bigcode`: StarCoder, SantaCoder, WizardCoder) over the paged cache.

GPT-2's blocks and names with multi-query attention (one key/value head for all query heads, where
`multi_query`) and Linear projections ([out, in], nothing to transpose). Without multi-query the
fused c_attn holds q, k and v interleaved per head; it is regrouped at load.
"""

from __future__ import annotations

import torch

from pagedkv.models.gpt2 import GPT2ForCausalLM
from pagedkv.models.registry import Traits


class GPTBigCodeForCausalLM(GPT2ForCausalLM):
    """GPTBigCode, with the interface of LlamaForCausalLM."""

    conv1d_weights = False

    def __init__(self, hf_config, traits: Traits, max_positions: int, dtype: torch.dtype):
        # (the attention reads its key/value heads from the config, under Llama's name)
        hf_config.num_key_value_heads = 1 if hf_config.multi_query else hf_config.num_attention_heads
        super().__init__(hf_config, traits, max_positions, dtype)

    def own_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | list]:
        if not self.hf_config.multi_query:  # [heads, (q, k, v), head_dim, ...] -> [(q, k, v), heads, head_dim, ...]
            attention = self.layers[0].self_attn
            state = dict(state)
            for name, tensor in state.items():
                if ".attn.c_attn." in name:
                    per_head = tensor.view(attention.num_heads, 3, attention.head_dim, *tensor.shape[1:])
                    state[name] = per_head.transpose(0, 1).reshape(tensor.shape)
        return super().own_weights(state)

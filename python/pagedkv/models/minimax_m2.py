"""MiniMax-M2 (`minimax_m2`) over the paged cache: Llama's attention with RMSNorm over the whole
query and key projections (as OLMo 2's) and partial rotary embedding (`rotary_dim`), and in
every layer experts chosen on sigmoid scores plus a per-expert bias, weighted by the unbiased
scores renormalized (DeepSeek-V3's choice with one group: models/deepseek_v2.py)."""

from __future__ import annotations

import torch

from pagedkv.models.deepseek_v2 import DeepseekMoE, DeepseekV2ForCausalLM
from pagedkv.models.llama import LlamaDecoderLayer
from pagedkv.models.registry import Traits


class MiniMaxM2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, hf_config, traits: Traits, layer_index: int):
        super().__init__(hf_config, traits, layer_index)  # (a dense MLP: replaced)
        self.is_moe = True
        self.mlp = DeepseekMoE(hf_config, traits)


class MiniMaxM2ForCausalLM(DeepseekV2ForCausalLM):
    decoder_layer_class = MiniMaxM2DecoderLayer

    def own_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | list]:
        bias = ".e_score_correction_bias"  # beside the router, not in it
        return super().own_weights({
            name.replace(".mlp" + bias, ".mlp.gate" + bias).replace(".block_sparse_moe" + bias, ".mlp.gate" + bias): tensor
            for name, tensor in state.items()})

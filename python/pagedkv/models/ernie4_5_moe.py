"""ERNIE 4.5 MoE (`ernie4_5_moe`: ERNIE-4.5-21B-A3B, -300B-A47B) over the paged cache: ERNIE 4.5's
attention (rotary embedding over adjacent pairs of dims) and, in the layers from
`moe_layer_start_index` to `moe_layer_end_index` every `moe_layer_interval`, experts chosen on
softmax scores plus a per-expert bias, weighted by the unbiased scores renormalized, with
always-on shared experts (models/deepseek_v2.py's DeepseekMoE)."""

from __future__ import annotations

import torch

from pagedkv.models.deepseek_v2 import DeepseekMoE, DeepseekV2ForCausalLM
from pagedkv.models.llama import LlamaDecoderLayer
from pagedkv.models.registry import Traits


def is_ernie_moe_layer(hf_config, layer_index: int) -> bool:
    return ((layer_index + 1) % hf_config.moe_layer_interval == 0
            and hf_config.moe_layer_start_index <= layer_index <= hf_config.moe_layer_end_index)


class Ernie45MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, hf_config, traits: Traits, layer_index: int):
        super().__init__(hf_config, traits, layer_index)  # (a dense MLP: replaced in the MoE layers)
        self.is_moe = is_ernie_moe_layer(hf_config, layer_index)
        if self.is_moe:
            self.mlp = DeepseekMoE(hf_config, traits)


class Ernie45MoeForCausalLM(DeepseekV2ForCausalLM):
    decoder_layer_class = Ernie45MoeDecoderLayer

    def own_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | list]:
        own = {}
        for name, tensor in state.items():
            if name.endswith(".moe_statics.e_score_correction_bias"):  # [1, experts], in the router or beside it
                name, tensor = name.split(".mlp.")[0] + ".mlp.gate.e_score_correction_bias", tensor.reshape(-1)
            own[name] = tensor
        return super().own_weights(own)

"""GLM-4.5 and GLM-4.6 (`glm4_moe`) and dots.llm1 (`dots1`) over the paged cache: Llama's
attention (GLM's: q/k/v biases, an unbiased output, optional per-head q/k norms, rotary embedding
on half of each head; dots.llm1's: Qwen3's per-head q/k norms) and, after `first_k_dense_replace`
dense layers, DeepSeek-V3's mixture of experts (a biased sigmoid router over expert groups,
renormalized and scaled weights, shared experts; models/deepseek_v2.py). Multi-token-prediction
layers past `num_hidden_layers` are not loaded."""

from __future__ import annotations

from pagedkv.models.deepseek_v2 import DeepseekMoE, DeepseekV2ForCausalLM
from pagedkv.models.llama import LlamaDecoderLayer
from pagedkv.models.registry import Traits


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, hf_config, traits: Traits, layer_index: int):
        super().__init__(hf_config, traits, layer_index)  # (a dense MLP: replaced in the MoE layers)
        self.is_moe = layer_index >= hf_config.first_k_dense_replace
        if self.is_moe:
            self.mlp = DeepseekMoE(hf_config, traits)


class Glm4MoeForCausalLM(DeepseekV2ForCausalLM):
    decoder_layer_class = Glm4MoeDecoderLayer

"""Which class serves each Hugging Face `model_type`, and what sets an architecture's layers apart.

`MODELS` maps a checkpoint's `model_type` to (module under pagedkv.models, class name); the module
is imported only when a checkpoint of that type loads (vLLM's lazy `ModelRegistry`, as a dict).
`Traits` are what the shared layers (LlamaAttention, LlamaDecoderLayer, the MoE layers) do
differently by architecture, resolved once per checkpoint from its config by `resolve_traits`:
this file is the one place that tests a `model_type`.

The table of supported model types in docs/models.md is this registry's:

    python -m pagedkv.models.registry --markdown
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass

_LLAMA = ("llama", "LlamaForCausalLM")
_DEEPSEEK = ("deepseek_v2", "DeepseekV2ForCausalLM")

# model_type -> (module of pagedkv.models, class)
MODELS: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "smollm3", "granite",
                     "phi3", "granitemoe", "olmoe", "gpt_oss", "ministral", "helium", "seed_oss", "ernie4_5", "glm",
                     "arcee", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text"), _LLAMA),
    **dict.fromkeys(("gemma", "gemma2", "gemma3_text"), ("gemma", "GemmaForCausalLM")),
    **dict.fromkeys(("olmo2", "olmo3", "exaone4"), ("olmo2", "Olmo2ForCausalLM")),
    "starcoder2": ("starcoder2", "Starcoder2ForCausalLM"),
    "glm4": ("glm4", "Glm4ForCausalLM"),
    "cohere": ("cohere", "CohereForCausalLM"),
    "phi": ("phi", "PhiForCausalLM"),
    "gpt_neox": ("gpt_neox", "GPTNeoXForCausalLM"),
    "gpt2": ("gpt2", "GPT2ForCausalLM"),
    "opt": ("opt", "OPTForCausalLM"),
    "gpt_bigcode": ("gpt_bigcode", "GPTBigCodeForCausalLM"),
    "gptj": ("gptj", "GPTJForCausalLM"),
    "olmo": ("olmo", "OlmoForCausalLM"),
    "nemotron": ("nemotron", "NemotronForCausalLM"),
    "stablelm": ("stablelm", "StableLmForCausalLM"),
    "falcon": ("falcon", "FalconForCausalLM"),
    **dict.fromkeys(("deepseek_v2", "deepseek_v3"), _DEEPSEEK),
    **dict.fromkeys(("glm4_moe", "dots1"), ("glm4_moe", "Glm4MoeForCausalLM")),
    "ernie4_5_moe": ("ernie4_5_moe", "Ernie45MoeForCausalLM"),
    "minimax_m2": ("minimax_m2", "MiniMaxM2ForCausalLM"),
}
# Image-text models whose language model we serve alone (text prompts; the vision tower is not
# loaded): their text config's model_type is one of MODELS'
MULTIMODAL_MODEL_TYPES = ("gemma3", "mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
SUPPORTED = tuple(MODELS) + MULTIMODAL_MODEL_TYPES

# Which model types have each trait (some only where their config says so: resolve_traits)
HEAD_QK_NORM = ("qwen3", "qwen3_moe", "exaone4", "qwen3_vl_text", "qwen3_vl_moe_text", "dots1", "gemma3_text")
PROJECTION_QK_NORM = ("olmo2", "olmo3", "olmoe", "minimax_m2")
QKV_BIAS = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
UNBIASED_O_PROJ = ("glm", "glm4", "helium", "glm4_moe")
INTERLEAVED_ROPE = ("glm", "glm4", "helium", "ernie4_5", "ernie4_5_moe", "cohere", "gptj")
ATTENTION_SINKS = ("gpt_oss",)
NOPE_FULL_LAYERS = ("exaone4",)
UNGATED_MLP = ("arcee",)
SANDWICH_NORMS = ("gemma2", "gemma3_text")
SPARSE_MOE = ("mixtral", "granitemoe", "gpt_oss", "qwen2_moe", "qwen3_moe", "qwen3_vl_moe_text", "olmoe")
# Routers that renormalize the chosen experts' weights whatever the config says (HF's code reads
# no norm_topk_prob for them); the others renormalize where norm_topk_prob is true
RENORMALIZING_ROUTERS = ("mixtral", "granitemoe", "gpt_oss", "qwen3_vl_moe_text", "ernie4_5_moe", "minimax_m2")
BIASED_SIGMOID_ROUTERS = ("deepseek_v3", "glm4_moe", "minimax_m2", "dots1")
BIASED_SOFTMAX_ROUTERS = ("ernie4_5_moe",)
GPT_OSS_EXPERTS = ("gpt_oss",)


@dataclass(frozen=True)
class Traits:
    """What a checkpoint's layers do beyond what its config's sizes say; `resolve_traits` gives a
    checkpoint's, and the model classes hand them to their layers."""

    qk_norm: str | None = None
    """RMSNorm of queries and keys before the rotation: "head" (each head: Qwen3's) or
    "projection" (all heads together: OLMo 2's); None: no norm."""
    qkv_bias: bool = False
    """q/k/v projections biased though the config says nothing of it (Qwen2's)."""
    unbiased_o_proj: bool = False
    """The output projection unbiased where attention_bias biases q/k/v (GLM's)."""
    interleaved_rope: bool = False
    """Rotary embedding over adjacent pairs of dims (GPT-J's layout) instead of the two halves."""
    attention_sinks: bool = False
    """A learned logit per query head, a key of value zero (GPT-OSS's)."""
    nope_full_layers: bool = False
    """Full-attention layers beside windowed ones have no rotary embedding (EXAONE 4's)."""
    ungated_mlp: bool = False
    """A two-matrix MLP (up_proj, down_proj) with squared ReLU instead of the gated one (Arcee's)."""
    sandwich_norms: bool = False
    """Norms before and after both attention and MLP (Gemma 2's and 3's; Gemma 1 has Llama's two)."""
    sparse_moe: bool = False
    """LlamaDecoderLayer's MLP is layers/fused_moe.py's SparseMoE (in the layers is_moe_layer names)."""
    renormalize_experts: bool = False
    """The chosen experts' weights renormalized to sum to 1."""
    gpt_oss_experts: bool = False
    """Biased router and experts, the clamped SwiGLU (GPT-OSS's)."""
    router: str = "softmax"
    """DeepseekMoE's choice of experts: "softmax" (DeepSeek-V2's, greedy or group-limited by
    topk_method), "biased_sigmoid" (V3's: on sigmoid scores plus a per-expert bias, within expert
    groups) or "biased_softmax" (ERNIE 4.5's: the same on softmax scores)."""


def resolve_traits(hf_config) -> Traits:
    """The traits of a checkpoint of a supported model type (of its language model, for an
    image-text one), from its config."""
    model_type = hf_config.model_type
    qk_norm = None
    if model_type in HEAD_QK_NORM or (model_type == "glm4_moe" and hf_config.use_qk_norm):  # (GLM-4.5's switch)
        qk_norm = "head"
    elif model_type in PROJECTION_QK_NORM:
        qk_norm = "projection"
    num_experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0
    router = "softmax"
    if model_type in BIASED_SIGMOID_ROUTERS:
        router = "biased_sigmoid"
    elif model_type in BIASED_SOFTMAX_ROUTERS:
        router = "biased_softmax"
    return Traits(
        qk_norm=qk_norm,
        qkv_bias=model_type in QKV_BIAS,
        unbiased_o_proj=model_type in UNBIASED_O_PROJ,
        interleaved_rope=model_type in INTERLEAVED_ROPE,
        attention_sinks=model_type in ATTENTION_SINKS,
        nope_full_layers=model_type in NOPE_FULL_LAYERS and bool(getattr(hf_config, "sliding_window", None)),
        ungated_mlp=model_type in UNGATED_MLP,
        sandwich_norms=model_type in SANDWICH_NORMS,
        sparse_moe=model_type in SPARSE_MOE and num_experts > 0,
        renormalize_experts=model_type in RENORMALIZING_ROUTERS or bool(getattr(hf_config, "norm_topk_prob", False)),
        gpt_oss_experts=model_type in GPT_OSS_EXPERTS,
        router=router,
    )


def check_supported(hf_config) -> None:
    """Raises ValueError, naming the supported model types, unless the registry has this one."""
    if hf_config.model_type not in SUPPORTED:
        raise ValueError(f"model_type {hf_config.model_type!r} is not supported; supported: {SUPPORTED}")


def is_multimodal(hf_config) -> bool:
    """Whether this is an image-text checkpoint whose language model (`get_text_config()`) we serve."""
    return hf_config.model_type in MULTIMODAL_MODEL_TYPES


def model_class(model_type: str) -> type:
    """The class serving `model_type` (a key of MODELS), its module imported now."""
    module, name = MODELS[model_type]
    return getattr(importlib.import_module(f"pagedkv.models.{module}"), name)


def supported_models_markdown() -> str:
    """The table of supported model types docs/models.md holds: one row per class, its model
    types in MODELS' order, then the image-text types."""
    by_class: dict[tuple[str, str], list[str]] = {}
    for model_type, entry in MODELS.items():
        by_class.setdefault(entry, []).append(model_type)
    rows = ["| `model_type` | Served by |", "| --- | --- |"]
    for (module, name), model_types in by_class.items():
        rows.append(f"| {', '.join(f'`{t}`' for t in model_types)} | `{name}` (`models/{module}.py`) |")
    image_text = ", ".join(f"`{t}`" for t in MULTIMODAL_MODEL_TYPES)
    rows.append(f"| {image_text} | their language model, by its own `model_type` (image-text checkpoints) |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.models.registry", description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the table of supported model types")
    args = parser.parse_args(argv)
    if args.markdown:
        print(supported_models_markdown(), end="")
    else:
        print("\n".join(SUPPORTED))


if __name__ == "__main__":
    main()

"""Random PEFT LoRA adapters shaped for the embedded SmolLM2."""

import json

import torch
from safetensors.torch import save_file


NUM_LAYERS, HIDDEN, INTERMEDIATE, Q_SIZE, KV_SIZE = 30, 576, 1536, 576, 192


SHAPES = {  # PEFT module -> (in_features, out_features) in SmolLM2
    "q_proj": (HIDDEN, Q_SIZE), "k_proj": (HIDDEN, KV_SIZE), "v_proj": (HIDDEN, KV_SIZE), "o_proj": (Q_SIZE, HIDDEN),
    "gate_proj": (HIDDEN, INTERMEDIATE), "up_proj": (HIDDEN, INTERMEDIATE), "down_proj": (INTERMEDIATE, HIDDEN),
}


def write_adapter(directory, modules, rank, alpha, seed, use_rslora=False, extra_config=None, extra_weights=None):
    """A PEFT LoRA directory with random A and B (PEFT's file names, keys and config fields)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(NUM_LAYERS):
        for module in modules:
            in_features, out_features = SHAPES[module]
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn((rank, in_features), generator=generator) * 0.05
            weights[f"{prefix}.lora_B.weight"] = torch.randn((out_features, rank), generator=generator) * 0.05
    weights.update(extra_weights or {})
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules), "bias": "none",
              "use_rslora": use_rslora, "lora_dropout": 0.0, "task_type": "CAUSAL_LM", **(extra_config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return str(directory)

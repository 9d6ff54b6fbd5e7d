"""LoRA serving cost: the same prompts x new tokens, greedy, on SmolLM2-135M with no adapter, one
adapter for every request, and requests spread over several adapters (plus base requests) in
the same batches; random rank-r adapters on all seven projections. Same run, one table.

    python benches/lora.py                      # 32 prompts x 64 tokens, rank 16, 4 adapters
    python benches/lora.py --rank 64 --adapters 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import GGUF_NAME, make_prompts, model_dir  # noqa: E402

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(directory: str, hf_config, rank: int, seed: int) -> str:
    """A PEFT LoRA directory with random updates of every projection of every layer."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q_size, kv_size = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
              "o_proj": (q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (in_features, out_features) in shapes.items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            weights[prefix + ".lora_A.weight"] = torch.randn((rank, in_features), generator=generator) * 0.01
            weights[prefix + ".lora_B.weight"] = torch.randn((out_features, rank), generator=generator) * 0.01
    os.makedirs(directory, exist_ok=True)
    save_file(weights, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as file:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(MODULES)}, file)
    return directory


def run(prompts, max_tokens: int, loras, dtype: str, rank: int) -> float:
    from pagedkv import LLM, SamplingParams

    llm = LLM(os.path.join(model_dir(), GGUF_NAME), dtype=dtype, enable_lora=True, max_lora_rank=rank,
              max_model_len=1024)
    for lora in {lora for lora in loras if lora is not None}:
        llm.engine.add_lora(lora)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False, lora_request=loras[:2])
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - started
    del llm
    gc.collect()
    return sum(len(output.outputs[0].token_ids) for output in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    from pagedkv import LoRARequest

    tokenizer = AutoTokenizer.from_pretrained(model_dir(), gguf_file=GGUF_NAME)
    hf_config = AutoConfig.from_pretrained(model_dir(), gguf_file=GGUF_NAME)
    prompts = make_prompts(tokenizer, args.prompts)
    with tempfile.TemporaryDirectory() as root:
        adapters = [LoRARequest(f"adapter-{i}", i + 1,
                                write_random_adapter(os.path.join(root, str(i)), hf_config, args.rank, seed=i))
                    for i in range(args.adapters)]
        spread = [None if i % (args.adapters + 1) == args.adapters else adapters[i % (args.adapters + 1)]
                  for i in range(len(prompts))]
        cases = [("base model only", [None] * len(prompts)),
                 ("one adapter for every request", [adapters[0]] * len(prompts)),
                 (f"{args.adapters} adapters + base, mixed in each batch", spread)]
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(prompts)} prompts "
              f"({sum(map(len, prompts))} tokens) x {args.max_tokens} new tokens, greedy, rank {args.rank}, "
              f"all 7 projections, dtype {args.dtype}\n")
        print("| requests | tokens/s | vs base |")
        print("| --- | ---: | ---: |")
        baseline = None
        for name, loras in cases:
            tokens_per_s = run(prompts, args.max_tokens, loras, args.dtype, args.rank)
            baseline = baseline or tokens_per_s
            print(f"| {name} | {tokens_per_s:.1f} | {tokens_per_s / baseline:.2f}× |", flush=True)


if __name__ == "__main__":
    main()

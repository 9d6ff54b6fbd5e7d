"""float8 KV cache (`kv_cache_dtype="fp8"`) against the model-dtype cache, same run. Two tables:

1. decode attention per layer call (rust/cpu_kernels/decode_attention.rs) on SmolLM2-135M's attention shape,
   bfloat16 queries, K/V caches in bfloat16 / float8 e4m3 / float8 e5m2: median µs, GB/s of
   K/V read, speed-up over the bfloat16 cache;
2. the engine under one fixed KV memory budget that is tight for the bfloat16 cache: blocks,
   peak running sequences, preemptions, tokens/s, and how far each run's greedy tokens agree
   with a float32 model and cache (identical completions, mean tokens before the first
   difference): the bfloat16 row shows how much of the drift is the model's own dtype.

    python benches/kv_cache_dtype.py                          # 32 prompts x 96 tokens, 48 MiB of KV
    python benches/kv_cache_dtype.py --kv-mib 96 --prompts 64
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import make_prompts, model_dir, GGUF_NAME  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CACHE_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def median_us(call, budget_s: float = 1.0) -> float:
    call()
    times = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 500):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def attention_rows(batches: list[int], contexts: list[int]) -> list[tuple]:
    from pagedkv.attention.cpu import paged_decode_attention

    rows = []
    for batch in batches:
        for context in contexts:
            generator = torch.Generator().manual_seed(batch * 7 + context)
            blocks_each = math.ceil(context / BLOCK_SIZE)
            num_blocks = batch * blocks_each + 1
            keys = torch.randn((num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM), generator=generator)
            values = torch.randn((num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM), generator=generator)
            tables = torch.randperm(num_blocks, generator=generator)[: batch * blocks_each].view(batch, blocks_each)
            lens = torch.full((batch,), context, dtype=torch.int32)
            query = torch.randn((batch, HEADS, HEAD_DIM), generator=generator).to(torch.bfloat16)
            kv_elements = 2 * batch * KV_HEADS * context * HEAD_DIM
            baseline = None
            for name, dtype in CACHE_DTYPES.items():
                key_cache, value_cache = keys.to(dtype), values.to(dtype)
                us = median_us(lambda: paged_decode_attention(query, key_cache, value_cache, tables, lens, HEAD_DIM**-0.5))
                baseline = baseline or us
                gbps = kv_elements * key_cache.element_size() / us / 1e3
                rows.append((batch, context, name, us, gbps, baseline / us))
    return rows


def run_engine(prompts, max_tokens: int, kv_bytes: int, kv_cache_dtype: str, dtype: str) -> dict:
    from pagedkv import LLM, SamplingParams

    llm = LLM(os.path.join(model_dir(), GGUF_NAME), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
              kv_cache_memory_bytes=kv_bytes, max_model_len=1024)
    engine = llm.engine
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    tokens: dict[str, list[int]] = {}
    peak_running = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        peak_running = max(peak_running, engine.stats()["num_running_seqs"])
    elapsed = time.perf_counter() - started
    stats = engine.stats()
    result = {
        "blocks": stats["num_device_blocks"],
        "peak_running": peak_running,
        "preemptions": stats["num_preemptions_swap"] + stats["num_preemptions_recompute"],
        "tokens_per_s": sum(map(len, tokens.values())) / elapsed,
        "tokens": [tokens[str(index)] for index in range(len(prompts))],
    }
    del llm, engine
    gc.collect()
    return result


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """(completions identical to the reference, mean tokens before the first difference)."""
    same_prefix = []
    for ours, theirs in zip(tokens, reference):
        prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        same_prefix.append(prefix)
    return sum(ours == theirs for ours, theirs in zip(tokens, reference)), statistics.mean(same_prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--kv-mib", type=int, default=48, help="KV cache budget of every engine run")
    parser.add_argument("--reference-mib", type=int, default=512, help="KV budget of the float32 reference run")
    parser.add_argument("--dtype", default="auto", help="model dtype (auto: bfloat16 on AVX512-BF16 CPUs)")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("\ndecode attention per layer call (9 query / 3 KV heads of 64, bfloat16 queries)\n")
    print("| batch | context | KV cache | µs | K/V GB/s | speed-up |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    for batch, context, name, us, gbps, speedup in attention_rows(args.batches, args.contexts):
        print(f"| {batch} | {context} | {name} | {us:.0f} | {gbps:.1f} | {speedup:.2f}× |")
    if args.skip_engine:
        return

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir(), gguf_file=GGUF_NAME)
    prompts = make_prompts(tokenizer, args.prompts)
    kv_bytes = args.kv_mib << 20
    print(f"\nengine: {len(prompts)} prompts ({sum(map(len, prompts))} tokens) x {args.max_tokens} new tokens, "
          f"greedy, KV budget {args.kv_mib} MiB, model dtype {args.dtype}\n")
    print("| model / KV cache | KV budget | blocks | peak running | preemptions | tokens/s | speed-up | "
          "completions identical to float32's | tokens before first difference |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    # The quality reference: the float32 model and cache with room for every sequence.
    truth = run_engine(prompts, args.max_tokens, args.reference_mib << 20, "auto", "float32")
    print(f"| float32 / float32 (reference) | {args.reference_mib} MiB | {truth['blocks']} | {truth['peak_running']} | "
          f"{truth['preemptions']} | {truth['tokens_per_s']:.1f} | | | |", flush=True)
    baseline = None
    for kv_cache_dtype in ("auto", "fp8_e4m3", "fp8_e5m2"):
        result = run_engine(prompts, args.max_tokens, kv_bytes, kv_cache_dtype, args.dtype)
        baseline = baseline or result
        same, prefix = agreement(result["tokens"], truth["tokens"])
        print(f"| {args.dtype} / {kv_cache_dtype} | {args.kv_mib} MiB | {result['blocks']} | {result['peak_running']} | "
              f"{result['preemptions']} | {result['tokens_per_s']:.1f} | "
              f"{result['tokens_per_s'] / baseline['tokens_per_s']:.2f}× | "
              f"{same}/{len(prompts)} | {prefix:.1f} / {args.max_tokens} |", flush=True)

if __name__ == "__main__":
    main()

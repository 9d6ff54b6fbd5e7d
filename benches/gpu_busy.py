"""How much of a decode step the GPU is busy: a torch-profiler trace of ten decode steps at each
batch size (SmolLM2 by default, 128-token prompts), the GPU's busy time (the union of its kernel
and copy intervals) over the steps' span in the trace, and over the same steps timed without the
profiler (tracing a CUDA graph's kernels slows its launch: ~1 ms more host time a step for
SmolLM2's ~1,100-kernel decode graph on an H100, 2026-11-26). The step-boundary issue's goal is
>= 80%.
Prints one table; writes each trace (chrome://tracing, Perfetto) to --trace-dir.

    python benches/gpu_busy.py --device cuda --batch-sizes 64 256 --trace-dir $OUT

On a machine without a GPU, `--device cpu` runs the same steps as a dry run (no device events:
busy 0).
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import time

import torch
from torch.profiler import ProfilerActivity, profile

PROMPT_LEN, STEPS = 128, 10


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (overlaps counted once)."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered


def measure(llm, batch_size: int, device: str, trace_dir: str) -> dict:
    from pagedkv import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True, output_kind="final_only")
    for index in range(batch_size):
        engine.add_request(f"b{batch_size}-{index}", [(index * 7 + p) % 1000 + 10 for p in range(PROMPT_LEN)], params)
    while engine.scheduler.stats()["num_running_seqs"] < batch_size or engine.scheduler.stats()["num_waiting"]:
        engine.step()  # prefills
    for _ in range(3):
        engine.step()

    def synchronize():
        if device == "cuda":
            torch.cuda.synchronize()

    synchronize()
    started = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    synchronize()
    plain_us = (time.perf_counter() - started) / STEPS * 1e6
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as trace:
        for _ in range(STEPS):
            engine.step()
        synchronize()
    for index in range(batch_size):
        engine.abort(f"b{batch_size}-{index}")
    events = trace.events()
    span = [(e.time_range.start, e.time_range.end) for e in events]
    device_events = [(e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA]
    window = max(end for _, end in span) - min(start for start, _ in span)
    busy = union_length(device_events)
    path = os.path.join(trace_dir, f"decode-{device}-{batch_size}{'-async' if engine.config.async_scheduling else ''}.json")
    trace.export_chrome_trace(path)
    with open(path, "rb") as plain, gzip.open(path + ".gz", "wb") as packed:  # (tens of MB unpacked)
        shutil.copyfileobj(plain, packed)
    os.remove(path)
    path += ".gz"
    return {"plain_us": plain_us, "window_us": window / STEPS, "busy_us": busy / STEPS, "trace": path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--model", default=None, help="a checkpoint (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--trace-dir", default=os.environ.get("OUT", "."))
    parser.add_argument("--async-scheduling", action="store_true", help="plan each step while the last one runs")
    args = parser.parse_args()
    from pagedkv import LLM

    os.makedirs(args.trace_dir, exist_ok=True)
    largest = max(args.batch_sizes)
    blocks = largest * ((2 * PROMPT_LEN + 3 * STEPS + 16) // 16 + 1)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, num_device_blocks=blocks, max_model_len=512,
              max_num_seqs=largest, max_num_batched_tokens=max(2048, largest), async_scheduling=args.async_scheduling)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run: no device events)"
    mode = "async scheduling" if args.async_scheduling else "synchronous steps"
    print(f"{name}, {time.strftime('%Y-%m-%d')}, {llm.engine.model_info.name}, {mode}, {STEPS} decode steps per batch size")
    print("| batch | step, no profiler (µs) | step in the trace (µs) | GPU busy (µs) | busy / traced step | "
          "busy / unprofiled step | trace |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for batch_size in args.batch_sizes:
        result = measure(llm, batch_size, args.device, args.trace_dir)
        print(f"| {batch_size} | {result['plain_us']:,.0f} | {result['window_us']:,.0f} | {result['busy_us']:,.0f} | "
              f"{result['busy_us'] / result['window_us']:.0%} | {min(1.0, result['busy_us'] / result['plain_us']):.0%} | "
              f"{os.path.basename(result['trace'])} |")


if __name__ == "__main__":
    main()

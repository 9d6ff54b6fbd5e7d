"""The CPU small-M linear kernel (rust/cpu_kernels/small_m_linear.rs) against torch's F.linear, same
run, on SmolLM2-135M's linear shapes (hidden 576, MLP 1536, 9 query + 3 KV heads of 64, vocabulary
49152) at decode batch sizes, float32 and bfloat16. Prints one table: median µs per call, the
speed-up, and the weight bytes the kernel streams per second, also as a fraction of this machine's
copy bandwidth (a 512 MB torch copy, read + written bytes, best of 3, measured in the same run).

    python benches/cpu_linear.py [--threads N]
    python benches/cpu_linear.py --decode [--runs 3]   # batch-1 decode tokens/s of the embedded
                                                       # SmolLM2, kernel on vs off, alternating runs
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from host_bandwidth import host_copy_bandwidth

from pagedkv.layers.cpu_linear import small_m_linear

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 3, 64, 49152
SHAPES = {  # name: (out_features N, in_features K)
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
    "lm_head": (VOCAB, HIDDEN),
}
ROWS = (1, 2, 4, 8, 16, 32, 64)


def alternating_medians(first, second) -> tuple[float, float]:
    """Median seconds per call of each, calls alternating so the machine's load hits both alike;
    about 0.3 s of calls each (at least 5)."""
    first(), second()
    started = time.perf_counter()
    second()
    repeats = max(5, min(200, int(0.3 / max(time.perf_counter() - started, 1e-6))))
    times = ([], [])
    for _ in range(repeats):
        for call, spent in zip((first, second), times):
            started = time.perf_counter()
            call()
            spent.append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])


def shapes_table() -> None:
    bandwidth = host_copy_bandwidth(timed_copies=3)
    print(f"{torch.get_num_threads()} threads; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + written); "
          "median µs per call, torch F.linear vs ours, same run, calls alternating")
    print("| shape | N x K | dtype | M | torch µs | ours µs | speed-up | ours GB/s | of copy bw |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for name, (out_features, in_features) in SHAPES.items():
            weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
            weight_bytes = weight.numel() * weight.element_size()
            for rows in ROWS:
                x = torch.randn(rows, in_features, generator=generator).to(dtype)
                theirs, ours = alternating_medians(lambda: F.linear(x, weight), lambda: small_m_linear(x, weight))
                streamed = weight_bytes / ours
                print(f"| {name} | {out_features} x {in_features} | {str(dtype).removeprefix('torch.')} | {rows} "
                      f"| {theirs * 1e6:.0f} | {ours * 1e6:.0f} | {theirs / ours:.2f}x | {streamed / 1e9:.1f} "
                      f"| {streamed / bandwidth:.0%} |")


def decode_tokens_per_second(llm, num_tokens: int) -> float:
    """One request's decode steps (after its prefill) per second."""
    from pagedkv import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=num_tokens + 1, ignore_eos=True, temperature=0)
    engine.add_request(f"r{time.perf_counter_ns()}", list(range(100, 132)), params)
    engine.step()  # (the prefill)
    started = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - started)


def decode_table(runs: int, num_tokens: int) -> None:
    from pagedkv import LLM

    print(f"{torch.get_num_threads()} threads; embedded SmolLM2-135M, batch-1 decode of {num_tokens} tokens after a "
          f"32-token prompt; tokens/s, min-max over {runs} runs, kernel off and on alternating")
    print("| dtype | torch (off) tok/s | kernel (on) tok/s | speed-up (medians) |")
    print("| --- | ---: | ---: | ---: |")
    for dtype in ("float32", "bfloat16"):
        engines = {kernel: LLM(dtype=dtype, cpu_linear_kernel=kernel, num_device_blocks=64, max_model_len=512)
                   for kernel in (False, True)}
        rates = {False: [], True: []}
        for kernel in (False, True):
            decode_tokens_per_second(engines[kernel], 8)  # (warm-up)
        for _ in range(runs):
            for kernel in (False, True):
                rates[kernel].append(decode_tokens_per_second(engines[kernel], num_tokens))
        for llm in engines.values():
            llm.shutdown()
        off, on = rates[False], rates[True]
        print(f"| {dtype} | {min(off):.1f}-{max(off):.1f} | {min(on):.1f}-{max(on):.1f} "
              f"| {statistics.median(on) / statistics.median(off):.2f}x |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--decode", action="store_true", help="end to end: batch-1 decode tokens/s, kernel on vs off")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.decode:
        decode_table(args.runs, args.tokens)
    else:
        shapes_table()


if __name__ == "__main__":
    main()

"""Time to a ready engine on the embedded SmolLM2 GGUF, each load in a fresh process: reading
the GGUF file through transformers (PAGEDKV_GGUF_CACHE_MAX_BYTES=0) against the converted entry
of models/gguf_cache.py (made once before timing, in a cache directory of this run's own), runs
alternated. The time is `LLM()`'s, after `import pagedkv` and torch (imports the engine makes
while loading count: both sides make the same ones).

    python benches/gguf_load.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

MEASURE = r"""
import time, torch, pagedkv
started = time.perf_counter()
llm = pagedkv.LLM(dtype="float32", num_device_blocks=64, max_model_len=256)
print(time.perf_counter() - started)
"""


def timed(env: dict) -> float:
    out = subprocess.run([sys.executable, "-c", MEASURE], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        cached = dict(os.environ, PAGEDKV_CACHE_DIR=cache, PAGEDKV_GGUF_CACHE_MAX_BYTES=str(512 << 20))
        direct = dict(cached, PAGEDKV_GGUF_CACHE_MAX_BYTES="0")
        first = timed(cached)  # (converts: the entry is made here)
        times: dict[str, list[float]] = {"GGUF read by transformers": [], "converted entry": []}
        for run in range(args.runs):
            times["GGUF read by transformers"].append(timed(direct))
            times["converted entry"].append(timed(cached))
            print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
    print(f"first load (converting): {first:.1f} s\n")
    print("| SmolLM2-135M GGUF, LLM() in a fresh process | seconds, range over runs | median |")
    print("| --- | ---: | ---: |")
    for label, values in times.items():
        print(f"| {label} | {min(values):.1f}-{max(values):.1f} | {statistics.median(values):.1f} |")
    ratio = statistics.median(times["GGUF read by transformers"]) / statistics.median(times["converted entry"])
    print(f"\nmedian ratio: {ratio:.1f}x")


if __name__ == "__main__":
    main()

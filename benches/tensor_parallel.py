"""Tensor parallelism: tokens/s of the same greedy job at tensor_parallel_size 1, 2, ... (same
model, dtype and device, in one run), and rank 0's time inside the model's all-reduces (waiting
for the other ranks included) per step. Prints one table.

    python benches/tensor_parallel.py                          # SmolLM2-135M on the CPU (gloo), TP 1 and 3
    python benches/tensor_parallel.py --device cuda --sizes 1 2 4 --model /models/llama-70b

On a 2-core CPU the ranks share the cores: the point there is that it runs, not a speed-up.
"""

from __future__ import annotations

import argparse
import time

from throughput import make_prompts

from pagedkv import LLM, SamplingParams
from pagedkv.parallel.group import TensorParallelGroup


class AllReduceClock:
    """Wraps TensorParallelGroup.all_reduce in this process (rank 0) to add up its time."""

    def __init__(self):
        self.seconds, self.count = 0.0, 0
        self._original = TensorParallelGroup.all_reduce
        clock = self

        def timed(group, tensor):
            if group.size == 1:
                return tensor
            started = time.perf_counter()
            result = clock._original(group, tensor)
            clock.seconds += time.perf_counter() - started
            clock.count += 1
            return result

        TensorParallelGroup.all_reduce = timed


def run(args, size: int, clock: AllReduceClock) -> dict:
    llm = LLM(args.model, device=args.device, dtype=args.dtype, tensor_parallel_size=size,
              max_model_len=1024, enforce_eager=True)
    try:
        prompts = [{"prompt_token_ids": p} for p in make_prompts(llm.tokenizer, args.num_prompts)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # (warm-up)
        steps_before, seconds_before, count_before = llm.engine.stats()["num_steps"], clock.seconds, clock.count
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - started
        steps = llm.engine.stats()["num_steps"] - steps_before
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        all_reduce = clock.seconds - seconds_before
        return {"size": size, "tokens/s": tokens / elapsed, "steps": steps, "ms/step": 1000 * elapsed / steps,
                "all-reduces/step": (clock.count - count_before) / steps,
                "all-reduce ms/step": 1000 * all_reduce / steps, "all-reduce %": 100 * all_reduce / elapsed,
                "tokens": [o.outputs[0].token_ids for o in outputs]}
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 3], help="tensor_parallel_size values (first: baseline)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    clock = AllReduceClock()
    rows = [run(args, size, clock) for size in args.sizes]
    baseline = rows[0]
    print(f"\n{args.num_prompts} prompts x {args.max_tokens} tokens, {args.device}, {args.dtype}")
    print("| TP | tokens/s | vs TP=%d | steps | ms/step | all-reduces/step | all-reduce ms/step | all-reduce %% of time | same tokens |"
          % baseline["size"])
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        same = sum(a == b for a, b in zip(row["tokens"], baseline["tokens"]))
        print(f"| {row['size']} | {row['tokens/s']:.1f} | {row['tokens/s'] / baseline['tokens/s']:.2f}x | {row['steps']} "
              f"| {row['ms/step']:.1f} | {row['all-reduces/step']:.0f} | {row['all-reduce ms/step']:.2f} "
              f"| {row['all-reduce %']:.0f} | {same}/{len(row['tokens'])} |")


if __name__ == "__main__":
    main()

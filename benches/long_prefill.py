"""Short prompts queued behind a long one (SmolLM2-135M, the CPU engine): time to first token
with `long_prefill_token_threshold` off (the long prompt's chunks take each step's whole budget,
so the short prompts wait for its prefill) and on (its chunks stop at the threshold and the short
prompts prefill beside them), in one run.

    python benches/long_prefill.py                       # 1 x ~1,500-token prompt, 8 short ones
    python benches/long_prefill.py --thresholds 64 256 --budget 512
"""

from __future__ import annotations

import argparse
import statistics

from pagedkv import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--thresholds", type=int, nargs="+", default=[128])
    parser.add_argument("--num-short", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    long_prompt = "Summarize the following notes. " + " ".join(f"Note {i}: the cache holds block {i}." for i in range(160))
    short_prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(args.num_short)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    baseline = None
    for threshold in [0, *args.thresholds]:
        llm = LLM(max_num_batched_tokens=args.budget, max_model_len=4096, enable_prefix_caching=False,
                  long_prefill_token_threshold=threshold)
        if baseline is None:
            long_tokens = len(llm.get_tokenizer()(long_prompt).input_ids)
            print(f"# 1 prompt of {long_tokens} tokens then {args.num_short} short ones, {args.max_tokens} new tokens "
                  f"each, budget {args.budget} tokens/step, {llm.engine.runner.dtype}, CPU, median of 3 runs")
            print("| long_prefill_token_threshold | short prompts' median TTFT (ms) | long prompt's TTFT (ms) | "
                  "all done (ms) | short TTFT vs off |")
            print("| ---: | ---: | ---: | ---: | ---: |")
        llm.generate([long_prompt] + short_prompts, params, use_tqdm=False)  # warm-up
        runs = [llm.generate([long_prompt] + short_prompts, params, use_tqdm=False) for _ in range(3)]
        outputs = sorted(runs, key=lambda run: statistics.median(o.metrics.time_to_first_token for o in run[1:]))[1]
        short_ttft = statistics.median(output.metrics.time_to_first_token for output in outputs[1:]) * 1e3
        long_ttft = outputs[0].metrics.time_to_first_token * 1e3
        done = max(output.metrics.finished_time - output.metrics.arrival_time for output in outputs) * 1e3
        baseline = baseline or short_ttft
        label = "off" if threshold == 0 else threshold
        print(f"| {label} | {short_ttft:,.0f} | {long_ttft:,.0f} | {done:,.0f} | {baseline / short_ttft:.2f}× |")


if __name__ == "__main__":
    main()

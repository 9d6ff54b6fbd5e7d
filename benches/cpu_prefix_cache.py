"""The prefix cache's CPU tier (`enable_cpu_prefix_cache`) on a workload whose shared prefixes do
not all fit the device pool: D long documents, each asked a new short question every round
(RAG / multi-turn chat shape). Each round's requests run together; between two rounds of the
same document the others evict its cached blocks from the device. One run, one table:

- tier off: the device prefix cache alone (evicted prefixes are recomputed);
- tier on: evicted blocks wait in free CPU swap blocks and are copied back on a hit;
- ceiling: a device pool large enough to keep every document cached.

    python benches/cpu_prefix_cache.py                      # 8 documents x 448 tokens, 4 rounds
    python benches/cpu_prefix_cache.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time


def make_documents(tokenizer, num_documents: int, document_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = "the a model cache block memory serves request token attention layer paged batch river stone".split()
    documents = []
    for _ in range(num_documents):
        ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(2 * document_tokens)))
        documents.append(ids[:document_tokens])
    return documents


def run(documents, questions, max_tokens, rounds, **engine_options) -> dict:
    from pagedkv import LLM, SamplingParams

    llm = LLM(**engine_options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([questions[0][0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    ttfts, hit_tokens, prompt_tokens, generated = [], 0, 0, 0
    started = time.perf_counter()
    for round_index in range(rounds):
        prompts = [document + questions[round_index][d] for d, document in enumerate(documents)]
        for output in llm.generate(prompts, params, use_tqdm=False):
            ttfts.append(output.metrics.time_to_first_token)
            hit_tokens += output.metrics.num_prefix_hit_tokens
            prompt_tokens += len(output.prompt_token_ids)
            generated += len(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - started
    stats = llm.engine.stats()
    result = {
        "elapsed": elapsed,
        "requests_per_s": rounds * len(documents) / elapsed,
        "tokens_per_s": (prompt_tokens + generated) / elapsed,
        "ttft_mean_ms": 1000 * statistics.mean(ttfts),
        "hit_share": hit_tokens / prompt_tokens,
        "computed_prompt_tokens": prompt_tokens - hit_tokens,
        "reloaded_blocks": stats["cpu_prefix_cache_hits"],
        "offloaded_blocks": stats["num_blocks_offloaded"],
        "device_blocks": stats["num_device_blocks"],
    }
    del llm
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--document-tokens", type=int, default=448)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--device-blocks", type=int, default=96, help="device pool of the tier off/on rows")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from pagedkv.models.loader import default_model_path

    model_dir, gguf_file = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
    documents = make_documents(tokenizer, args.documents, args.document_tokens)
    rng = random.Random(1)
    questions = [[tokenizer.encode(f" Question {r}.{d}: which word comes {rng.choice(['first', 'last'])}?")
                  for d in range(args.documents)] for r in range(args.rounds)]
    common = dict(device=args.device, dtype=args.dtype, max_model_len=1024, swap_space_bytes=1 << 30)
    roomy = (args.documents + 2) * (args.document_tokens // 16 + 4) * 2
    rows = [
        ("tier off (device prefix cache only)", run(documents, questions, args.max_tokens, args.rounds,
                                                    num_device_blocks=args.device_blocks, **common)),
        ("tier on (enable_cpu_prefix_cache)", run(documents, questions, args.max_tokens, args.rounds,
                                                  num_device_blocks=args.device_blocks,
                                                  enable_cpu_prefix_cache=True, **common)),
        ("ceiling: every document fits the device", run(documents, questions, args.max_tokens, args.rounds,
                                                        num_device_blocks=roomy, **common)),
    ]
    baseline = rows[0][1]["tokens_per_s"]
    ceiling = rows[2][1]["tokens_per_s"]
    print(f"\n{args.documents} documents x {args.document_tokens} tokens, {args.rounds} rounds, "
          f"{args.max_tokens} new tokens, device={args.device}, dtype={args.dtype}")
    print("| configuration | device blocks | tokens/s | vs tier off | % of ceiling | mean TTFT (ms) | prompt tokens hit | "
          "prompt tokens computed | blocks offloaded / reloaded |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows:
        print(f"| {name} | {r['device_blocks']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / baseline:.2f}x | "
              f"{100 * r['tokens_per_s'] / ceiling:.0f}% | {r['ttft_mean_ms']:.0f} | {100 * r['hit_share']:.0f}% | "
              f"{r['computed_prompt_tokens']} | {r['offloaded_blocks']} / {r['reloaded_blocks']} |")


if __name__ == "__main__":
    main()

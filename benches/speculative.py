"""Speculative decoding by prompt lookup (`num_speculative_tokens`) against plain decoding, same
engine settings, same run. Two workloads of greedy requests on the embedded SmolLM2:

- input-grounded: the answer repeats parts of the prompt (continuing lists, code with a
  repeated shape, quoting a passage), where n-gram drafts are often right;
- chat: open questions through the chat template, where drafts are right less often.

Each at batch 1 (one request at a time: latency) and batch 16 (throughput; with the default
speculative_disable_by_batch_size=4 the engine does not draft there). Prints one table.

    python benches/speculative.py
    python benches/speculative.py --num-speculative-tokens 6 --max-tokens 128
"""

from __future__ import annotations

import argparse
import gc
import random
import time


def grounded_prompts(count: int) -> list[str]:
    rng = random.Random(0)
    colors = ["red", "green", "blue", "yellow", "black"]
    prompts = []
    for i in range(count):
        kind = i % 3
        if kind == 0:
            items = " ".join(f"Item {j} is a {rng.choice(colors)} box." for j in range(8))
            prompts.append(f"{items} Repeat the list above exactly:\n")
        elif kind == 1:
            prompts.append("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
                           f"def mul{i}(a, b):")
        else:
            passage = ("The block manager maps each sequence's logical blocks to physical blocks, so a "
                       "sequence can grow one block at a time and share its prompt with others.")
            prompts.append(f"Passage: {passage}\nQuote the passage word for word:\n")
    return prompts


def chat_prompts(count: int) -> list[str]:
    from transformers import AutoTokenizer

    from pagedkv.models.loader import default_model_path

    directory, name = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    topics = ["rivers", "bread", "volcanoes", "chess", "bees", "clouds", "trains", "the moon"]
    asks = ["Write a short poem about {}.", "Explain {} to a child.", "Give three facts about {}.",
            "Tell a very short story about {}."]
    return [tokenizer.apply_chat_template([{"role": "user", "content": asks[i % 4].format(topics[i % 8])}],
                                          tokenize=False, add_generation_prompt=True) for i in range(count)]


def run(prompts, batch_size: int, max_tokens: int, **engine_options) -> dict:
    from pagedkv import LLM, SamplingParams

    llm = LLM(**engine_options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    outputs, started = [], time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        outputs += llm.generate(prompts[first : first + batch_size], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    stats = llm.engine.stats()
    generated = sum(len(output.outputs[0].token_ids) for output in outputs)
    result = {
        "tokens_per_s": generated / elapsed,
        "drafted": stats["num_draft_tokens"],
        "accepted": stats["num_accepted_draft_tokens"],
        "token_ids": [output.outputs[0].token_ids for output in outputs],
        "steps": stats["num_steps"],
    }
    del llm
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    common = dict(dtype=args.dtype, max_model_len=1024)
    rows = []
    for workload, prompts in (("input-grounded", grounded_prompts(args.num_prompts)),
                              ("chat", chat_prompts(args.num_prompts))):
        for batch_size in (1, 16):
            plain = run(prompts, batch_size, args.max_tokens, **common)
            fast = run(prompts, batch_size, args.max_tokens, num_speculative_tokens=args.num_speculative_tokens, **common)
            same = plain["token_ids"] == fast["token_ids"]
            rows.append((workload, batch_size, plain, fast, same))

    print(f"\ngreedy, {args.num_prompts} prompts x {args.max_tokens} tokens, num_speculative_tokens="
          f"{args.num_speculative_tokens}, dtype={args.dtype}")
    print("| workload | batch | plain tokens/s | speculative tokens/s | speed-up | drafts accepted | "
          "tokens per step (plain / speculative) | same tokens |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for workload, batch_size, plain, fast, same in rows:
        rate = fast["accepted"] / max(fast["drafted"], 1)
        print(f"| {workload} | {batch_size} | {plain['tokens_per_s']:.1f} | {fast['tokens_per_s']:.1f} | "
              f"{fast['tokens_per_s'] / plain['tokens_per_s']:.2f}x | {fast['accepted']} / {fast['drafted']} "
              f"({100 * rate:.0f}%) | {sum(map(len, plain['token_ids'])) / plain['steps']:.2f} / "
              f"{sum(map(len, fast['token_ids'])) / fast['steps']:.2f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()

"""KV-cache groups for models that mix sliding-window and full layers: how many long sequences one
pool serves with groups on (a windowed layer keeps its window's blocks) and off (every layer keeps
every block), in one run, beside the ratio the layer mix predicts. No model runs: the Rust
scheduler plans the steps (chunked prefill, then decode) over a pool sized as the engine sizes it
from a KV budget, and each step's sampled tokens are appended at once, so the table shows what
memory allows, not compute. "Predicted" is the ratio of blocks one sequence holds in steady decode
(off over on, in layer-blocks); prefill chunks hold a windowed group's window plus the chunk, so the
measured ratio sits below it at long contexts.

    python benches/hybrid_kv.py                          # Gemma 3 27B's layers, 20 GiB of KV, 4k/16k/32k
    python benches/hybrid_kv.py --model gpt-oss-20b
"""

from __future__ import annotations

import argparse
import math
from datetime import date

from pagedkv import Scheduler, SchedulerConfig
from pagedkv.runner.kv_groups import KVCacheGroups

# (layers, every how many-th layer is full (0: alternate from the first windowed), window, KV heads, head dim)
MODELS = {
    "gemma3-27b": dict(num_layers=62, full_every=6, window=1024, kv_heads=16, head_dim=128),
    "gemma3-12b": dict(num_layers=48, full_every=6, window=1024, kv_heads=8, head_dim=256),
    "gpt-oss-20b": dict(num_layers=24, full_every=2, window=128, kv_heads=8, head_dim=64),
}


def layer_windows(model: dict) -> list:
    """Each layer's window (None: full): every `full_every`-th layer is full, as Gemma 3 and GPT-OSS."""
    return [None if (layer + 1) % model["full_every"] == 0 else model["window"] for layer in range(model["num_layers"])]


def predicted_ratio(groups: KVCacheGroups, num_layers: int, context: int, block_size: int) -> float:
    """Layer-blocks one sequence of `context` tokens holds in steady decode, groups off over on: off,
    every layer keeps every block; on, a full group its blocks, a windowed group its window's."""
    blocks = math.ceil(context / block_size)
    held = sum(blocks if window == 0 else min(blocks, math.ceil((window - 1) / block_size) + 1)
               for window in groups.windows)
    return num_layers * blocks / (groups.slots_per_block * held)


def serve(groups: KVCacheGroups, num_blocks: int, context: int, args) -> dict:
    """Runs `args.requests` requests of `context`-token prompts to `args.output_len` new tokens;
    returns the most sequences running at once (holding blocks) and the preemptions."""
    config = SchedulerConfig(
        block_size=args.block_size, num_device_blocks=num_blocks, num_cpu_blocks=0,
        max_num_seqs=args.requests, max_num_batched_tokens=args.budget, max_model_len=context + args.output_len,
        max_waiting_requests=args.requests, enable_prefix_caching=False, preemption_mode="recompute",
        kv_group_windows=list(groups.windows) if groups.num_groups > 1 else [],
        sliding_window=groups.windows[0] if groups.num_groups == 1 else 0,
    )
    scheduler = Scheduler(config)
    for index in range(args.requests):
        scheduler.add_request(str(index), [(index * 7919 + position) % 32000 for position in range(context)])
    target, most_running, steps = context + args.output_len, 0, 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        steps += 1
        most_running = max(most_running, scheduler.stats()["num_running_seqs"])
        for seq_id in out.seq_ids[out.samples].tolist():
            if scheduler.sequence_len(seq_id) + 1 >= target:
                scheduler.finish_sequence(seq_id)
            else:
                scheduler.append_token(seq_id, 7)
    stats = scheduler.stats()
    preemptions = stats["num_preemptions_recompute"] + stats["num_preemptions_swap"]
    return dict(most_running=most_running, preemptions=preemptions, steps=steps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gemma3-27b")
    parser.add_argument("--kv-gib", type=float, default=20.0, help="KV-cache budget (the engine's kv_cache_memory_bytes)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048, help="tokens per step (chunked prefill)")
    args = parser.parse_args(argv)
    model = MODELS[args.model]
    windows = layer_windows(model)
    layer_block_bytes = 2 * model["kv_heads"] * model["head_dim"] * args.block_size * 2  # bfloat16
    budget = int(args.kv_gib * (1 << 30))
    modes = {"on": KVCacheGroups.for_layers(windows), "off": KVCacheGroups.for_layers(windows, hybrid=False)}
    print(f"# {args.model}: {model['num_layers']} layers, window {model['window']}; groups on: "
          f"{modes['on'].describe()}; {args.kv_gib:g} GiB of bfloat16 KV; {args.requests} requests of "
          f"+{args.output_len} tokens; {date.today()}")
    print("| context | blocks on / off | most running at once, on | off | ratio | predicted | preemptions on / off | "
          "steps to finish on / off |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for context in args.contexts:
        results, blocks = {}, {}
        for mode, groups in modes.items():
            blocks[mode] = budget // (groups.slots_per_block * layer_block_bytes)
            results[mode] = serve(groups, blocks[mode], context, args)
        on, off = results["on"], results["off"]
        ratio = on["most_running"] / max(off["most_running"], 1)
        predicted = predicted_ratio(modes["on"], model["num_layers"], context + args.output_len, args.block_size)
        print(f"| {context:,} | {blocks['on']:,} / {blocks['off']:,} | {on['most_running']} | {off['most_running']} | "
              f"{ratio:.2f}x | {predicted:.2f}x | {on['preemptions']} / {off['preemptions']} | "
              f"{on['steps']:,} / {off['steps']:,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""KV blocks under a sliding window: the Rust scheduler serving long generations of a model whose
every layer is windowed (Mistral-7B's 4,096 positions), with blocks before each sequence's window
released as it advances, against the same scheduler keeping every block (window 0) in one run.
No model runs: each step's sampled tokens are appended at once, so the table shows what memory
allows (sequences running per step, steps to finish, preemptions), not compute.

    python benches/window_blocks.py                         # 32 requests, 1,024-token prompts, 15,360 new tokens
    python benches/window_blocks.py --output-len 4096       # generations inside twice the window
"""

from __future__ import annotations

import argparse
import time

from pagedkv import Scheduler, SchedulerConfig


def serve(window: int, args) -> dict:
    """Runs every request to its length; returns what the table prints."""
    config = SchedulerConfig(
        block_size=args.block_size, num_device_blocks=args.num_blocks, num_cpu_blocks=0,
        max_num_seqs=args.requests, max_num_batched_tokens=args.budget, max_model_len=args.prompt_len + args.output_len,
        max_waiting_requests=args.requests, enable_prefix_caching=False, preemption_mode="recompute",
        sliding_window=window,
    )
    scheduler = Scheduler(config)
    target = args.prompt_len + args.output_len
    for i in range(args.requests):
        scheduler.add_request(str(i), [(i * 7919 + j) % 32000 for j in range(args.prompt_len)])
    steps = running_total = 0
    blocks_per_seq = []
    started = time.perf_counter()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        steps += 1
        running_total += len(out.scheduled)
        for seq in out.scheduled:
            if not seq.sample:
                continue
            if scheduler.sequence_len(seq.seq_id) >= target:
                scheduler.finish_sequence(seq.seq_id)
                continue
            scheduler.append_token(seq.seq_id, 1)
        if steps % 64 == 0 and out.scheduled:  # (sampled: stats() builds a dict)
            stats = scheduler.stats()
            used = stats["num_device_blocks"] - stats["num_free_device_blocks"]
            blocks_per_seq.append(used / len(out.scheduled))
    stats = scheduler.stats()
    return dict(steps=steps, running=running_total / steps, blocks_per_seq=sum(blocks_per_seq) / len(blocks_per_seq),
                preemptions=int(stats["num_preemptions_recompute"]), seconds=time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=15360)
    parser.add_argument("--num-blocks", type=int, default=2048, help="device pool (2,048 blocks of 16 = 32,768 tokens)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    args = parser.parse_args()
    rows = []
    for window in (0, args.window):
        rows.append((window, serve(window, args)))
    baseline = rows[0][1]
    print(f"{args.requests} requests x ({args.prompt_len} prompt + {args.output_len} new tokens), pool "
          f"{args.num_blocks} blocks of {args.block_size} ({args.num_blocks * args.block_size} tokens)")
    header = (f"{'blocks before the window':>24} | {'running seqs/step':>17} | {'steps to finish':>15} | "
              f"{'vs keeping':>10} | {'blocks held/seq':>15} | {'preemptions':>11}")
    print(header)
    print("-" * len(header))
    for window, row in rows:
        label = "kept (window ignored)" if window == 0 else f"released (window {window})"
        print(f"{label:>24} | {row['running']:>17.1f} | {row['steps']:>15,} | {baseline['steps'] / row['steps']:>9.2f}x | "
              f"{row['blocks_per_seq']:>15,.0f} | {row['preemptions']:>11,}")


if __name__ == "__main__":
    main()

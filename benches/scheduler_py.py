"""The scheduler's decode step through PyO3: schedule() + append_token per sequence, as an engine
drives it. Prints one table; the Rust-only figure comes from `cargo bench --bench scheduler`."""

import time

from pagedkv import Scheduler, SchedulerConfig

CONTEXT = 512
STEPS = 200


def decoding_scheduler(num_seqs: int) -> Scheduler:
    config = SchedulerConfig(
        num_device_blocks=num_seqs * ((CONTEXT + STEPS) // 16 + 2),
        num_cpu_blocks=0,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=num_seqs * CONTEXT,
        max_model_len=1 << 20,
        max_waiting_requests=num_seqs,
        enable_prefix_caching=False,
        watermark=0.0,
    )
    scheduler = Scheduler(config)
    for i in range(num_seqs):
        scheduler.add_request(str(i), list(range(CONTEXT)))
    for seq in scheduler.schedule().scheduled:
        scheduler.append_token(seq.seq_id, 1)
    return scheduler


def main() -> None:
    rows = []
    for num_seqs in (64, 256, 1024):
        scheduler = decoding_scheduler(num_seqs)
        schedule_only = step_total = 0.0
        for _ in range(STEPS):
            started = time.perf_counter()
            out = scheduler.schedule()
            scheduled = out.scheduled
            middle = time.perf_counter()
            for seq in scheduled:
                scheduler.append_token(seq.seq_id, 1)
            ended = time.perf_counter()
            schedule_only += middle - started
            step_total += ended - started
        rows.append((num_seqs, schedule_only / STEPS * 1e6, step_total / STEPS * 1e6))
    print(f"{'running seqs':>12} | {'schedule() us':>14} | {'step incl. append_token us':>27} | {'us/seq':>7}")
    print(f"{'-' * 12}-+-{'-' * 14}-+-{'-' * 27}-+-{'-' * 7}")
    for num_seqs, schedule_us, step_us in rows:
        print(f"{num_seqs:>12} | {schedule_us:>14.1f} | {step_us:>27.1f} | {step_us / num_seqs:>7.2f}")


if __name__ == "__main__":
    main()

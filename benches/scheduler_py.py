"""The scheduler's decode step through PyO3, two ways, in one run: the columnar step an engine
drives (schedule() + the seq_ids column + one update() call) and the per-sequence view (the
`scheduled` objects + append_token per sequence, as engines drove it before the columns). Prints
one table; the Rust-only figure comes from `cargo bench --bench scheduler`."""

import time

import numpy as np

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


def columnar_step(scheduler: Scheduler, ones: np.ndarray) -> None:
    out = scheduler.schedule()
    scheduler.update(out.seq_ids, ones)


def per_sequence_step(scheduler: Scheduler, ones: np.ndarray) -> None:
    for seq in scheduler.schedule().scheduled:
        scheduler.append_token(seq.seq_id, 1)


def step_us(num_seqs: int, step) -> float:
    scheduler = decoding_scheduler(num_seqs)
    ones = np.ones(num_seqs, dtype=np.int64)
    started = time.perf_counter()
    for _ in range(STEPS):
        step(scheduler, ones)
    return (time.perf_counter() - started) / STEPS * 1e6


def main() -> None:
    print(f"{'running seqs':>12} | {'columnar step us':>16} | {'per-sequence step us':>20} | {'ratio':>6}")
    print(f"{'-' * 12}-+-{'-' * 16}-+-{'-' * 20}-+-{'-' * 6}")
    for num_seqs in (64, 256, 1024):
        columnar, per_sequence = step_us(num_seqs, columnar_step), step_us(num_seqs, per_sequence_step)
        print(f"{num_seqs:>12} | {columnar:>16.1f} | {per_sequence:>20.1f} | {per_sequence / columnar:>5.1f}x")


if __name__ == "__main__":
    main()

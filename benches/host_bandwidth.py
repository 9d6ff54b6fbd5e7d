"""The host's memory bandwidth as the CPU benchmarks measure it: a torch `copy_` of 512 MiB,
counted as bytes read + bytes written per second, best of the timed copies (the first copy,
which touches the pages, is not timed)."""

from __future__ import annotations

import time

import torch


def host_copy_bandwidth(timed_copies: int = 5) -> float:
    """Bytes per second, on torch's current number of threads."""
    source = torch.ones(512 << 20, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(timed_copies):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return 2 * source.numel() / best

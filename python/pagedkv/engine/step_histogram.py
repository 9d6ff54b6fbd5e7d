"""A fixed-bucket histogram the engine keeps of a per-step count (tokens per step: vLLM's
vllm:iteration_tokens_total), cheap to observe every step and to copy into `LLMEngine.stats`."""

from __future__ import annotations

import bisect

ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # (vLLM's)


class StepHistogram:
    def __init__(self, buckets: tuple[int, ...] = ITERATION_TOKENS_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # per bucket (not cumulative); the last: above every bound
        self.sum = 0
        self.count = 0

    def observe(self, value: int) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict:
        """{"buckets": [(upper bound, cumulative count)...] ending at +inf, "sum", "count"}."""
        cumulative, total = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            total += count
            cumulative.append((bound, total))
        return {"buckets": cumulative, "sum": self.sum, "count": self.count}

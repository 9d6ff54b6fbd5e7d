"""Ending a generation that repeats itself (vLLM's `repetition_detection`): a sequence whose last
tokens are one pattern of `min_pattern_size`..`max_pattern_size` tokens, `min_count` times in a
row, finishes with finish_reason "repetition" (stop_reason "repetition_detected")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

STOP_REASON = "repetition_detected"


@dataclass
class RepetitionDetectionParams:
    max_pattern_size: int = 0  # the longest pattern looked for, in tokens (0: off)
    min_pattern_size: int = 0  # the shortest (0: 1)
    min_count: int = 0  # repeats that end the sequence (>= 2 where on)

    def __post_init__(self) -> None:
        sizes = (self.max_pattern_size, self.min_pattern_size, self.min_count)
        if not all(isinstance(size, int) and not isinstance(size, bool) for size in sizes):
            raise ValueError(f"repetition_detection max_pattern_size, min_pattern_size and min_count must be "
                             f"integers, got {sizes}")
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise ValueError("repetition_detection max_pattern_size, min_pattern_size must be >= 0, with "
                             "min_pattern_size <= max_pattern_size; set both to 0 to turn detection off")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError("repetition_detection min_count must be >= 2 to detect repeated patterns; set "
                             "max_pattern_size to 0 to turn detection off")

    @property
    def on(self) -> bool:
        return self.max_pattern_size > 0

    def repeats(self, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids` end with a pattern of an allowed size repeated min_count times."""
        count = self.min_count
        for size in range(max(1, self.min_pattern_size), self.max_pattern_size + 1):
            if size * count > len(token_ids):
                return False
            pattern = token_ids[len(token_ids) - size:]
            if all(token_ids[len(token_ids) - size * (k + 1):len(token_ids) - size * k] == pattern
                   for k in range(1, count)):
                return True
        return False

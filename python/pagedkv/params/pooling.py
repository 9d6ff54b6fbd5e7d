"""Pooling parameters: a request that returns its prompt's embedding or class scores instead of
generating."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify")


@dataclass
class PoolingParams:
    """Both tasks read the final hidden state of the prompt's last token (vLLM's LAST pooling, what
    it uses for decoder-only models). `task="embed"`: that state is the embedding, L2-normalized
    unless `normalize=False`. `task="classify"` (a `*ForSequenceClassification` checkpoint): the
    classifier's scores over its labels, through its activation (softmax, or sigmoid for one
    label) unless `use_activation=False`, which returns the raw scores (a reward model's reward)."""

    normalize: bool = True
    task: str = "embed"
    use_activation: bool = True

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")

"""What the engine returns for a request: cumulative text and tokens of each sample or beam, or
the prompt's embedding for a pooling request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class CompletionOutput:
    """One sample (or beam) of a request, cumulative so far (with output_kind "delta": what is new
    since the request's previous output; cumulative_logprob stays the running total)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop", "length", "abort", or None while running
    stop_reason: Optional[object] = None  # the stop string or token id that ended it
    cumulative_logprob: Optional[float] = None  # None unless logprobs were requested (as in vLLM)
    # One dict per generated token: {token_id: logprob} of the top-k candidates plus the sampled one.
    logprobs: Optional[list[dict[int, float]]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and counters of one request."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after an engine step."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # With SamplingParams.prompt_logprobs: per prompt token {token_id: logprob} of the top-k
    # candidates plus the actual token; None for the first token (nothing predicts it).
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    # The prompt's length: len(prompt_token_ids), or the rows of a prompt given as embeddings
    # (whose prompt_token_ids are empty: it has none)
    num_prompt_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens is None:
            self.num_prompt_tokens = len(self.prompt_token_ids)


@dataclass
class EmbeddingOutput:
    """A prompt's embedding (hidden size floats)."""

    embedding: list[float]


@dataclass
class ClassificationOutput:
    """A prompt's class probabilities (or raw scores with `use_activation=False`), one per label."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class PoolingRequestOutput:
    """The result of a pooling request (`PoolingParams`): no tokens, one vector of its prompt."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: Union[EmbeddingOutput, ClassificationOutput]
    finished: bool = True
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """The result of an embedding request; `outputs.embedding` as in vLLM."""

    outputs: EmbeddingOutput


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    """The result of a classification request (`PoolingParams(task="classify")`); `outputs.probs`
    as in vLLM."""

    outputs: ClassificationOutput


@dataclass
class ScoringOutput:
    """A pair's relevance score."""

    score: float


@dataclass
class ScoringRequestOutput:
    """The score of one (text_1, text_2) pair; `outputs.score` as in vLLM. `prompt_token_ids`: the
    pair's tokens with a cross-encoder, else the two texts' tokens one after the other."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True

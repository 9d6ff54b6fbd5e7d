"""The two messages of a step between the engine and the runner (vLLM V1's typed scheduler <->
worker messages): with the scheduler's plan, `StepRequests` says what the engine wants from the
step beyond the forward pass; `ModelRunnerOutput` is everything the step computed for it. The
runner owns logits, sampling, draft verification and the pooling heads; the engine keeps the
request books, stop checks, detokenization and outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from pagedkv.params.pooling import PoolingParams
from pagedkv.runner.sampler import SamplingRow


@dataclass(frozen=True)
class PromptEmbeds:
    """A prompt's embeddings: `rows` [k, hidden] and, for each prompt position, the row it reads in
    place of its token's embedding (-1: the token's own). A prompt given whole as embeddings has
    row_of_position = 0..k-1; a chat message's embedded parts, only some positions."""

    rows: torch.Tensor
    row_of_position: np.ndarray  # int64 [prompt length]


@dataclass
class PromptLogprobsRequest:
    """Score the prompt tokens a prefill chunk predicts: the chunk starts at position `start`,
    positions before `first` are recorded already (a recomputed prefill repeats some), `top`
    most likely tokens beside each prompt token (0: the prompt token alone)."""

    start: int
    prompt_token_ids: list[int]
    first: int
    top: int


@dataclass
class StepRequests:
    """What the engine asks of one step, by sequence id (sequences the plan schedules)."""

    # One row per sample to draw; `logits_index` is the sequence's place among the plan's sampling
    # sequences (a fork of n > 1 draws its first token from its parent's row).
    sampling_rows: list[SamplingRow] = field(default_factory=list)
    row_seq_ids: list[int] = field(default_factory=list)  # the sequence each sampling row is for
    drafts: dict[int, list[int]] = field(default_factory=dict)  # draft tokens this step verifies
    prompt_logprobs: dict[int, PromptLogprobsRequest] = field(default_factory=dict)
    pooling: dict[int, PoolingParams] = field(default_factory=dict)
    logits_for: list[int] = field(default_factory=list)  # sampling sequences whose raw logits come back (beams)
    loras: Optional[dict] = None  # seq_id -> LoRAAdapter of the sequences that run one
    # Prompts with embeddings, by sequence, where the step computes some of the prompt's
    # positions (the runner puts their rows in place of the token embeddings)
    prompt_embeds: dict[int, PromptEmbeds] = field(default_factory=dict)

    def needs_hidden_states(self) -> frozenset[int]:
        """Sequences whose every scheduled token's final hidden state the step keeps."""
        return frozenset(self.drafts) | frozenset(self.prompt_logprobs) | frozenset(self.pooling)


@dataclass
class ModelRunnerOutput:
    """One step's results for the engine."""

    sampled_token_ids: list[Optional[int]] = field(default_factory=list)  # per sampling row; None where it failed
    # (the token's logprob, its top logprobs or None) by sampling row, for the rows that asked
    sampled_logprobs: dict[int, tuple[float, Optional[dict[int, float]]]] = field(default_factory=dict)
    # Drafts verified, by sequence: the drafts the model agrees with, then its own next token.
    accepted_tokens: dict[int, list[int]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)  # entries for positions first..
    pooled: dict[int, list[float]] = field(default_factory=dict)  # embedding or class scores
    logits: Optional[torch.Tensor] = None  # float32 [len(logits_for), vocab] rows of StepRequests.logits_for
    errors: dict[int, BaseException] = field(default_factory=dict)  # seq_id -> what failed for it alone


@dataclass
class PendingOutput:
    """The results of a step launched asynchronously (`ModelRunner.execute_async`): the sampled
    tokens, being copied to `tokens` (pinned host memory on CUDA) until `ready` is reached."""

    tokens: torch.Tensor  # int64 [rows], one per StepRequests.sampling_rows
    ready: Optional[torch.cuda.Event] = None
    done: Optional[ModelRunnerOutput] = None  # the output, when the step had to finish on the host

    def wait(self) -> ModelRunnerOutput:
        """Blocks until the tokens are on the host; then the step's ModelRunnerOutput."""
        if self.done is not None:
            return self.done
        if self.ready is not None:
            self.ready.synchronize()
        return ModelRunnerOutput(sampled_token_ids=self.tokens.tolist())

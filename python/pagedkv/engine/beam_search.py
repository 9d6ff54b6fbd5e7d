"""Beam search over the paged cache: beams are sequences of one group; a beam with several
surviving continuations is forked (its blocks shared), a beam with none is freed at once.

The selection follows HF transformers' `_beam_search` (top 2k candidates over all beams, finished
hypotheses scored by logprob / generated_len ** length_penalty, early stop once no running beam
can beat the worst kept hypothesis), so greedy beams give the same sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedkv.outputs import CompletionOutput


@dataclass
class Hypothesis:
    token_ids: list[int]
    score: float  # length-penalized
    cumulative_logprob: float


@dataclass
class BeamSearch:
    """State of one beam-search request between steps."""

    beam_width: int
    num_outputs: int
    max_tokens: int  # already capped by max_model_len
    length_penalty: float
    eos_token_ids: frozenset[int]
    ignore_eos: bool
    # seq_id -> (generated tokens, cumulative logprob) of each running beam
    running: dict[int, tuple[list[int], float]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False

    def step(self, seq_ids: list[int], logits: torch.Tensor, scheduler) -> None:
        """Advances every running beam by one token. `logits` [len(seq_ids), vocab] are the rows of
        the running beams. Forks and frees sequences through `scheduler`; sets `done` at the end."""
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        prior = torch.tensor([self.running[seq_id][1] for seq_id in seq_ids], dtype=log_probs.dtype)
        scores = (log_probs + prior[:, None]).reshape(-1)
        vocab = log_probs.shape[-1]
        num_candidates = 2 * self.beam_width
        top_scores, top_indices = torch.topk(scores, k=min(num_candidates, scores.numel()))
        generated_len = len(self.running[seq_ids[0]][0]) + 1
        at_length_limit = generated_len >= self.max_tokens

        new_running: list[tuple[int, int, float]] = []  # (parent seq, token, cumulative logprob)
        worst_kept = self._worst_kept_score()
        for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_indices.tolist())):
            parent, token = seq_ids[index // vocab], index % vocab
            hits_stop = at_length_limit or (not self.ignore_eos and token in self.eos_token_ids)
            if hits_stop:
                if rank < self.beam_width:
                    penalized = score / (generated_len**self.length_penalty)
                    if len(self.finished) < self.beam_width or penalized > worst_kept:
                        tokens = self.running[parent][0] + [token]
                        self.finished.append(Hypothesis(tokens, penalized, score))
                        self.finished.sort(key=lambda hyp: hyp.score, reverse=True)
                        del self.finished[self.beam_width :]
                        worst_kept = self._worst_kept_score()
            elif len(new_running) < self.beam_width:
                new_running.append((parent, token, score))

        if at_length_limit or not new_running:
            self._finish_all(scheduler)
            return
        # Early stop (HF's default heuristic): the best running beam, penalized at the current
        # length, cannot beat the worst of a full set of finished hypotheses.
        best_running = new_running[0][2] / (generated_len**self.length_penalty)
        if len(self.finished) >= self.beam_width and best_running <= self._worst_kept_score():
            self._finish_all(scheduler)
            return
        self._reassign(new_running, scheduler)

    def _worst_kept_score(self) -> float:
        return self.finished[-1].score if len(self.finished) >= self.beam_width else float("-inf")

    def _reassign(self, new_running: list[tuple[int, int, float]], scheduler) -> None:
        """Maps the chosen continuations onto sequences: the first child of a parent continues the
        parent's sequence, further children fork it, parents without children are freed."""
        children: dict[int, list[tuple[int, float]]] = {}
        for parent, token, score in new_running:
            children.setdefault(parent, []).append((token, score))
        running: dict[int, tuple[list[int], float]] = {}
        for parent, (tokens, _) in self.running.items():
            continuations = children.get(parent)
            if not continuations:
                scheduler.finish_sequence(parent)
                continue
            # Fork before appending so every child starts from the parent's tokens.
            targets = [parent] + [scheduler.fork(parent) for _ in continuations[1:]]
            for seq_id, (token, score) in zip(targets, continuations):
                scheduler.append_token(seq_id, token)
                running[seq_id] = (tokens + [token], score)
        self.running = running

    def _finish_all(self, scheduler) -> None:
        for seq_id in self.running:
            scheduler.finish_sequence(seq_id)
        self.running = {}
        self.done = True

    def outputs(self, tokenizer, skip_special_tokens: bool) -> list[CompletionOutput]:
        best = self.finished[: self.num_outputs]
        return [
            CompletionOutput(
                index=index,
                text=tokenizer.decode(hyp.token_ids, skip_special_tokens=skip_special_tokens),
                token_ids=hyp.token_ids,
                finish_reason="stop" if hyp.token_ids and hyp.token_ids[-1] in self.eos_token_ids else "length",
                cumulative_logprob=hyp.cumulative_logprob,
            )
            for index, hyp in enumerate(best)
        ]


@dataclass
class BeamSearchParams:
    """vLLM's `LLM.beam_search` parameters: `beam_width` beams kept and returned, greedy."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False


@dataclass
class BeamSearchSequence:
    """One returned beam: `tokens` and `text` include the prompt's (as in vLLM)."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: Optional[str]


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first."""

    sequences: list[BeamSearchSequence]

"""Beam search over the paged cache: beams are sequences of one group; a beam with several
surviving continuations is forked (its blocks shared), a beam with none is freed at once. A
step's search says what it wants done (`BeamMoves`); the engine's closing call does it.

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
class BeamMoves:
    """What one beam-search step asks of the scheduler: `appends` (seq_id, token) continue beams
    on their own sequences; `forks` (parent seq_id, token) start beams on copies of a parent as
    it stood before its own token; `finished` sequences end. `beams`: the running beams after the
    step, in order: (seq_id, or None for a fork's child, the index of that fork in `forks`,
    generated tokens, cumulative logprob)."""

    appends: list[tuple[int, int]] = field(default_factory=list)
    forks: list[tuple[int, int]] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    beams: list[tuple[Optional[int], int, list[int], float]] = field(default_factory=list)


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

    def step(self, seq_ids: list[int], logits: torch.Tensor) -> BeamMoves:
        """Advances every running beam by one token. `logits` [len(seq_ids), vocab] are the rows of
        the running beams. Returns the forks, appends and finishes that carry it out (`settle`
        takes the forks' new ids); sets `done` at the end."""
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
            return self._finish_all()
        # Early stop (HF's default heuristic): the best running beam, penalized at the current
        # length, cannot beat the worst of a full set of finished hypotheses.
        best_running = new_running[0][2] / (generated_len**self.length_penalty)
        if len(self.finished) >= self.beam_width and best_running <= self._worst_kept_score():
            return self._finish_all()
        return self._reassign(new_running)

    def _worst_kept_score(self) -> float:
        return self.finished[-1].score if len(self.finished) >= self.beam_width else float("-inf")

    def _reassign(self, new_running: list[tuple[int, int, float]]) -> BeamMoves:
        """Maps the chosen continuations onto sequences: the first child of a parent continues the
        parent's sequence, further children fork it, parents without children are freed."""
        children: dict[int, list[tuple[int, float]]] = {}
        for parent, token, score in new_running:
            children.setdefault(parent, []).append((token, score))
        moves = BeamMoves()
        for parent, (tokens, _) in self.running.items():
            continuations = children.get(parent)
            if not continuations:
                moves.finished.append(parent)
                continue
            (token, score), forked = continuations[0], continuations[1:]
            moves.appends.append((parent, token))
            moves.beams.append((parent, -1, tokens + [token], score))
            for token, score in forked:  # (each child starts from the parent's tokens)
                moves.beams.append((None, len(moves.forks), tokens + [token], score))
                moves.forks.append((parent, token))
        return moves

    def _finish_all(self) -> BeamMoves:
        self.done = True
        return BeamMoves(finished=list(self.running))

    def settle(self, moves: BeamMoves, child_ids: list[int]) -> None:
        """The running beams once `moves` are done: `child_ids[i]` is the sequence of `moves.forks[i]`."""
        self.running = {seq_id if seq_id is not None else child_ids[fork]: (tokens, score)
                        for seq_id, fork, tokens, score in moves.beams}

    def outputs(self, tokenizer, skip_special_tokens: bool) -> list[CompletionOutput]:
        best = self.finished[: self.num_outputs]
        return [
            CompletionOutput(
                index=index,
                text=tokenizer.decode(hyp.token_ids, skip_special_tokens=skip_special_tokens) if tokenizer else "",
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

"""Sampler: logits -> next tokens with temperature, top-k, top-p, min-p, penalties, min_tokens,
per-request seeds and logprobs. Rows with the same settings are processed as one batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedkv.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence to sample for: which logits row, its settings and its history."""

    logits_index: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: Optional[torch.Generator]
    eos_token_ids: frozenset[int]


@dataclass
class SampleResult:
    token_id: int
    logprob: Optional[float]  # under the raw model distribution; None unless the row asked for logprobs
    top_logprobs: Optional[dict[int, float]]


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        """logits [N, vocab] float32; returns one result per row, in order."""
        indices = [row.logits_index for row in rows]
        if logits.shape[0] != len(rows) or indices != list(range(len(rows))):
            logits = logits[torch.tensor(indices, device=logits.device)]
        raw_logits = logits
        # Copy the [N, vocab] logits only when some row changes them (they are large).
        adjusted = [i for i, row in enumerate(rows) if _changes_logits(row)]
        if adjusted:
            logits = logits.clone()
            for i in adjusted:
                self._apply_penalties_and_masks(logits[i], rows[i])

        greedy = [i for i, row in enumerate(rows) if row.params.temperature == 0]
        if len(greedy) == len(rows):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            if greedy:
                index = torch.tensor(greedy, device=logits.device)
                tokens[index] = logits[index].argmax(dim=-1)
            for i, row in enumerate(rows):
                if row.params.temperature != 0:
                    tokens[i] = self._sample_one(logits[i], row)

        # Log-probabilities under the raw model distribution, for the rows that asked (as in
        # vLLM: computing them costs a pass over every row's vocabulary).
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        chosen: list = [None] * len(rows)
        top_logprobs: list = [None] * len(rows)
        if wanted:
            index = torch.tensor(wanted, device=logits.device)
            logprobs = torch.log_softmax(raw_logits[index], dim=-1)
            values = logprobs.gather(1, tokens[index][:, None]).squeeze(1).tolist()
            for j, i in enumerate(wanted):
                chosen[i] = values[j]
                if rows[i].params.logprobs:
                    top_values, top_ids = logprobs[j].topk(rows[i].params.logprobs)
                    top_logprobs[i] = dict(zip(top_ids.tolist(), top_values.tolist()))
        token_list = tokens.tolist()
        results = [SampleResult(token_list[i], chosen[i], top_logprobs[i]) for i in range(len(rows))]
        return results

    @staticmethod
    def _apply_penalties_and_masks(logits: torch.Tensor, row: SamplingRow) -> None:
        params = row.params
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), device=logits.device)
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        if (params.presence_penalty or params.frequency_penalty) and row.output_token_ids:
            ids, counts = torch.tensor(row.output_token_ids, device=logits.device).unique(return_counts=True)
            logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
        if len(row.output_token_ids) < params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(row.eos_token_ids))
            if banned:
                logits[torch.tensor(sorted(banned), device=logits.device)] = float("-inf")

    @staticmethod
    def _sample_one(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
        params = row.params
        logits = logits / params.temperature
        if params.top_k > 0:
            kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.min_p > 0:
            probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=row.generator).squeeze(0)


def _changes_logits(row: SamplingRow) -> bool:
    """Whether `_apply_penalties_and_masks` would change this row's logits."""
    params = row.params
    if params.repetition_penalty != 1.0:
        return True
    if (params.presence_penalty or params.frequency_penalty) and row.output_token_ids:
        return True
    return len(row.output_token_ids) < params.min_tokens and bool(
        params.stop_token_ids or (not params.ignore_eos and row.eos_token_ids)
    )

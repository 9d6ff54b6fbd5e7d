"""What a step asks of the runner for each sequence the scheduler's plan holds: sampling rows
(n > 1 requests add their other samples' rows at their first token), drafts to verify, beams'
logits, pooled vectors, prompt logprobs, adapters. The engine's side of each row (request and
sample) stays with it in `AskedStep` for booking."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedkv.engine.books import Books
from pagedkv.engine.input_processor import InputProcessor
from pagedkv.engine.request_state import RequestState, SequenceState
from pagedkv.runner.sampler import SamplingRow
from pagedkv.runner.step_messages import PromptLogprobsRequest, StepRequests


class PlanColumns:
    """The columns of a plan the engine's books need, as Python lists (read once per step)."""

    def __init__(self, plan):
        self.seq_ids = plan.seq_ids.tolist()
        self.starts = plan.starts.tolist()
        self.samples = plan.samples.tolist()
        self.is_prefill = plan.is_prefill.tolist()


@dataclass
class AskedStep:
    """A step's requests to the runner, with the engine's side of them: the request and sequence
    each sampling row is for, the beams of each beam-search request, and the samples of n > 1
    requests that start this step (child -> the parent whose blocks it forks in the closing call)."""

    requests: StepRequests
    row_targets: list[tuple[RequestState, SequenceState]] = field(default_factory=list)
    beams: dict[str, tuple[RequestState, list[int]]] = field(default_factory=dict)
    fork_parents: dict[int, SequenceState] = field(default_factory=dict)  # by the child's provisional seq id


def sampling_row(request: RequestState, seq: SequenceState, eos_token_ids: frozenset[int]) -> SamplingRow:
    """The sequence's sampling row, made at its first use and kept (what it holds never
    changes: the output list is the sequence's own, growing); the step sets its logits_index."""
    row = seq.sampling_row
    if row is None:
        row = seq.sampling_row = SamplingRow(
            logits_index=0,
            params=request.params,
            prompt_token_ids=request.prompt_token_ids if request.prompt_embeds is None else [],
            output_token_ids=seq.output_token_ids,
            generator=seq.generator,
            eos_token_ids=eos_token_ids,
            matcher=seq.matcher,
            bad_words_token_ids=request.bad_words_token_ids,
        )
    return row


class StepAsker:
    """Builds each step's `AskedStep` from the plan and the books."""

    def __init__(self, books: Books, inputs: InputProcessor, enable_lora: bool):
        self.books = books
        self.inputs = inputs
        self.eos_token_ids = inputs.eos_token_ids
        self.enable_lora = enable_lora

    def ask(self, columns: PlanColumns, touched: dict[str, RequestState], scheduler) -> AskedStep:
        """What this step asks of the runner for each scheduled sequence; n > 1 requests add their
        samples here, before their first token is drawn (they draw it from the parent's row)."""
        books = self.books
        seq_owner = books.seq_owner
        asked = AskedStep(StepRequests())
        requests = asked.requests
        if self.enable_lora:
            requests.loras = {seq_id: seq_owner[seq_id][0].lora for seq_id in columns.seq_ids
                              if seq_owner[seq_id][0].lora is not None}
        rows, row_seq_ids, row_targets = requests.sampling_rows, requests.row_seq_ids, asked.row_targets
        now = time.monotonic()
        row_index = -1  # the sequence's place among the plan's sampling sequences
        for seq_id, start, sample, is_prefill in zip(columns.seq_ids, columns.starts, columns.samples,
                                                     columns.is_prefill):
            row_index += sample
            request, seq = seq_owner[seq_id]
            if is_prefill and request.metrics.first_scheduled_time is None:  # (a request starts with a prefill)
                request.metrics.first_scheduled_time = now
                request.metrics.num_prefix_hit_tokens = start
                books.num_prefix_cache_queried_tokens += len(request.prompt_token_ids)
                books.num_prefix_cache_hit_tokens += start
            if sample:
                touched[request.request_id] = request
            if request.failed:
                continue
            if is_prefill and request.prompt_embeds is not None:
                requests.prompt_embeds[seq_id] = request.prompt_embeds
            row = seq.sampling_row
            if (sample and row is not None and request.forked and request.pooling is None and request.beam_search is None
                    and not seq.draft_token_ids and request.prompt_logprobs is None):
                row.logits_index = row_index  # (the common decode: `_ask_for`'s last lines alone)
                rows.append(row)
                row_seq_ids.append(seq_id)
                row_targets.append((request, seq))
                continue
            if request.needs_prompt_logprobs:
                requests.prompt_logprobs[seq_id] = PromptLogprobsRequest(
                    start, request.prompt_token_ids, len(request.prompt_logprobs), request.params.prompt_logprobs or 0)
            if not sample:
                continue
            try:  # (an error here aborts this request alone)
                self._ask_for(asked, request, seq, is_prefill, row_index)
            except Exception:
                books.fail(request, touched, scheduler)
        return asked

    def _ask_for(self, asked: AskedStep, request: RequestState, seq: SequenceState, is_prefill: bool,
                 row_index: int) -> None:
        """What a sampling sequence needs of the step: its pooled vector, its drafts verified, its
        beams' logits, or samples (of itself and, at its first token, of its n > 1 siblings)."""
        requests, seq_id = asked.requests, seq.seq_id
        if request.pooling is not None:  # its embedding or scores: nothing to sample
            requests.pooling[seq_id] = request.pooling
            return
        if seq.draft_token_ids:
            if not is_prefill:
                requests.drafts[seq_id] = seq.draft_token_ids
                return
            seq.draft_token_ids = []  # a recompute dropped them: sample after the last real token
        if request.beam_search is not None:
            asked.beams.setdefault(request.request_id, (request, []))[1].append(seq_id)
            requests.logits_for.append(seq_id)
            return
        targets = [seq]
        if not request.forked:
            request.forked = True
            targets += self._new_samples(asked, request, seq)
        for target in targets:
            row = sampling_row(request, target, self.eos_token_ids)
            row.logits_index = row_index
            requests.sampling_rows.append(row)
            requests.row_seq_ids.append(target.seq_id)
            asked.row_targets.append((request, target))

    def _new_samples(self, asked: AskedStep, request: RequestState, parent: SequenceState) -> list[SequenceState]:
        """n > 1: the other samples, which fork the parent's blocks in the step's closing call
        (with their first tokens); until then they go by provisional ids."""
        children = []
        for index in range(1, request.params.n):
            child = SequenceState(seq_id=self.books.provisional_seq_id(), index=index,
                                  generator=self.inputs.generator(request.params, index),
                                  matcher=self.inputs.matcher(request.grammar, request.grammar_after))
            request.seqs.append(child)
            self.books.seq_owner[child.seq_id] = (request, child)
            asked.fork_parents[child.seq_id] = parent
            children.append(child)
        return children

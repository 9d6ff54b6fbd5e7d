"""Booking a step's results: prompt logprobs, pooled vectors, verified drafts, sampled tokens and
beams go into the requests' books (stop checks included), and what the scheduler must hear of
them (tokens, drafts, forks, finishes) into the step's one closing call."""

from __future__ import annotations

import itertools
import time
from typing import Optional

from pagedkv.engine.beam_search import BeamMoves
from pagedkv.engine.books import Books
from pagedkv.engine.closing_call import ClosingCall
from pagedkv.engine.drafting import Drafter
from pagedkv.engine.request_state import RequestState, SequenceState
from pagedkv.engine.step_requests import AskedStep
from pagedkv.runner.step_messages import ModelRunnerOutput


class Booking:
    """Books each step's `ModelRunnerOutput` against the `AskedStep` it answers."""

    def __init__(self, books: Books, drafter: Drafter, tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self.books = books
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def apply(self, asked: AskedStep, output: ModelRunnerOutput, touched: dict[str, RequestState], scheduler,
              placeholders: Optional[frozenset[int]] = None) -> None:
        """Books the step's results and closes the step with one scheduler call. `placeholders`:
        an asynchronous step's sequences whose tokens fill placeholders (its others have left the
        scheduler, see `Stepper._hand_over`)."""
        books, seq_owner = self.books, self.books.seq_owner
        for seq_id, error in output.errors.items():
            request = seq_owner[seq_id][0]
            if not request.failed:
                books.fail(request, touched, scheduler, error)
        for seq_id, entries in output.prompt_logprobs.items():
            request = seq_owner[seq_id][0]
            if not request.failed:
                request.prompt_logprobs.extend(entries)
        num_failures = books.num_failures
        closing = ClosingCall()
        for seq_id, vector in output.pooled.items():
            request, seq = seq_owner[seq_id]
            if not request.failed:
                with books.isolated(request, touched, scheduler):
                    request.record_pooled(vector)
                    closing.finish(seq_id)
        for seq_id, tokens in output.accepted_tokens.items():
            request, seq = seq_owner[seq_id]
            if not request.failed:
                with books.isolated(request, touched, scheduler):
                    self._accept_drafts(closing, request, seq, tokens)
        new_samples = self._book_sampled(asked, output, closing, touched, scheduler, placeholders)
        beams = self._step_beams(asked, output, closing, touched, scheduler)

        closing.close(scheduler, books, touched, some_failed=books.num_failures != num_failures)
        for child, fork in new_samples:
            if closing.child_ids[fork] is not None:
                books.rename(child, closing.child_ids[fork])
        for request, moves, first_fork in beams:
            if request.failed:
                continue
            with books.isolated(request, touched, scheduler):
                search = request.beam_search
                search.settle(moves, closing.child_ids[first_fork:first_fork + len(moves.forks)])
                self._sync_beam_sequences(request)
                if search.done:
                    request.final_outputs = search.outputs(self.tokenizer, request.params.skip_special_tokens)

    def _book_sampled(self, asked: AskedStep, output: ModelRunnerOutput, closing: ClosingCall,
                      touched: dict[str, RequestState], scheduler,
                      placeholders: Optional[frozenset[int]]) -> list[tuple[SequenceState, int]]:
        """Books each sampling row's token; returns the new n > 1 samples, each with the index of
        its fork in the closing call."""
        new_samples = []
        fork_parents, drafting = asked.fork_parents, self.drafter.enabled
        tokenizer, eos_token_ids, max_model_len = self.tokenizer, self.eos_token_ids, self.max_model_len
        token_ids, logprobs = output.sampled_token_ids, output.sampled_logprobs
        no_logprobs = (None, None)
        row_logprobs = ([logprobs.get(row, no_logprobs) for row in range(len(token_ids))] if logprobs
                        else itertools.repeat(no_logprobs))
        for (request, seq), token_id, (logprob, top_logprobs) in zip(asked.row_targets, token_ids, row_logprobs):
            if token_id is None or request.failed or seq.finished:  # (finished: ended while the step was in flight)
                continue
            try:  # (an error here aborts this request alone)
                request.record_token(seq, token_id, logprob, top_logprobs, tokenizer, eos_token_ids, max_model_len)
                seq_id = seq.seq_id
                if placeholders is not None:
                    if seq_id in placeholders:
                        closing.fill(seq_id, token_id, seq.finished)
                elif fork_parents and seq_id in fork_parents:
                    new_samples.append((seq, closing.fork(fork_parents[seq_id].seq_id, token_id, seq.finished)))
                elif seq.finished:
                    closing.finish(seq_id)
                elif drafting:
                    seq.draft_token_ids = self.drafter.drafts(request, seq)
                    closing.append(seq_id, token_id, seq.draft_token_ids)
                else:
                    closing.append(seq_id, token_id)
            except Exception:
                self.books.fail(request, touched, scheduler)
        return new_samples

    def _accept_drafts(self, closing: ClosingCall, request: RequestState, seq: SequenceState,
                       tokens: list[int]) -> None:
        """`tokens`: the runner's verdict on the drafts this step computed, the accepted drafts
        then the model's own next token after them."""
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        accepted = len(tokens) - 1
        closing.accept(seq.seq_id, accepted)
        self.books.num_draft_tokens += len(drafts)
        self.books.num_accepted_draft_tokens += accepted
        for token_id in tokens:
            request.record_token(seq, token_id, None, None, self.tokenizer, self.eos_token_ids, self.max_model_len)
            if seq.finished:
                closing.finish(seq.seq_id)
                return
        seq.draft_token_ids = self.drafter.drafts(request, seq)
        closing.append(seq.seq_id, tokens[-1], seq.draft_token_ids)

    def _step_beams(self, asked: AskedStep, output: ModelRunnerOutput, closing: ClosingCall,
                    touched: dict[str, RequestState], scheduler) -> list[tuple[RequestState, BeamMoves, int]]:
        """Advances each beam search by a token; its moves join the closing call. Returns them,
        each with the index of its first fork there."""
        logits_row = {seq_id: row for row, seq_id in enumerate(asked.requests.logits_for)}
        stepped = []
        for request, seq_ids in asked.beams.values():
            if request.failed:
                continue
            with self.books.isolated(request, touched, scheduler):
                moves = request.beam_search.step(seq_ids, output.logits[[logits_row[seq_id] for seq_id in seq_ids]])
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = time.monotonic()
                request.metrics.num_generated_tokens += len(seq_ids)
                first_fork = len(closing.forks)
                for parent, token_id in moves.forks:
                    closing.fork(parent, token_id, False)
                for seq_id, token_id in moves.appends:
                    closing.append(seq_id, token_id)
                for seq_id in moves.finished:
                    closing.finish(seq_id)
                stepped.append((request, moves, first_fork))
        return stepped

    def _sync_beam_sequences(self, request: RequestState) -> None:
        """Beam search creates and frees sequences; keep the seq_id -> request map in step."""
        search, seq_owner = request.beam_search, self.books.seq_owner
        for seq in request.seqs:
            seq_owner.pop(seq.seq_id, None)
        request.seqs = []
        for index, (seq_id, (tokens, score)) in enumerate(search.running.items()):
            seq = SequenceState(seq_id=seq_id, index=index, output_token_ids=tokens, cumulative_logprob=score)
            request.seqs.append(seq)
            seq_owner[seq_id] = (request, seq)

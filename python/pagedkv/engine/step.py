"""The step: the scheduler's plan, what the engine asks of the runner beside it, the runner's
execution, and the booking of its results (closed by one scheduler call). With asynchronous
scheduling a step launches on the device and is booked during the next one."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from pagedkv.engine.books import Books, Output
from pagedkv.engine.booking import Booking
from pagedkv.engine.request_state import RequestState
from pagedkv.engine.step_requests import AskedStep, PlanColumns, StepAsker
from pagedkv.runner.model_runner import ModelRunner
from pagedkv.runner.sampler import all_plain
from pagedkv.runner.step_messages import PendingOutput

logger = logging.getLogger("pagedkv.engine.llm_engine")


@dataclass
class InFlight:
    """A step launched asynchronously, booked during the next one."""

    asked: AskedStep
    output: PendingOutput
    placeholders: frozenset[int] = frozenset()


class Stepper:
    """Runs the engine's steps: schedule -> ask -> runner -> book."""

    def __init__(self, config, runner: ModelRunner, books: Books, asker: StepAsker, booking: Booking,
                 max_model_len: int):
        self.config = config
        self.runner = runner
        self.books = books
        self.asker = asker
        self.booking = booking
        self.max_model_len = max_model_len
        self.in_flight: Optional[InFlight] = None  # an asynchronous step's tokens not yet booked

    def step(self, scheduler) -> list[Output]:
        """Runs one scheduling step and model forward. Returns the (cumulative) output of every
        request that produced tokens or finished in this step."""
        if self.runner.failure is not None:  # (tensor-parallel ranks out of step: no step can run)
            raise self.runner.failure
        books = self.books
        plan = scheduler.schedule()
        touched: dict[str, RequestState] = {}
        if plan.aborted and self.in_flight is not None:
            # (their last tokens may be in flight: booked first, as a synchronous step would have)
            self._book_in_flight(touched, scheduler, gone=frozenset(plan.aborted))
        for request_id, reason in zip(plan.aborted, plan.abort_reasons):
            request = books.requests.get(request_id)
            if request is not None:
                logger.warning("request %s aborted: %s", request_id, reason)
                for seq in request.seqs:
                    seq.finish_reason = seq.finish_reason or "abort"
                if request.beam_search is not None:
                    request.final_outputs = request.beam_search.outputs(books.tokenizer,
                                                                        request.params.skip_special_tokens)
                request.forked = True
                touched[request_id] = request
        for request_id in plan.preempted:
            if request_id in books.requests:
                books.requests[request_id].metrics.num_preemptions += 1
        if plan.num_prefix_hit_tokens:
            logger.debug("prefix cache hit %d tokens", plan.num_prefix_hit_tokens)

        if not plan.is_empty():
            num_samples = int(plan.samples.sum())
            books.iteration_tokens.observe(len(plan.token_ids) - plan.num_decodes + num_samples)
            scheduled: dict[str, RequestState] = {}
            asked = self.asker.ask(PlanColumns(plan), scheduled, scheduler)
            if self._runs_async(plan, asked):
                launched = InFlight(asked, self.runner.execute_async(plan, asked.requests))
                try:
                    self._book_in_flight(touched, scheduler)  # (the step before, while the device runs this one)
                finally:
                    self._hand_over(launched, touched, scheduler)
                # Requests report when their tokens are booked (next step); failed ones now.
                touched.update((request_id, request) for request_id, request in scheduled.items() if request.failed)
            else:
                self._book_in_flight(touched, scheduler)
                touched.update(scheduled)
                self.booking.apply(asked, self.runner.execute(plan, asked.requests), touched, scheduler)
        else:
            self._book_in_flight(touched, scheduler)

        outputs = []
        for request in list(touched.values()):
            if request.params.output_kind == "final_only" and not request.finished:
                continue  # (nothing to report: `Books.output`'s None, without the call)
            try:
                output = books.output(request, scheduler)
            except Exception:
                books.fail(request, touched, scheduler)
                output = books.output(request, scheduler)  # (a failed request's output needs no detokenizing)
            if output is not None:
                outputs.append(output)
        return outputs

    def _runs_async(self, plan, asked: AskedStep) -> bool:
        """Whether this step can run asynchronously (config.async_scheduling): one plain sampling
        row per sampling sequence (`is_plain`: its token needs nothing from the books of the
        step still in flight) and nothing else asked of the step."""
        requests = asked.requests
        return (self.config.async_scheduling and self.runner.workers is None and not self.config.num_speculative_tokens
                and not (asked.beams or requests.drafts or requests.prompt_logprobs or requests.pooling
                         or requests.logits_for)
                and len(requests.sampling_rows) == int(plan.samples.sum())
                and all_plain(requests.sampling_rows))

    def _hand_over(self, launched: InFlight, touched: dict[str, RequestState], scheduler) -> None:
        """After launching a step asynchronously: its sequences get a placeholder for the token
        being sampled, so the next step can be planned now; a sequence for which that token is
        the last by length leaves the scheduler at once (its token is booked all the same). If
        the scheduler refuses the placeholders (a bug), the step is booked now, synchronously."""
        lasting, ending = [], []
        requests = self.books.requests
        for request, seq in launched.asked.row_targets:
            if request.failed or seq.finished or requests.get(request.request_id) is not request:
                continue
            generated = len(seq.output_token_ids) + 1
            ends = (generated >= request.params.max_tokens
                    or len(request.prompt_token_ids) + generated >= self.max_model_len)
            (ending if ends else lasting).append(seq.seq_id)
        self.in_flight = launched
        try:
            scheduler.append_placeholders(lasting)
        except Exception:
            logger.exception("the scheduler refused placeholders; booking the step synchronously")
            self._book_in_flight(touched, scheduler, fill=False)
            return
        launched.placeholders = frozenset(lasting)
        scheduler.update([], [], ending)

    def _book_in_flight(self, touched: dict[str, RequestState], scheduler, fill: bool = True,
                        gone: frozenset[str] = frozenset()) -> None:
        """Books the tokens of the step still in flight, if any (waiting for them), filling in
        their placeholders (`fill=False`: appending them, as a synchronous step does). `gone`:
        requests the scheduler has just dropped: their tokens are booked, nothing is reported."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            return
        placeholders = in_flight.placeholders
        requests = self.books.requests
        for request, seq in in_flight.asked.row_targets:
            if requests.get(request.request_id) is request:  # (not aborted since)
                touched[request.request_id] = request
            if request.request_id in gone:
                placeholders = placeholders - {seq.seq_id}
        self.booking.apply(in_flight.asked, in_flight.output.wait(), touched, scheduler,
                           placeholders if fill else None)

"""The engine's books: its unfinished requests, which request and sample each scheduled sequence
belongs to, the counters `LLMEngine.stats` reports, and the two ways a request leaves them
(finished, or failed in a step: aborted alone while the rest of the batch goes on)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional, Union

from pagedkv.engine.request_state import RequestState, SequenceState
from pagedkv.engine.step_histogram import StepHistogram
from pagedkv.errors import UnknownRequestError
from pagedkv.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput

logger = logging.getLogger("pagedkv.engine.llm_engine")

Output = Union[RequestOutput, PoolingRequestOutput]


class Books:
    """What the engine tracks between steps, beside the scheduler's own books."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.seq_owner: dict[int, tuple[RequestState, SequenceState]] = {}
        self.num_finished_by_reason: dict[str, int] = {}
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, and how many were right
        self.num_accepted_draft_tokens = 0
        # Prompt tokens of started requests, and those of them the prefix cache served (tokens)
        self.num_prefix_cache_queried_tokens = 0
        self.num_prefix_cache_hit_tokens = 0
        self.num_failures = 0  # requests a step aborted alone
        # Tokens per step: prompt tokens computed and tokens sampled (vLLM's iteration tokens)
        self.iteration_tokens = StepHistogram()
        self._num_provisional_ids = 0

    def provisional_seq_id(self) -> int:
        """A negative id for a sample forked at its first token, until the step's closing call
        returns its scheduler id (sampling errors are keyed by the rows' sequence ids)."""
        self._num_provisional_ids += 1
        return -self._num_provisional_ids

    def rename(self, seq: SequenceState, seq_id: int) -> None:
        """Gives a sequence its scheduler id in place of a provisional one."""
        owner = self.seq_owner.pop(seq.seq_id)
        seq.seq_id = seq_id
        self.seq_owner[seq_id] = owner

    def forget(self, request: RequestState) -> None:
        for seq in request.seqs:
            self.seq_owner.pop(seq.seq_id, None)

    def count_finish(self, reason: str) -> None:
        self.num_finished_by_reason[reason] = self.num_finished_by_reason.get(reason, 0) + 1

    def output(self, request: RequestState, scheduler) -> Optional[Output]:
        """What the step reports for a request it advanced (None: nothing, for final_only); a
        finished request leaves the engine."""
        if request.finished:
            output = request.to_output(self.tokenizer)
            self.finish_request(request, output, scheduler)
            return output
        if request.params.output_kind != "final_only":
            return request.to_output(self.tokenizer)  # detokenizes: skipped for final_only
        return None

    def finish_request(self, request: RequestState, output: Output, scheduler) -> None:
        request.metrics.finished_time = time.monotonic()
        self.requests.pop(request.request_id, None)
        self.forget(request)
        # Sequences already finished freed their blocks; this frees any the request still holds.
        try:
            scheduler.abort(request.request_id)
        except UnknownRequestError:
            pass
        if isinstance(output, PoolingRequestOutput):
            self.count_finish("stop")
            return
        for completion in output.outputs:
            self.count_finish(completion.finish_reason or "abort")

    @contextlib.contextmanager
    def isolated(self, request: RequestState, touched: dict[str, RequestState], scheduler):
        """One request's share of the step: an exception in it aborts that request alone."""
        try:
            yield
        except Exception:
            self.fail(request, touched, scheduler)

    def fail(self, request: RequestState, touched: dict[str, RequestState], scheduler,
             error: Optional[BaseException] = None) -> None:
        """Ends a request whose step raised (a bug, or a logits processor that raised): its
        sequences end with finish_reason "abort" and the text they had, its blocks are freed, and
        the rest of the batch goes on."""
        logger.error("request %s failed in a step; aborting it", request.request_id, exc_info=error or True)
        request.failed = True
        self.num_failures += 1
        touched[request.request_id] = request
        try:
            scheduler.abort(request.request_id)
        except UnknownRequestError:
            pass
        request.final_outputs = [
            CompletionOutput(seq.index, seq.text_so_far, list(seq.output_token_ids), seq.finish_reason or "abort",
                             seq.stop_reason)
            for seq in request.seqs
        ]

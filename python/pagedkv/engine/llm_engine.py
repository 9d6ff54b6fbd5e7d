"""LLMEngine: the loop a server drives, and the engine's public face. Its parts, one job each:
the input processor turns requests into sequences (`input_processor.py`), the stepper runs each
step (schedule -> runner -> booking, `step.py`), booking records the results and closes the step
with one scheduler call (`booking.py`, `closing_call.py`). Pooling requests (`PoolingParams`)
ride the same batches and end with their prompt's embedding."""

from __future__ import annotations

import gc
import logging
import time
import weakref
from typing import Optional, Union

from pagedkv_core._core import Scheduler, SchedulerConfig
from pagedkv.config import EngineConfig
from pagedkv.engine.booking import Booking
from pagedkv.engine.books import Books
from pagedkv.engine.drafting import Drafter
from pagedkv.engine.input_processor import InputProcessor, PreparedRequest, prompt_of
from pagedkv.engine.step import Stepper
from pagedkv.engine.step_requests import StepAsker
from pagedkv.errors import DuplicateRequestError, UnknownRequestError
from pagedkv_core.kv_events import ZmqEventPublisher
from pagedkv.outputs import PoolingRequestOutput, RequestOutput
from pagedkv.params.lora_request import LoRARequest
from pagedkv.params.pooling import PoolingParams
from pagedkv.params.sampling import SamplingParams
from pagedkv.runner.host_memory import return_freed_memory
from pagedkv.runner.model_runner import ModelRunner

__all__ = ["LLMEngine", "PreparedRequest", "prompt_of"]

logger = logging.getLogger("pagedkv.engine.llm_engine")

# Rough device speeds for the swap-vs-recompute cost model (see rust/sched/preemption.rs).
_FLOPS = {"cpu": 50e9, "cuda": 200e12}
_SWAP_BANDWIDTH = {"cpu": 5e9, "cuda": 20e9}


class LLMEngine:
    """Continuous-batching engine over a paged KV cache. Not thread-safe: one thread calls
    `add_request`, `step` and `abort`. A context manager: leaving the block (or `shutdown()`, or
    dropping the last reference, or the interpreter's exit) stops its tensor-parallel ranks and
    its event publisher and frees its model and KV cache; another engine can start after it."""

    def __init__(self, config: Optional[EngineConfig] = None, **overrides):
        self.config = config or EngineConfig(**overrides)
        self.runner = ModelRunner(self.config)
        self.kv_events: Optional[ZmqEventPublisher] = None
        # (the finalizer holds what it closes, never the engine: a dropped engine is collected)
        self._closing = _Closing(self.runner)
        self._finalizer = weakref.finalize(self, self._closing)
        try:
            self._build()
        except BaseException:
            self._finalizer()
            raise
        freeze_startup_heap()

    def _build(self) -> None:
        self.model_info = self.runner.info
        self.tokenizer = self.runner.tokenizer
        self.model_name = self.model_info.name
        self.eos_token_ids = self.model_info.eos_token_ids
        # Sampling parameters a request leaves unset take these (the model's generation config)
        self.generation_defaults = self.model_info.generation_defaults
        self.scheduler = Scheduler(self._scheduler_config())
        if self.config.kv_events_endpoint is not None:
            self.kv_events = ZmqEventPublisher(self.config.kv_events_endpoint, self.config.kv_events_replay_endpoint,
                                               self.config.kv_events_topic,
                                               kv_group_windows=self.model_info.kv_group_windows)
            self._closing.publisher = self.kv_events
        self.max_model_len = self.scheduler.max_model_len
        self.books = Books(self.tokenizer)
        self.requests = self.books.requests  # (the books' own dicts, shared: never rebound)
        self.seq_owner = self.books.seq_owner
        self.num_finished_by_reason = self.books.num_finished_by_reason
        self._num_uncached_prompts = 0
        self.input_processor = InputProcessor(self.config, self.model_info, self.tokenizer, self.max_model_len,
                                              self.runner.device)
        drafter = Drafter(self.config, self.books, self.eos_token_ids, self.max_model_len)
        self.stepper = Stepper(self.config, self.runner, self.books,
                               StepAsker(self.books, self.input_processor, self.config.enable_lora),
                               Booking(self.books, drafter, self.tokenizer, self.eos_token_ids, self.max_model_len),
                               self.max_model_len)
        logger.info(
            "engine ready: model=%s device=%s blocks device=%d cpu=%d block_size=%d max_model_len=%d",
            self.model_name,
            self.config.device,
            self.runner.num_device_blocks,
            self.runner.num_cpu_blocks,
            self.config.block_size,
            self.max_model_len,
        )
        if self.model_info.sliding_window:
            logger.info("every layer attends to the last %d positions: blocks before a sequence's window are "
                        "released as it advances", self.model_info.sliding_window)
        elif self.model_info.kv_group_windows:
            logger.info("KV-cache groups of windows %s (0: full attention): a windowed group's blocks before a "
                        "sequence's window are released as it advances", list(self.model_info.kv_group_windows))

    def _scheduler_config(self) -> SchedulerConfig:
        config, runner = self.config, self.runner
        device = "cuda" if str(config.device).startswith("cuda") else "cpu"
        max_model_len = self.model_info.max_model_len
        max_num_batched_tokens = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        return SchedulerConfig(
            block_size=config.block_size,
            num_device_blocks=runner.num_device_blocks,
            num_cpu_blocks=runner.num_cpu_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            max_waiting_requests=config.max_waiting_requests,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_cpu_prefix_cache=config.enable_cpu_prefix_cache,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            sliding_window=self.model_info.sliding_window,
            kv_group_windows=list(self.model_info.kv_group_windows),
            prefix_caching_hash_seed=config.resolved_prefix_caching_hash_seed(),
            enable_kv_events=config.kv_events_endpoint is not None,
            preemption_mode=config.preemption_mode,
            scheduling_policy=config.scheduling_policy,
            watermark=config.watermark,
            recompute_cost_per_token=2.0 * self.model_info.num_parameters / _FLOPS[device],
            block_bytes=float(runner.block_bytes),
            swap_bandwidth=_SWAP_BANDWIDTH[device],
        )

    def shutdown(self) -> None:
        """Publishes the last KV events, stops the event publisher and the other tensor-parallel
        ranks, and frees the model and the KV cache. Idempotent; the engine steps no more after it."""
        if self._finalizer.alive and self.kv_events is not None:
            self._publish_kv_events()
        self._finalizer()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # -- requests --------------------------------------------------------------------------
    # -- requests --------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams samples with: pagedkv's defaults, overridden by the
        model's generation config (EngineConfig.generation_config)."""
        return SamplingParams(**self.generation_defaults)

    def add_request(
        self,
        request_id: str,
        prompt: Union[str, list[int], dict],
        params: Optional[Union[SamplingParams, PoolingParams]] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        lora_request: Optional[LoRARequest] = None,
    ) -> None:
        """Queues a request for a prompt (text, token ids, or vLLM's {"prompt": ...} /
        {"prompt_token_ids": ...} dicts): generation with `SamplingParams`, or the prompt's embedding with
        `PoolingParams` (one `EmbeddingRequestOutput` or `ClassificationRequestOutput` when done). `priority`
        (scheduling_policy="priority" only): smaller is served first and preempted last.
        `lora_request` (enable_lora=True): the adapter to run with, loaded on first use. Raises
        PromptTooLongError (naming the limit), OverloadedError (waiting queue full: retry later),
        DuplicateRequestError, InvalidConfigError (an adapter this model cannot run) or ValueError;
        a request that raises leaves the engine as it was."""
        self.add_prepared(self.prepare_request(request_id, prompt, params, arrival_time, priority, lora_request))

    def prepare_request(
        self,
        request_id: str,
        prompt: Union[str, list[int], dict],
        params: Optional[Union[SamplingParams, PoolingParams]] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        lora_request: Optional[LoRARequest] = None,
    ) -> PreparedRequest:
        """The checking and building half of `add_request` (tokenizing, grammar compiling, seeded
        generators), which raises as it does; `add_prepared` queues the result. It touches neither
        the scheduler nor the engine's books, so any thread may call it while the engine steps
        (servers run it on a worker pool, off the event loop and the step thread)."""
        return self.input_processor.prepare(request_id, prompt, params, arrival_time, priority, lora_request)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queues a request `prepare_request` built (the engine's thread only). Raises
        DuplicateRequestError, OverloadedError, PromptTooLongError or an adapter's error, and then
        leaves the engine as it was."""
        request = prepared.state
        request_id = request.request_id
        if request_id in self.requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        request.lora = self._lora_adapter(prepared.lora_request)
        extra_key = prepared.extra_key
        if request.params.prompt_logprobs is not None:
            # Every prompt token must be computed to be scored: a key of its own keeps the prefix
            # cache from serving this prompt (a recompute after preemption still reuses its blocks).
            self._num_uncached_prompts += 1
            extra_key = (1 << 63) | self._num_uncached_prompts
        seq_id = self.scheduler.add_request(request_id, request.prompt_token_ids, extra_key, prepared.priority)
        try:
            first = request.seqs[0]
            first.seq_id = seq_id
            if request.beam_search is not None:
                request.beam_search.running[seq_id] = ([], 0.0)
            self.requests[request_id] = request
            self.seq_owner[seq_id] = (request, first)
        except BaseException:  # (nothing above should fail; if it does, no half-registered request stays)
            self.requests.pop(request_id, None)
            self.seq_owner.pop(seq_id, None)
            self.scheduler.abort(request_id)
            raise

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Loads an adapter now (requests naming it load it on first use otherwise); raises as
        `add_request` does for a bad one."""
        self._lora_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unloads an adapter (requests running with it finish with it); False if not loaded."""
        registry = self.runner.lora_registry
        return registry is not None and registry.adapters.pop(lora_int_id, None) is not None

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded so far."""
        registry = self.runner.lora_registry
        return [adapter.request for adapter in registry.adapters.values()] if registry else []

    def _lora_adapter(self, lora_request: Optional[LoRARequest]):
        if lora_request is None:
            return None
        if self.runner.lora_registry is None:
            raise ValueError("lora_request needs an engine built with enable_lora=True")
        return self.runner.lora_registry.get(lora_request)

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Drops a request and frees its blocks at once. Returns its last output, with
        finish_reason "abort" on the sequences still running; None for unknown or finished ids."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        try:
            self.scheduler.abort(request_id)
        except UnknownRequestError:
            pass
        self.books.forget(request)
        self.books.count_finish("abort")
        for seq in request.seqs:
            seq.finish_reason = seq.finish_reason or "abort"
        request.forked = True  # (n > 1 before its first token: the one sequence stands for all)
        request.metrics.finished_time = time.monotonic()
        return request.to_output(self.tokenizer)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix, device and CPU tier (vLLM's, for after a weight update:
        cached K/V would no longer match the model). Returns False, changing nothing, while
        requests are unfinished."""
        if not self.scheduler.reset_prefix_cache():
            logger.warning("prefix cache not reset: %d requests are unfinished", len(self.requests))
            return False
        logger.info("prefix cache reset")
        self._publish_kv_events()
        return True

    def _publish_kv_events(self) -> None:
        """Hands the KV-cache events since the last call to the publisher, as one batch."""
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.take_kv_events())

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- the step --------------------------------------------------------------------------
    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        """Runs one scheduling step and model forward. Returns the (cumulative) output of every
        request that produced tokens or finished in this step."""
        outputs = self.stepper.step(self.scheduler)
        self._publish_kv_events()
        return outputs

    def stats(self) -> dict:
        """Scheduler and pool gauges and counters (see `Scheduler.stats`) plus finish counts."""
        stats = dict(self.scheduler.stats())
        stats["num_unfinished_requests"] = len(self.requests)
        books = self.books
        stats["num_draft_tokens"] = books.num_draft_tokens
        stats["num_accepted_draft_tokens"] = books.num_accepted_draft_tokens
        stats["prefix_cache_queried_tokens"] = books.num_prefix_cache_queried_tokens
        stats["prefix_cache_hit_tokens"] = books.num_prefix_cache_hit_tokens
        stats["iteration_tokens"] = books.iteration_tokens.snapshot()
        stats["finished_by_reason"] = dict(self.num_finished_by_reason)
        stats["num_loaded_loras"] = len(self.list_loras())
        lora_requests: dict[str, int] = {}
        for request in self.requests.values():
            if request.lora is not None:
                name = request.lora.request.lora_name
                lora_requests[name] = lora_requests.get(name, 0) + 1
        stats["lora_requests"] = lora_requests  # unfinished requests by adapter name
        return stats


def freeze_startup_heap() -> None:
    """Moves what the process holds once an engine is built (torch's, transformers', the
    tokenizer's and the engine's: ~400k objects) out of the cyclic garbage collector's reach, as
    vLLM does with its startup heap: a full collection scanned all of it (~0.2 s on the embedded
    model's CPU host, a decode step's time 25 times over) whenever one came due mid-generation.
    An engine's shutdown (or drop) thaws it again, so what it leaves is collected. Then the heap
    the load freed (its transient tensors and parses: ~35 MB for the embedded model) goes back to
    the system, where the C library can say so (glibc's malloc_trim)."""
    gc.collect()
    gc.freeze()
    return_freed_memory()


class _Closing:
    """What shutting an engine down closes: its event publisher, then its runner (the ranks, the
    model, the KV cache). Held by the engine's finalizer, so it must not hold the engine."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.publisher: Optional[ZmqEventPublisher] = None

    def __call__(self) -> None:
        try:
            if self.publisher is not None:
                self.publisher.shutdown()
        finally:
            try:
                self.runner.shutdown()
            finally:
                gc.unfreeze()  # (see freeze_startup_heap)

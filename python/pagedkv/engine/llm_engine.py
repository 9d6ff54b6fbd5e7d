"""LLMEngine: the loop a server drives. Each step asks the Rust scheduler for a plan, runs the model
on it, samples, and reports the tokens back (forking samples and beams, freeing finished ones).
Pooling requests (`PoolingParams`) ride the same batches and end with their prompt's embedding."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from pagedkv_core._core import Scheduler, SchedulerConfig
from pagedkv.engine.beam_search import BeamSearch
from pagedkv.config import EngineConfig
from pagedkv.errors import DuplicateRequestError, PromptTooLongError, UnknownRequestError
from pagedkv_core.kv_events import ZmqEventPublisher
from pagedkv.runner.sampler import SamplingRow, all_plain, changes_logits
from pagedkv.runner.step_messages import ModelRunnerOutput, PendingOutput, PromptLogprobsRequest, StepRequests
from pagedkv.params.lora_request import LoRARequest
from pagedkv.runner.model_runner import ModelRunner
from pagedkv.engine.ngram_proposer import propose_ngram_drafts
from pagedkv.outputs import CompletionOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from pagedkv.params.pooling import PoolingParams
from pagedkv.engine.request_state import RequestState, SequenceState
from pagedkv.params.sampling import SamplingParams, check_unicode
from pagedkv.params.structured_output import GrammarCompiler

logger = logging.getLogger("pagedkv.engine.llm_engine")

# Rough device speeds for the swap-vs-recompute cost model (see rust/sched/preemption.rs).
_FLOPS = {"cpu": 50e9, "cuda": 200e12}
_SWAP_BANDWIDTH = {"cpu": 5e9, "cuda": 20e9}


@dataclass
class PreparedRequest:
    """A request `LLMEngine.prepare_request` checked and built, not yet queued: what could fail
    (tokenizing, grammar compiling, seeded generators) is done."""

    state: RequestState
    priority: int
    lora_request: Optional[LoRARequest]
    extra_key: Optional[int]  # prefix-cache key of its cache salt and adapter, else None


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
                                               self.config.kv_events_topic)
            self._closing.publisher = self.kv_events
        self.max_model_len = self.scheduler.max_model_len
        self.requests: dict[str, RequestState] = {}
        self._in_flight: Optional[_InFlight] = None  # an asynchronous step's tokens not yet booked
        self.seq_owner: dict[int, tuple[RequestState, SequenceState]] = {}
        self.num_finished_by_reason: dict[str, int] = {}
        self._num_uncached_prompts = 0
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, and how many were right
        self.num_accepted_draft_tokens = 0
        # Prompt tokens of started requests, and those of them the prefix cache served (tokens)
        self.num_prefix_cache_queried_tokens = 0
        self.num_prefix_cache_hit_tokens = 0
        self._grammar_compiler: Optional[GrammarCompiler] = None  # built at the first structured-output request
        self._grammar_compiler_lock = threading.Lock()
        # Longer prompt texts are refused before tokenizing: they cannot fit in max_model_len.
        self._max_prompt_chars = 2 * self.max_model_len * longest_token_chars(self.tokenizer)
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
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None and pooling.task == "classify" and not self.model_info.is_classifier:
            raise ValueError("task='classify' needs a sequence-classification checkpoint (*ForSequenceClassification, "
                             "with a score head); this model generates text")
        if pooling is None and self.model_info.is_classifier:
            raise ValueError("this model is a sequence classifier (*ForSequenceClassification): it does not generate "
                             "text; classify prompts with LLM.classify or the server's /classify")
        if pooling is not None:  # computed like a one-token greedy request, reported only at the end
            params = SamplingParams(temperature=0.0, max_tokens=1, output_kind="final_only")
        params = params or self.get_default_sampling_params()
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority must be 0 unless scheduling_policy is 'priority' (got {priority}; "
                             f"this engine runs {self.config.scheduling_policy!r})")
        vocab_size = self.model_info.vocab_size
        prompt = prompt_of(prompt)
        if isinstance(prompt, str):
            if params.truncate_prompt_tokens is None and len(prompt) > self._max_prompt_chars:
                raise PromptTooLongError(
                    f"prompt of {len(prompt)} characters exceeds max_model_len={self.max_model_len} tokens: no "
                    f"{self.max_model_len} tokens of this tokenizer span more than {self._max_prompt_chars} characters")
            prompt_text, prompt_token_ids = prompt, self._tokenize(prompt, "prompt")
        else:
            prompt_text, prompt_token_ids = None, list(prompt)
            if not prompt_token_ids or any(not 0 <= int(t) < vocab_size for t in prompt_token_ids):
                raise ValueError(f"prompt token ids must be a non-empty list of ints in [0, {vocab_size})")
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            if len(prompt_token_ids) > keep:  # (the text reported is what was kept)
                prompt_token_ids = prompt_token_ids[-keep:]
                prompt_text = None if prompt_text is None else self.tokenizer.decode(prompt_token_ids)
        token_id_fields = (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids),
                           ("allowed_token_ids", params.allowed_token_ids or ()))
        for name, token_ids in token_id_fields:
            if any(token_id >= vocab_size for token_id in token_ids):
                raise ValueError(f"{name} names token ids outside the vocabulary [0, {vocab_size})")
        if params.num_sequences > self.config.max_num_seqs:
            raise ValueError(f"n / beam_width={params.num_sequences} exceeds max_num_seqs={self.config.max_num_seqs}")
        params.check_logprobs(self.config.max_logprobs, vocab_size)
        grammar = self._compiled_grammar(params)  # (an invalid schema or grammar raises here, before queueing)
        first = SequenceState(seq_id=-1, index=0, generator=self._generator(params, 0),
                              matcher=self._grammar_compiler.matcher(grammar) if grammar is not None else None)
        metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic(), num_prompt_tokens=len(prompt_token_ids))
        request = RequestState(request_id, prompt_text, prompt_token_ids, params, metrics, [first], pooling=pooling,
                               bad_words_token_ids=self._bad_words_token_ids(params.bad_words), grammar=grammar)
        request.allow_plain_booking(self.eos_token_ids, self.max_model_len)
        if params.use_beam_search:
            request.beam_search = BeamSearch(
                beam_width=params.beam_width,
                num_outputs=params.n,
                max_tokens=min(params.max_tokens, self.max_model_len - len(prompt_token_ids)),
                length_penalty=params.length_penalty,
                eos_token_ids=self.eos_token_ids,
                ignore_eos=params.ignore_eos,
            )
        extra_key = None
        if params.cache_salt is not None or lora_request is not None:
            # An adapter changes every layer's K/V: its prompts get prefix-cache keys of their own.
            # (Top bit clear: never one of the unique keys of add_prepared.)
            adapter = f"\0lora:{lora_request.lora_int_id}:{lora_request.lora_path}" if lora_request else ""
            salt = (params.cache_salt or "") + adapter
            digest = hashlib.blake2b(salt.encode(), digest_size=8).digest()
            extra_key = int.from_bytes(digest, "little") & ((1 << 63) - 1)
        return PreparedRequest(request, priority, lora_request, extra_key)

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

    def _tokenize(self, text: str, field: str) -> list[int]:
        """The token ids of request text; ValueError naming `field` for text that is not valid
        Unicode (a lone surrogate, which JSON allows): the tokenizer would raise a TypeError."""
        check_unicode(text, field)
        return self.tokenizer.encode(text)

    def _bad_words_token_ids(self, bad_words: Optional[list[str]]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as the model writes it: alone and after a space (vLLM's two spellings)."""
        spellings = set()
        for word in bad_words or ():
            for text in (word.lstrip(), " " + word.lstrip()):
                token_ids = self.tokenizer.encode(text, add_special_tokens=False)
                if token_ids:
                    spellings.add(tuple(token_ids))
        return tuple(sorted(spellings))

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

    def _compiled_grammar(self, params: SamplingParams):
        """The compiled constraint of a structured-output request, else None (any thread)."""
        if params.structured_outputs is None:
            return None
        with self._grammar_compiler_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_info.vocab_size, self.eos_token_ids,
                                                         self.config.max_cached_grammars)
        return self._grammar_compiler.compile(params.structured_outputs)

    def _generator(self, params: SamplingParams, index: int) -> Optional[torch.Generator]:
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.runner.device)
        # Each sample's stream from one 64-bit seed (torch takes seeds in [0, 2**64)).
        generator.manual_seed((params.seed * 1_000_003 + index) % (1 << 64))
        return generator

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
        self._forget(request)
        self._count_finish("abort")
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
    def step(self) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        """Runs one scheduling step and model forward. Returns the (cumulative) output of every
        request that produced tokens or finished in this step."""
        if self.runner.failure is not None:  # (tensor-parallel ranks out of step: no step can run)
            raise self.runner.failure
        plan = self.scheduler.schedule()
        touched: dict[str, RequestState] = {}
        if plan.aborted and self._in_flight is not None:
            # (their last tokens may be in flight: booked first, as a synchronous step would have)
            self._book_in_flight(touched, gone=frozenset(plan.aborted))
        for request_id, reason in zip(plan.aborted, plan.abort_reasons):
            request = self.requests.get(request_id)
            if request is not None:
                logger.warning("request %s aborted: %s", request_id, reason)
                for seq in request.seqs:
                    seq.finish_reason = seq.finish_reason or "abort"
                if request.beam_search is not None:
                    request.final_outputs = request.beam_search.outputs(self.tokenizer, request.params.skip_special_tokens)
                request.forked = True
                touched[request_id] = request
        for request_id in plan.preempted:
            if request_id in self.requests:
                self.requests[request_id].metrics.num_preemptions += 1
        if plan.num_prefix_hit_tokens:
            logger.debug("prefix cache hit %d tokens", plan.num_prefix_hit_tokens)

        if not plan.is_empty():
            step = _Step(plan)
            scheduled: dict[str, RequestState] = {}
            asked = self._step_requests(step, scheduled)
            if self._runs_async(plan, asked):
                launched = _InFlight(asked, self.runner.execute_async(plan, asked.requests))
                try:
                    self._book_in_flight(touched)  # (the step before, while the device runs this one)
                finally:
                    self._hand_over(launched, touched)
                # Requests report when their tokens are booked (next step); failed ones now.
                touched.update((request_id, request) for request_id, request in scheduled.items() if request.failed)
            else:
                self._book_in_flight(touched)
                touched.update(scheduled)
                self._apply(asked, self.runner.execute(plan, asked.requests), touched)
        else:
            self._book_in_flight(touched)

        outputs = []
        for request in list(touched.values()):
            if request.params.output_kind == "final_only" and not request.finished:
                continue  # (nothing to report: `_output`'s None, without the call)
            try:
                output = self._output(request)
            except Exception:
                self._fail(request, touched)
                output = self._output(request)  # (a failed request's output needs no detokenizing)
            if output is not None:
                outputs.append(output)
        self._publish_kv_events()
        return outputs

    def _runs_async(self, plan, asked: _Asked) -> bool:
        """Whether this step can run asynchronously (config.async_scheduling): one plain sampling
        row per sampling sequence (`is_plain`: its token needs nothing from the books of the
        step still in flight) and nothing else asked of the step."""
        requests = asked.requests
        return (self.config.async_scheduling and self.runner.workers is None and not self.config.num_speculative_tokens
                and not (asked.beams or requests.drafts or requests.prompt_logprobs or requests.pooling
                         or requests.logits_for)
                and len(requests.sampling_rows) == int(plan.samples.sum())
                and all_plain(requests.sampling_rows))

    def _hand_over(self, launched: _InFlight, touched: dict[str, RequestState]) -> None:
        """After launching a step asynchronously: its sequences get a placeholder for the token
        being sampled, so the next step can be planned now; a sequence for which that token is
        the last by length leaves the scheduler at once (its token is booked all the same). If
        the scheduler refuses the placeholders (a bug), the step is booked now, synchronously."""
        lasting, ending = [], []
        for request, seq in launched.asked.row_targets:
            if request.failed or seq.finished or self.requests.get(request.request_id) is not request:
                continue
            generated = len(seq.output_token_ids) + 1
            ends = (generated >= request.params.max_tokens
                    or len(request.prompt_token_ids) + generated >= self.max_model_len)
            (ending if ends else lasting).append(seq.seq_id)
        self._in_flight = launched
        try:
            self.scheduler.append_placeholders(lasting)
        except Exception:
            logger.exception("the scheduler refused placeholders; booking the step synchronously")
            self._book_in_flight(touched, fill=False)
            return
        launched.placeholders = frozenset(lasting)
        self.scheduler.update([], [], ending)

    def _book_in_flight(self, touched: dict[str, RequestState], fill: bool = True,
                        gone: frozenset[str] = frozenset()) -> None:
        """Books the tokens of the step still in flight, if any (waiting for them), filling in
        their placeholders (`fill=False`: appending them, as a synchronous step does). `gone`:
        requests the scheduler has just dropped: their tokens are booked, nothing is reported."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        placeholders = in_flight.placeholders
        for request, seq in in_flight.asked.row_targets:
            if self.requests.get(request.request_id) is request:  # (not aborted since)
                touched[request.request_id] = request
            if request.request_id in gone:
                placeholders = placeholders - {seq.seq_id}
        self._apply(in_flight.asked, in_flight.output.wait(), touched, placeholders if fill else None)

    def _output(self, request: RequestState) -> Optional[Union[RequestOutput, PoolingRequestOutput]]:
        """What the step reports for a request it advanced (None: nothing, for final_only); a
        finished request leaves the engine."""
        if request.finished:
            output = request.to_output(self.tokenizer)
            self._finish_request(request, output)
            return output
        if request.params.output_kind != "final_only":
            return request.to_output(self.tokenizer)  # detokenizes: skipped for final_only
        return None

    @contextlib.contextmanager
    def _isolated(self, request: RequestState, touched: dict[str, RequestState]):
        """One request's share of the step: an exception in it aborts that request alone."""
        try:
            yield
        except Exception:
            self._fail(request, touched)

    def _fail(self, request: RequestState, touched: dict[str, RequestState],
              error: Optional[BaseException] = None) -> None:
        """Ends a request whose step raised (a bug, or a logits processor that raised): its
        sequences end with finish_reason "abort" and the text they had, its blocks are freed, and
        the rest of the batch goes on."""
        logger.error("request %s failed in a step; aborting it", request.request_id, exc_info=error or True)
        request.failed = True
        touched[request.request_id] = request
        try:
            self.scheduler.abort(request.request_id)
        except UnknownRequestError:
            pass
        request.final_outputs = [
            CompletionOutput(seq.index, seq.text_so_far, list(seq.output_token_ids), seq.finish_reason or "abort",
                             seq.stop_reason)
            for seq in request.seqs
        ]

    def _step_requests(self, step: _Step, touched: dict[str, RequestState]) -> _Asked:
        """What this step asks of the runner for each scheduled sequence; n > 1 requests fork
        their samples here, before their first token is drawn (they draw it from the parent's row)."""
        asked = _Asked(StepRequests())
        requests = asked.requests
        if self.config.enable_lora:
            requests.loras = {seq_id: self.seq_owner[seq_id][0].lora for seq_id in step.seq_ids
                              if self.seq_owner[seq_id][0].lora is not None}
        rows, row_seq_ids, row_targets = requests.sampling_rows, requests.row_seq_ids, asked.row_targets
        now = time.monotonic()
        row_index = -1  # the sequence's place among the plan's sampling sequences
        for seq_id, start, sample, is_prefill in zip(step.seq_ids, step.starts, step.samples, step.is_prefill):
            row_index += sample
            request, seq = self.seq_owner[seq_id]
            if is_prefill and request.metrics.first_scheduled_time is None:  # (a request starts with a prefill)
                request.metrics.first_scheduled_time = now
                request.metrics.num_prefix_hit_tokens = start
                self.num_prefix_cache_queried_tokens += len(request.prompt_token_ids)
                self.num_prefix_cache_hit_tokens += start
            if sample:
                touched[request.request_id] = request
            if request.failed:
                continue
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
                self._fail(request, touched)
        return asked

    def _ask_for(self, asked: _Asked, request: RequestState, seq: SequenceState, is_prefill: bool,
                 row_index: int) -> None:
        """What a sampling sequence needs of the step: its pooled vector, its drafts verified, its
        beams' logits, or samples (of itself and, at its first token, of its n > 1 forks)."""
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
            targets += self._fork_samples(request, seq)
        for target in targets:
            row = self._sampling_row(request, target)
            row.logits_index = row_index
            requests.sampling_rows.append(row)
            requests.row_seq_ids.append(target.seq_id)
            asked.row_targets.append((request, target))

    def _apply(self, asked: _Asked, output: ModelRunnerOutput, touched: dict[str, RequestState],
               placeholders: Optional[frozenset[int]] = None) -> None:
        """Books the step's results: prompt logprobs, pooled vectors, verified drafts, sampled
        tokens (reported to the scheduler in one closing call), beams. `placeholders`: an
        asynchronous step's sequences whose tokens fill placeholders (its others have left the
        scheduler, see `_hand_over`)."""
        for seq_id, error in output.errors.items():
            request = self.seq_owner[seq_id][0]
            if not request.failed:
                self._fail(request, touched, error)
        for seq_id, entries in output.prompt_logprobs.items():
            request = self.seq_owner[seq_id][0]
            if not request.failed:
                request.prompt_logprobs.extend(entries)
        for seq_id, vector in output.pooled.items():
            request, seq = self.seq_owner[seq_id]
            if not request.failed:
                with self._isolated(request, touched):
                    request.record_pooled(vector)
                    self.scheduler.finish_sequence(seq_id)
        for seq_id, tokens in output.accepted_tokens.items():
            request, seq = self.seq_owner[seq_id]
            if not request.failed:
                with self._isolated(request, touched):
                    self._accept_drafts(request, seq, tokens)

        closing = _ClosingCall()
        speculating = self.config.num_speculative_tokens > 0
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
                if placeholders is not None:
                    if seq.seq_id in placeholders:
                        closing.fill(seq.seq_id, token_id, seq.finished)
                elif seq.finished:
                    closing.finish(seq.seq_id)
                elif speculating and self._speculates(request, seq):
                    self._append_token(request, seq, token_id)
                else:
                    closing.append(seq.seq_id, token_id)
            except Exception:
                self._fail(request, touched)
        self._close_step(closing, touched)

        logits_row = {seq_id: row for row, seq_id in enumerate(asked.requests.logits_for)}
        for request, seq_ids in asked.beams.values():
            if request.failed:
                continue
            with self._isolated(request, touched):
                search = request.beam_search
                search.step(seq_ids, output.logits[[logits_row[seq_id] for seq_id in seq_ids]], self.scheduler)
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = time.monotonic()
                request.metrics.num_generated_tokens += len(seq_ids)
                self._sync_beam_sequences(request)
                if search.done:
                    request.final_outputs = search.outputs(self.tokenizer, request.params.skip_special_tokens)

    def _close_step(self, closing: _ClosingCall, touched: dict[str, RequestState]) -> None:
        """Reports the step's plain appends and finishes to the scheduler in one call; if that
        raises (it then changes nothing), one by one, so only the failing request is aborted."""
        filled = False
        try:
            if closing.fill_ids:
                self.scheduler.fill_placeholders(closing.fill_ids, closing.fill_tokens)
                filled = True
            self.scheduler.update(closing.seq_ids, closing.token_ids, closing.finished)
            return
        except Exception:
            logger.warning("closing the step in one call failed; reporting its sequences one by one")
        for request, seq_id, token_id, fill in closing.each(self.seq_owner):
            if request.failed:
                continue
            with self._isolated(request, touched):
                if fill and not filled:
                    self.scheduler.fill_placeholders([seq_id], [token_id])
                if token_id is None or (fill and seq_id in closing.finished):
                    self.scheduler.finish_sequence(seq_id)
                elif not fill:
                    self.scheduler.append_token(seq_id, token_id)

    def _append_token(self, request: RequestState, seq: SequenceState, token_id: int) -> None:
        """Reports the next token to the scheduler, with prompt-lookup drafts after it when the
        request speculates (the next step computes them together and verifies the drafts)."""
        drafts: list[int] = []
        if self._speculates(request, seq):
            generated = len(seq.output_token_ids)
            room = min(self.config.num_speculative_tokens, request.params.max_tokens - generated - 1,
                       self.max_model_len - len(request.prompt_token_ids) - generated - 1)
            drafts = propose_ngram_drafts(request.prompt_token_ids + seq.output_token_ids, room,
                                          self.config.prompt_lookup_max, self.config.prompt_lookup_min)
        self.scheduler.append_token(seq.seq_id, token_id, drafts)
        seq.draft_token_ids = drafts

    def _speculates(self, request: RequestState, seq: SequenceState) -> bool:
        """Greedy requests whose next token is the plain argmax (no penalties, biases, grammars
        or minimum length in force) and that report no logprobs, while the engine is not busy:
        verifying a draft is then one comparison, and the output is what decoding one token at a
        time gives (exactly, in float32; bfloat16 rounds the multi-token pass differently)."""
        params, config = request.params, self.config
        busy = config.speculative_disable_by_batch_size is not None and len(self.requests) >= config.speculative_disable_by_batch_size
        return (config.num_speculative_tokens > 0 and not busy and params.temperature == 0 and params.n == 1
                and request.beam_search is None and params.logprobs is None
                and not changes_logits(self._sampling_row(request, seq)))

    def _accept_drafts(self, request: RequestState, seq: SequenceState, tokens: list[int]) -> None:
        """`tokens`: the runner's verdict on the drafts this step computed, the accepted drafts
        then the model's own next token after them."""
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        accepted = len(tokens) - 1
        self.scheduler.accept_drafts(seq.seq_id, accepted)
        self.num_draft_tokens += len(drafts)
        self.num_accepted_draft_tokens += accepted
        for token_id in tokens:
            request.record_token(seq, token_id, None, None, self.tokenizer, self.eos_token_ids, self.max_model_len)
            if seq.finished:
                self.scheduler.finish_sequence(seq.seq_id)
                return
        self._append_token(request, seq, tokens[-1])

    def _fork_samples(self, request: RequestState, parent: SequenceState) -> list[SequenceState]:
        """n > 1: the other samples fork the prompt's blocks right after its prefill."""
        children = []
        for index in range(1, request.params.n):
            child_id = self.scheduler.fork(parent.seq_id)
            matcher = self._grammar_compiler.matcher(request.grammar) if request.grammar is not None else None
            child = SequenceState(seq_id=child_id, index=index, generator=self._generator(request.params, index),
                                  matcher=matcher)
            request.seqs.append(child)
            self.seq_owner[child_id] = (request, child)
            children.append(child)
        return children

    def _sampling_row(self, request: RequestState, seq: SequenceState) -> SamplingRow:
        """The sequence's sampling row, made at its first use and kept (what it holds never
        changes: the output list is the sequence's own, growing); the step sets its logits_index."""
        row = seq.sampling_row
        if row is None:
            row = seq.sampling_row = SamplingRow(
                logits_index=0,
                params=request.params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=seq.output_token_ids,
                generator=seq.generator,
                eos_token_ids=self.eos_token_ids,
                matcher=seq.matcher,
                bad_words_token_ids=request.bad_words_token_ids,
            )
        return row

    def _sync_beam_sequences(self, request: RequestState) -> None:
        """Beam search creates and frees sequences; keep the seq_id -> request map in step."""
        search = request.beam_search
        for seq in request.seqs:
            self.seq_owner.pop(seq.seq_id, None)
        request.seqs = []
        for index, (seq_id, (tokens, score)) in enumerate(search.running.items()):
            seq = SequenceState(seq_id=seq_id, index=index, output_token_ids=tokens, cumulative_logprob=score)
            request.seqs.append(seq)
            self.seq_owner[seq_id] = (request, seq)

    def _finish_request(self, request: RequestState, output: RequestOutput) -> None:
        request.metrics.finished_time = time.monotonic()
        self.requests.pop(request.request_id, None)
        self._forget(request)
        # Sequences already finished freed their blocks; this frees any the request still holds.
        try:
            self.scheduler.abort(request.request_id)
        except UnknownRequestError:
            pass
        if isinstance(output, PoolingRequestOutput):
            self._count_finish("stop")
            return
        for completion in output.outputs:
            self._count_finish(completion.finish_reason or "abort")

    def _forget(self, request: RequestState) -> None:
        for seq in request.seqs:
            self.seq_owner.pop(seq.seq_id, None)

    def _count_finish(self, reason: str) -> None:
        self.num_finished_by_reason[reason] = self.num_finished_by_reason.get(reason, 0) + 1

    def stats(self) -> dict:
        """Scheduler and pool gauges and counters (see `Scheduler.stats`) plus finish counts."""
        stats = dict(self.scheduler.stats())
        stats["num_unfinished_requests"] = len(self.requests)
        stats["num_draft_tokens"] = self.num_draft_tokens
        stats["num_accepted_draft_tokens"] = self.num_accepted_draft_tokens
        stats["prefix_cache_queried_tokens"] = self.num_prefix_cache_queried_tokens
        stats["prefix_cache_hit_tokens"] = self.num_prefix_cache_hit_tokens
        stats["finished_by_reason"] = dict(self.num_finished_by_reason)
        stats["num_loaded_loras"] = len(self.list_loras())
        lora_requests: dict[str, int] = {}
        for request in self.requests.values():
            if request.lora is not None:
                name = request.lora.request.lora_name
                lora_requests[name] = lora_requests.get(name, 0) + 1
        stats["lora_requests"] = lora_requests  # unfinished requests by adapter name
        return stats


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
            self.runner.shutdown()


def prompt_of(prompt) -> Union[str, list[int]]:
    """Text or token ids from vLLM's prompt dicts ({"prompt": ...} or {"prompt_token_ids": ...})."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    return prompt


def longest_token_chars(tokenizer) -> int:
    """Characters of the tokenizer's longest token (as its vocabulary spells it, which is never
    shorter than the text it stands for): a text of c characters has at least c / this tokens."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


class _Step:
    """The columns of a plan the engine's books need, as Python lists (read once per step)."""

    def __init__(self, plan):
        self.seq_ids = plan.seq_ids.tolist()
        self.starts = plan.starts.tolist()
        self.samples = plan.samples.tolist()
        self.is_prefill = plan.is_prefill.tolist()


@dataclass
class _InFlight:
    """A step launched asynchronously, booked during the next one."""

    asked: _Asked
    output: PendingOutput
    placeholders: frozenset[int] = frozenset()


@dataclass
class _Asked:
    """A step's requests to the runner, with the engine's side of them: the request and sequence
    each sampling row is for, and the beams of each beam-search request."""

    requests: StepRequests
    row_targets: list[tuple[RequestState, SequenceState]] = field(default_factory=list)
    beams: dict[str, tuple[RequestState, list[int]]] = field(default_factory=dict)


class _ClosingCall:
    """A step's plain appends (sampled token, no drafts) and finished sequences, reported to the
    scheduler together (`Scheduler.update`)."""

    def __init__(self):
        self.seq_ids: list[int] = []  # appended to, with token_ids
        self.token_ids: list[int] = []
        self.finished: list[int] = []
        self.fill_ids: list[int] = []  # an asynchronous step's: placeholders filled in
        self.fill_tokens: list[int] = []

    def append(self, seq_id: int, token_id: int) -> None:
        self.seq_ids.append(seq_id)
        self.token_ids.append(token_id)

    def finish(self, seq_id: int) -> None:
        self.finished.append(seq_id)

    def fill(self, seq_id: int, token_id: int, finished: bool) -> None:
        """The token for a sequence's placeholder; `finished`: the sequence ends with it."""
        self.fill_ids.append(seq_id)
        self.fill_tokens.append(token_id)
        if finished:
            self.finished.append(seq_id)

    def each(self, seq_owner: dict):
        """(request, seq_id, token_id or None for a finish, whether it fills a placeholder): the
        appends, the placeholders filled, then the other finishes (each sequence once)."""
        filled = set(self.fill_ids)
        reports = itertools.chain(zip(self.seq_ids, self.token_ids, itertools.repeat(False)),
                                  zip(self.fill_ids, self.fill_tokens, itertools.repeat(True)),
                                  ((seq_id, None, False) for seq_id in self.finished if seq_id not in filled))
        for seq_id, token_id, fill in reports:
            owner = seq_owner.get(seq_id)
            if owner is not None:
                yield owner[0], seq_id, token_id, fill

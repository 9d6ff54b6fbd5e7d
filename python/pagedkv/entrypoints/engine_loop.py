"""One background thread owns the engine and steps it; AsyncLLM (its only client: the HTTP
server is built on it) talks to it through a thread-safe command queue and receives outputs on
asyncio queues. Requests from all callers are batched together by the scheduler (continuous
batching). The heavy half of admitting a request (tokenizing, grammar compiling) runs on a small
worker pool, so neither the event loop nor the stepping thread waits for a megabyte prompt."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Union

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.errors import EngineStoppedError, OverloadedError, TensorParallelError
from pagedkv.params.lora_request import LoRARequest
from pagedkv.outputs import PoolingRequestOutput, RequestOutput
from pagedkv.params.pooling import PoolingParams
from pagedkv.params.sampling import SamplingParams

logger = logging.getLogger("pagedkv.entrypoints.server")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    delta: bool = False  # its outputs hold only what is new (output_kind "delta")
    last_token_time: Optional[float] = None
    num_tokens: int = 0  # generated so far, over every sample


class EngineLoop:
    """Drives `engine.step()` in a thread. `submit_all` and `abort` may be called from any thread."""

    def __init__(self, engine: LLMEngine, metrics=None, num_workers: int = 2):
        self.engine = engine
        self.metrics = metrics
        self._workers = ThreadPoolExecutor(num_workers, thread_name_prefix="pagedkv-worker")
        # Jobs on the worker pool, queued or running, bounded as the scheduler's waiting queue is.
        self._num_worker_jobs = 0
        self._max_worker_jobs = engine.config.max_waiting_requests
        self.stats: dict = engine.stats()  # snapshot for /metrics, refreshed by the loop thread
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stopping = threading.Event()
        self._closed = False  # set (under _lock) once the thread takes no more commands
        self._lock = threading.Lock()  # (guards _closed and _num_worker_jobs)
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        # What ended the loop for good (a tensor-parallel rank lost, a bug outside a step), else None
        self.failure: Optional[BaseException] = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts what is still in flight and joins the thread."""
        self._stopping.set()
        self._commands.put(("wake",))
        if threading.current_thread() is not self._thread:  # (a finalizer may run on the loop's own thread)
            self._thread.join(timeout)
        self._workers.shutdown(wait=False, cancel_futures=True)

    async def run_in_worker(self, function, *args):
        """`function(*args)` on the worker pool (CPU-heavy request work: tokenizing, chat
        templates), so the event loop keeps answering meanwhile. Raises OverloadedError, as a
        full waiting queue does, when max_waiting_requests jobs are already queued or running."""
        with self._lock:
            self._check_open()
            if self._num_worker_jobs >= self._max_worker_jobs:
                raise OverloadedError(f"the request-preparation queue is full (max_waiting_requests="
                                      f"{self._max_worker_jobs} jobs); retry later")
            self._num_worker_jobs += 1
        job = self._workers.submit(function, *args)
        job.add_done_callback(self._release_worker_slot)  # (also when cancelled before it ran)
        return await asyncio.wrap_future(job)

    def _release_worker_slot(self, _job) -> None:
        with self._lock:
            self._num_worker_jobs -= 1

    async def submit_all(
        self, requests: list[tuple[str, object]], params: Union[SamplingParams, PoolingParams], priority: int = 0,
        lora_request: Optional[LoRARequest] = None, check_context_room: bool = False,
    ) -> list[asyncio.Queue]:
        """Queues (request_id, prompt) pairs all or none: if one is refused, none runs and its
        error (what `engine.add_request` raises: PromptTooLongError, ...) is raised. One output
        queue per request. `check_context_room`: a prompt that leaves less room than max_tokens
        is refused too (SamplingParams.check_context_room)."""
        loop = asyncio.get_running_loop()
        self._check_open()
        max_waiting = self.engine.config.max_waiting_requests
        if len(requests) > max_waiting:  # (all or none: such a batch would be refused forever, not "later")
            raise ValueError(f"a batch of {len(requests)} prompts can never be queued at once: "
                             f"max_waiting_requests={max_waiting}")

        def prepare(request_id: str, prompt):
            request = self.engine.prepare_request(request_id, prompt, params, priority=priority,
                                                  lora_request=lora_request)
            if check_context_room:
                params.check_context_room(len(request.state.prompt_token_ids), self.engine.max_model_len)
            return request

        prepared = await self.run_in_worker(lambda: [prepare(request_id, prompt) for request_id, prompt in requests])
        accepted = loop.create_future()
        delta = getattr(params, "output_kind", None) == "delta"
        streams = [(request, _Stream(loop, asyncio.Queue(), delta)) for request in prepared]
        with self._lock:
            self._check_open()
            self._commands.put(("add", streams, accepted))
        await accepted
        return [stream.outputs for _, stream in streams]

    def _check_open(self) -> None:
        if self._closed or self._stopping.is_set():
            raise EngineStoppedError("the engine loop has stopped")

    async def call(self, function):
        """`function(engine)` run on the loop thread between steps (the engine is not
        thread-safe); returns its result or raises its exception."""
        done = asyncio.get_running_loop().create_future()
        with self._lock:
            self._check_open()
            self._commands.put(("call", function, done))
        return await done

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """Aborts every request in flight (from any thread): each stream ends with an output
        whose unfinished sequences have finish_reason "abort"."""
        self._commands.put(("abort_all",))

    @property
    def alive(self) -> bool:
        """Whether the loop thread is stepping (False once stopped, or if it died)."""
        return self._thread.is_alive() and not self._stopping.is_set() and not self._closed

    def _run(self) -> None:
        try:
            self._step_until_stopped()
        except Exception as error:  # fail every caller rather than leave them waiting
            self.failure = error
            if isinstance(error, TensorParallelError):
                logger.error("the engine cannot go on: %s", error)
            else:  # (a bug outside a step)
                logger.exception("the engine loop crashed")
        finally:
            self._close()

    def _step_until_stopped(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            idle = not engine.has_unfinished_requests()
            self._drain_commands(block=idle)
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except TensorParallelError:  # the ranks are out of step: no step can run again
                raise
            except Exception:  # never let one bad step kill the server
                logger.exception("engine step failed; aborting in-flight requests")
                for request_id in list(self._streams):
                    self._finish_stream(request_id, RuntimeError("internal engine error"))
                continue
            self.stats = engine.stats()  # (before delivering: a client that got a token sees its step in /metrics)
            for output in outputs:
                self._deliver(output)

    def _close(self) -> None:
        with self._lock:
            self._closed = True
        while True:  # requests submitted while stopping are refused, not left waiting
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] in ("add", "call"):
                accepted = command[-1]
                accepted.get_loop().call_soon_threadsafe(
                    _set_exception, accepted, EngineStoppedError("the engine loop has stopped"))
        for request_id in list(self._streams):
            self._finish_stream(request_id, EngineStoppedError("server shutting down" if self.failure is None
                                                               else f"the engine stopped: {self.failure}"))
        self.stats = self.engine.stats()
        self.engine.shutdown()

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, command) -> None:
        kind = command[0]
        if kind == "add":
            _, streams, accepted = command
            added: list[str] = []
            try:
                for prepared, _ in streams:
                    self.engine.add_prepared(prepared)
                    added.append(prepared.state.request_id)
            except Exception as error:  # handed back to the HTTP handler, which maps it to a status
                for request_id in added:  # (no step ran in between: they never started)
                    self.engine.abort(request_id)
                accepted.get_loop().call_soon_threadsafe(_set_exception, accepted, error)
                return
            for prepared, stream in streams:
                self._streams[prepared.state.request_id] = stream
            accepted.get_loop().call_soon_threadsafe(_set_result, accepted)
        elif kind == "call":
            _, function, done = command
            try:
                result = function(self.engine)
            except Exception as error:
                done.get_loop().call_soon_threadsafe(_set_exception, done, error)
            else:
                done.get_loop().call_soon_threadsafe(_set_value, done, result)
            self.stats = self.engine.stats()
        elif kind in ("abort", "abort_all"):
            for request_id in command[1:] if kind == "abort" else list(self._streams):
                output = self.engine.abort(request_id)
                if output is not None:
                    self._deliver(output)  # the stream ends with finish_reason "abort"
                self._streams.pop(request_id, None)
            self.stats = self.engine.stats()

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if self.metrics is not None and isinstance(output, PoolingRequestOutput):
            self.metrics.observe_finished(output)
        elif self.metrics is not None:
            now = time.monotonic()
            num_tokens = sum(len(completion.token_ids) for completion in output.outputs)
            if stream.delta:  # (counted across the outputs)
                num_tokens += stream.num_tokens
            if stream.num_tokens == 0 and num_tokens and output.metrics.time_to_first_token is not None:
                self.metrics.observe_first_token(output.metrics.time_to_first_token)
                timing = output.metrics
                if output.finished and num_tokens > 1 and timing.finished_time is not None:
                    # (a reply delivered whole: its tokens' intervals are known only in sum, so each
                    # counts as their mean, as a client that streamed it would have seen on average)
                    mean = (timing.finished_time - timing.first_token_time) / (num_tokens - 1)
                    self.metrics.observe_inter_token(mean, num_tokens - 1)
            elif num_tokens > stream.num_tokens and stream.last_token_time is not None:
                self.metrics.observe_inter_token((now - stream.last_token_time) / (num_tokens - stream.num_tokens))
            stream.last_token_time, stream.num_tokens = now, num_tokens
            if output.finished:
                self.metrics.observe_finished(output, num_tokens)
        stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, output)
        if output.finished:
            self._streams.pop(output.request_id, None)

    def _finish_stream(self, request_id: str, error: Exception) -> None:
        self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, error)


def _set_result(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _set_value(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)

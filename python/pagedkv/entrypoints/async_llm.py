"""AsyncLLM: the engine for asyncio programs (the shape of vLLM's AsyncLLMEngine), and the one
client of the engine loop: the OpenAI server is built on it."""

from __future__ import annotations

import asyncio
import itertools
import weakref
from typing import AsyncIterator, Callable, Optional, TypeVar, Union

from pagedkv.config import engine_config
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.entrypoints.engine_loop import EngineLoop
from pagedkv.errors import EngineStoppedError
from pagedkv.params.lora_request import LoRARequest
from pagedkv.outputs import ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from pagedkv.params.pooling import PoolingParams
from pagedkv.params.sampling import SamplingParams

Result = TypeVar("Result")


class RequestStream:
    """One queued request's outputs in the order the engine loop delivers them (cumulative, or
    each what is new for output_kind="delta"), the last one `finished`."""

    def __init__(self, request_id: str, outputs: asyncio.Queue):
        self.request_id = request_id
        # True once the last output came, or an error ended the request (the loop dropped it then)
        self.finished = False
        self._outputs = outputs

    async def next(self) -> Union[RequestOutput, PoolingRequestOutput]:
        """The next output. Raises what ended the request instead: EngineStoppedError (a shutdown,
        or an engine that cannot go on), or the error of a step that failed."""
        item = await self._outputs.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


class AsyncLLM:
    """LLMEngine stepped on a background thread; `generate` streams one request's outputs while
    the requests of every task are batched together (continuous batching).

    ```python
    async with AsyncLLM(dtype="float32") as llm:
        async for output in llm.generate("Hello", SamplingParams(max_tokens=16)):
            print(output.outputs[0].text)
    ```

    Arguments are those of `LLM` (a model path and EngineConfig fields), or `engine=` an
    existing LLMEngine, which then belongs to the loop thread. `metrics` (the server's
    ServerMetrics) observes each output as it is delivered.
    """

    def __init__(self, model: Optional[str] = None, *, engine: Optional[LLMEngine] = None, metrics=None,
                 **engine_options):
        if engine is not None and (model is not None or engine_options):
            raise TypeError("pass either engine= or a model and engine options, not both")
        self.engine = engine or LLMEngine(engine_config(model, engine_options))
        self.tokenizer = self.engine.tokenizer
        self._loop = EngineLoop(self.engine, metrics)
        self._ids = itertools.count()
        self._loop.start()
        # Dropping the AsyncLLM stops its loop (which shuts the engine down); the loop holds no
        # reference back to it.
        self._finalizer = weakref.finalize(self, self._loop.stop)

    async def generate(
        self,
        prompt: Union[str, list[int]],
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        priority: int = 0,
        lora_request: Optional[LoRARequest] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queues a request and yields its cumulative output after every step that advanced it,
        the last one with `finished`. Raises what `LLMEngine.add_request` raises on the first
        iteration (PromptTooLongError, OverloadedError, ...). Leaving early (break, cancel, or
        `aclose()`) aborts the request and frees its blocks. `priority`, `lora_request`: see
        `LLMEngine.add_request`."""
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        [stream] = await self.add_requests([(request_id, prompt)],
                                           sampling_params or self.engine.get_default_sampling_params(), priority,
                                           lora_request)
        try:
            while not stream.finished:
                try:
                    output = await stream.next()
                except Exception as error:
                    raise EngineStoppedError(f"request {request_id}: {error}") from error
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def encode(
        self,
        prompt: Union[str, list[int]],
        pooling_params: Optional[PoolingParams] = None,
        request_id: Optional[str] = None,
        priority: int = 0,
        lora_request: Optional[LoRARequest] = None,
    ) -> Union[EmbeddingRequestOutput, ClassificationRequestOutput]:
        """The prompt's embedding (`output.outputs.embedding`), or with
        `PoolingParams(task="classify")` its class probabilities (`output.outputs.probs`), batched
        with everything else."""
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        [stream] = await self.add_requests([(request_id, prompt)], pooling_params or PoolingParams(), priority,
                                           lora_request)
        try:
            return await stream.next()
        except Exception as error:
            raise EngineStoppedError(f"request {request_id}: {error}") from error
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def add_requests(
        self, requests: list[tuple[str, Union[str, list[int]]]], params: Union[SamplingParams, PoolingParams],
        priority: int = 0, lora_request: Optional[LoRARequest] = None, check_context_room: bool = False,
    ) -> list[RequestStream]:
        """Queues (request_id, prompt) pairs with the same params, all or none: if the engine
        refuses one (PromptTooLongError, OverloadedError, a ValueError naming a field, ...), none
        runs and that error is raised. `check_context_room`: a prompt that leaves less room than
        max_tokens is refused too. The caller aborts the requests whose stream it leaves
        unfinished."""
        queues = await self._loop.submit_all(requests, params, priority, lora_request, check_context_room)
        return [RequestStream(request_id, queue) for (request_id, _), queue in zip(requests, queues)]

    async def run_in_worker(self, function: Callable[..., Result], *args) -> Result:
        """`function(*args)` on the pool that prepares requests (chat templates, tokenizing), so
        the event loop keeps answering meanwhile. Raises OverloadedError when that pool's queue
        is full (max_waiting_requests jobs), EngineStoppedError after shutdown."""
        return await self._loop.run_in_worker(function, *args)

    async def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False (nothing done) while requests are unfinished."""
        return await self._loop.call(lambda engine: engine.reset_prefix_cache())

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Loads an adapter (see `LLMEngine.add_lora`), between steps."""
        await self._loop.call(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unloads an adapter (see `LLMEngine.remove_lora`), between steps."""
        return await self._loop.call(lambda engine: engine.remove_lora(lora_int_id))

    def abort(self, request_id: str) -> None:
        """Drops a request (from any thread) and frees its blocks; its `generate` stream ends with
        an output whose unfinished sequences have finish_reason "abort"."""
        self._loop.abort(request_id)

    def abort_all(self) -> None:
        """Aborts every request in flight (from any thread), as `abort` does each."""
        self._loop.abort_all()

    @property
    def is_running(self) -> bool:
        """Whether the engine loop is stepping (False after shutdown, or if the loop crashed)."""
        return self._loop.alive

    @property
    def failure(self) -> Optional[BaseException]:
        """What stopped the engine loop for good (a tensor-parallel rank lost, a bug outside a
        step), else None."""
        return self._loop.failure

    def stats(self) -> dict:
        """The engine's gauges and counters as of its last step (see `LLMEngine.stats`)."""
        return dict(self._loop.stats)

    def shutdown(self) -> None:
        """Stops the loop thread and shuts the engine down; requests still running end with
        EngineStoppedError. Idempotent."""
        self._finalizer()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.shutdown()

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

"""AsyncLLM: the engine for asyncio programs (the shape of vLLM's AsyncLLMEngine)."""

from __future__ import annotations

import itertools
from typing import AsyncIterator, Optional, Union

from pagedkv.config import engine_config
from pagedkv.engine import LLMEngine
from pagedkv.engine_loop import EngineLoop
from pagedkv.errors import EngineStoppedError
from pagedkv.lora import LoRARequest
from pagedkv.outputs import ClassificationRequestOutput, EmbeddingRequestOutput, RequestOutput
from pagedkv.pooling_params import PoolingParams
from pagedkv.sampling_params import SamplingParams


class AsyncLLM:
    """LLMEngine stepped on a background thread; `generate` streams one request's outputs while
    the requests of every task are batched together (continuous batching).

    ```python
    async with AsyncLLM(dtype="float32") as llm:
        async for output in llm.generate("Hello", SamplingParams(max_tokens=16)):
            print(output.outputs[0].text)
    ```

    Arguments are those of `LLM` (a model path and EngineConfig fields), or `engine=` an
    existing LLMEngine, which then belongs to the loop thread.
    """

    def __init__(self, model: Optional[str] = None, *, engine: Optional[LLMEngine] = None, **engine_options):
        if engine is not None and (model is not None or engine_options):
            raise TypeError("pass either engine= or a model and engine options, not both")
        self.engine = engine or LLMEngine(engine_config(model, engine_options))
        self.tokenizer = self.engine.tokenizer
        self._loop = EngineLoop(self.engine)
        self._ids = itertools.count()
        self._loop.start()

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
        [outputs] = await self._loop.submit_all([(request_id, prompt)], sampling_params or self.engine.get_default_sampling_params(), priority,
                                                lora_request)
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, Exception):
                    finished = True  # the loop already dropped it
                    raise EngineStoppedError(f"request {request_id}: {item}")
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._loop.abort(request_id)

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
        [outputs] = await self._loop.submit_all([(request_id, prompt)], pooling_params or PoolingParams(), priority,
                                                lora_request)
        try:
            item = await outputs.get()
        except BaseException:
            self._loop.abort(request_id)
            raise
        if isinstance(item, Exception):
            raise EngineStoppedError(f"request {request_id}: {item}")
        return item

    def abort(self, request_id: str) -> None:
        """Drops a request (from any thread) and frees its blocks; its `generate` stream ends with
        an output whose unfinished sequences have finish_reason "abort"."""
        self._loop.abort(request_id)

    @property
    def is_running(self) -> bool:
        """Whether the engine loop is stepping (False after shutdown, or if the loop crashed)."""
        return self._loop.alive

    def stats(self) -> dict:
        """The engine's gauges and counters as of its last step (see `LLMEngine.stats`)."""
        return dict(self._loop.stats)

    def shutdown(self) -> None:
        """Stops the loop thread; requests still running end with EngineStoppedError."""
        self._loop.stop()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.shutdown()

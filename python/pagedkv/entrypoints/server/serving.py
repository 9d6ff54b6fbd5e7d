"""The serving context every route works through (vLLM's serving classes over an EngineClient,
in one object): the engine client (AsyncLLM, started with the app), the served names (the base
model and its LoRA adapters) with their response builders, the model's facts, the server's
options (chat template, tool-call and reasoning parsers) and metrics; and the life of the engine
requests an HTTP request makes: queued all or none, streamed or awaited, and aborted when the
client leaves (`aborting_unfinished`, the one place the server aborts them)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import threading
from typing import AsyncIterator, Callable, Optional, TypeVar, Union

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedkv.entrypoints.async_llm import AsyncLLM, RequestStream
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.errors import EngineStoppedError, OverloadedError
from pagedkv.params.lora_request import LoRARequest
from pagedkv.params.structured_output import AfterReasoning, ReasoningEnd
from pagedkv.outputs import PoolingRequestOutput, RequestOutput
from pagedkv.entrypoints.server.errors import APIError, submit_error
from pagedkv.entrypoints.server.metrics import ServerMetrics
from pagedkv.entrypoints.server.reasoning import END as THINK_END
from pagedkv.entrypoints.server.reasoning import START as THINK_START
from pagedkv.entrypoints.server.reasoning import ReasoningParser
from pagedkv.entrypoints.server.reasoning_tokens import ReasoningMarkers, count_reasoning_tokens
from pagedkv.entrypoints.server.sagemaker_sessions import SessionStore
from pagedkv.entrypoints.server.thinking_budget import budget_processor
from pagedkv.entrypoints.server.responses import ResponseBuilder
from pagedkv.entrypoints.server.responses_store import ResponseStore
from pagedkv.entrypoints.server.tools import PARSERS as TOOL_CALL_PARSERS
from pagedkv.entrypoints.server.tools import ToolCalling

logger = logging.getLogger("pagedkv.entrypoints.server")

Params = TypeVar("Params")


class ServingContext:
    """One per app (`app.state.serving`; routes take it with `Depends(serving)`). Built around an
    engine that `start` hands to the engine client, the only caller of the engine from then on."""

    def __init__(self, engine: LLMEngine, served_model_name: Optional[str] = None, chat_template: Optional[str] = None,
                 lora_modules: Optional[dict[str, Union[str, dict]]] = None, reasoning_parser: Optional[str] = None,
                 tool_call_parser: str = "hermes", force_include_usage: bool = False,
                 prompt_tokens_details: bool = False, per_request_metrics: bool = False,
                 tokens_as_ids: bool = False):
        if tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {tool_call_parser!r}")
        self.model_name = served_model_name or engine.model_name
        # (vLLM's card `root`: the checkpoint the model was loaded from; the embedded model's file name)
        self.model_root = engine.config.model or engine.model_name
        modules = {name: module if isinstance(module, dict) else {"path": module}
                   for name, module in (lora_modules or {}).items()}
        self.adapters = {name: LoRARequest(name, index + 1, module["path"])
                         for index, (name, module) in enumerate(modules.items())}
        # (vLLM's card `parent`: the base model, as the module names it or as served)
        self.adapter_parents = {name: module.get("base_model_name") or self.model_name
                                for name, module in modules.items()}
        if self.model_name in self.adapters:
            raise ValueError(f"LoRA module name {self.model_name!r} is the base model's served name")
        for adapter in self.adapters.values():
            engine.add_lora(adapter)
        # Runtime loads (/v1/load_lora_adapter) one at a time, with ids never used before (an
        # unloaded adapter's may still name it in requests running).
        self.adapter_updates = asyncio.Lock()
        self.adapter_ids = itertools.count(len(self.adapters) + 1)  # (a bad adapter stops the server from starting, not a request)
        self.chat_template = chat_template
        self.force_include_usage = force_include_usage  # (--enable-force-include-usage: usage in every chunk, as vLLM)
        self.tool_call_parser = tool_call_parser
        self.reasoning = ReasoningParser(reasoning_parser) if reasoning_parser else None
        self.tokenizer = engine.tokenizer
        self.reasoning_markers = (ReasoningMarkers.of(self.tokenizer)
                                  if self.reasoning is not None and self.tokenizer is not None else None)
        # The model's facts the routes need, read once here (the engine then belongs to the loop thread).
        self.model_info = engine.model_info
        self.max_model_len = engine.max_model_len
        # (a text longer than this cannot fit max_model_len: refused before it is tokenized)
        self.max_prompt_chars = engine.input_processor.max_prompt_chars
        self.generation_defaults = engine.generation_defaults
        self.supports_lora = engine.config.enable_lora
        self.prompt_tokens_details = prompt_tokens_details  # (--enable-prompt-tokens-details, as vLLM)
        self.per_request_metrics = per_request_metrics  # (--enable-per-request-metrics, as vLLM)
        self.tokens_as_ids = tokens_as_ids  # (--return-tokens-as-token-ids, as vLLM: every request's logprobs)
        self.decision_label_ids: Optional[list[int]] = None
        self.trust_request_chat_template = False  # (--trust-request-chat-template: requests may bring their own)
        # (vLLM's --structured-outputs-config.enable_in_reasoning: grammars constrain the reasoning too)
        self.structured_outputs_in_reasoning = False
        self.sagemaker_sessions: Optional[SessionStore] = None  # (SageMaker's stateful sessions, where enabled)  # (/v1/decisions: found at its first request)
        self.builders = {name: self.builder(name) for name in (self.model_name, *self.adapters)}
        stats = engine.stats()
        cache_config = {"block_size": engine.config.block_size, "num_gpu_blocks": stats["num_device_blocks"],
                        "num_cpu_blocks": stats["num_cpu_blocks"], "cache_dtype": engine.config.kv_cache_dtype,
                        "enable_prefix_caching": engine.config.enable_prefix_caching,
                        # (vLLM's: the tokens the device pool holds, and how many max_model_len requests fit it)
                        "kv_cache_size_tokens": stats["num_device_blocks"] * engine.config.block_size,
                        "kv_cache_max_concurrency": round(stats["num_device_blocks"] * engine.config.block_size
                                                          / self.max_model_len, 2)}
        self.responses_store = ResponseStore()  # (/v1/responses with store)
        self.metrics = ServerMetrics(lambda: self.client.stats() if self.client is not None else {}, self.model_name,
                                     self.max_model_len, cache_config)
        self.draining = False
        self.client: Optional[AsyncLLM] = None  # (from `start` to `stop`)
        self._engine: Optional[LLMEngine] = engine

    # -- life --------------------------------------------------------------------------------
    def builder(self, name: str) -> ResponseBuilder:
        """The replies' builder for served model `name` (the base model or an adapter)."""
        return ResponseBuilder(self.tokenizer, name, self.reasoning, self.prompt_tokens_details,
                               self.per_request_metrics)

    def start(self) -> None:
        """Starts the engine client (its loop thread steps the engine from now on)."""
        self.client = AsyncLLM(engine=self._engine, metrics=self.metrics)
        self._engine = None

    def stop(self) -> Optional[BaseException]:
        """Stops the engine client; returns what had stopped it for good (see `failure`), if anything."""
        client, self.client = self.client, None
        client.shutdown()
        self.builders.clear()  # (they hold the tokenizer)
        return client.failure

    @property
    def failure(self) -> Optional[BaseException]:
        """What stopped the engine for good while serving (a tensor-parallel rank lost), else None."""
        return self.client.failure if self.client is not None else None

    def text_tokenizer(self):
        """The tokenizer, or vLLM's 400 where the engine has none (--skip-tokenizer-init): text in or
        out needs one."""
        if self.tokenizer is None:
            raise APIError(400, "Tokenizer not available when `skip_tokenizer_init=True`", "invalid_request_error",
                           "skip_tokenizer_init")
        return self.tokenizer

    def check_text_fits(self, text: str, field: str) -> None:
        """A 400 for a text longer than max_model_len tokens of this tokenizer can span (refused
        before it is tokenized or rendered)."""
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"{field}: {len(text)} characters are more than max_model_len={self.max_model_len} "
                           f"tokens of this tokenizer can span ({self.max_prompt_chars})", "invalid_request_error",
                           field, "context_length_exceeded")

    def drain(self, grace_seconds: float) -> None:
        """Starts a graceful shutdown (serve calls it at SIGTERM): the requests still running
        after `grace_seconds` are aborted; their streams end with finish_reason "abort" and
        [DONE], their non-streamed answers are a 503 error."""
        self.draining = True

        def abort_all() -> None:
            client = self.client
            if client is not None:
                client.abort_all()

        timer = threading.Timer(grace_seconds, abort_all)
        timer.daemon = True
        timer.start()

    # -- what a request asks for ---------------------------------------------------------------
    def check_model(self, name: Optional[str]) -> str:
        """The served name a request asked for (the base model's by default)."""
        if name is None or name == self.model_name:
            return self.model_name
        if name in self.adapters:
            return name
        served = ", ".join(repr(known) for known in (self.model_name, *self.adapters))
        raise APIError(404, f"model {name!r} does not exist; this server serves {served}",
                       "invalid_request_error", "model", "model_not_found")

    async def chat_prompt(self, messages, add_generation_prompt: bool, tools=None, template_kwargs=None,
                          continue_final_message: bool = False, embeds_marker: str = "",
                          chat_template: Optional[str] = None) -> str:
        """The prompt text, rendered on the worker pool (megabytes of messages or thousands of
        tools take seconds); `template_kwargs` reach the template as variables (e.g. Qwen3's
        enable_thinking); `continue_final_message`: the prompt ends inside the last message;
        prompt_embeds parts rendered as `embeds_marker`; `chat_template`: a request's own template
        in place of the server's (see `request_chat_template`)."""
        tokenizer = self.text_tokenizer()
        turns = [message.template_fields(embeds_marker) for message in messages]
        kwargs = dict(template_kwargs or {})
        template = self.request_chat_template(chat_template, kwargs.pop("chat_template", None)) or self.chat_template
        try:
            return await self.client.run_in_worker(lambda: tokenizer.apply_chat_template(
                turns, tools=tools, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **kwargs))
        except OverloadedError:
            raise
        except Exception as error:
            raise APIError(400, f"messages: cannot apply the chat template: {error}", "invalid_request_error", "messages")

    def request_chat_template(self, *given: Optional[str]) -> Optional[str]:
        """A request's own chat template (its `chat_template`, or one in `chat_template_kwargs`):
        a 400 unless the server trusts them (--trust-request-chat-template, as vLLM: a template
        is Jinja that runs on the server)."""
        template = next((value for value in given if value is not None), None)
        if template is not None and not self.trust_request_chat_template:
            raise APIError(400, "Chat template is passed with request, but --trust-request-chat-template is not set. "
                                "Refused request with untrusted chat template.", "invalid_request_error", "chat_template")
        if template is not None and not isinstance(template, str):
            raise APIError(400, "chat_template must be a string (a Jinja template)", "invalid_request_error",
                           "chat_template")
        return template

    def tool_calling(self, chat_tools, tool_choice, parallel: bool = True) -> Optional[ToolCalling]:
        """The request's tools, read by the server's tool-call parser (None without tools);
        `parallel` false returns only the first call of a reply (vLLM's parallel_tool_calls)."""
        return make_params(lambda: ToolCalling.from_request(chat_tools, tool_choice, self.tool_call_parser, parallel))

    def with_reasoning(self, params, thinking_token_budget: Optional[int] = None,
                       template_kwargs: Optional[dict] = None, include_reasoning: bool = True):
        """GPT-OSS's harmony markers are special tokens: its parser reads replies with them. A
        `thinking_token_budget` closes a think block after that many tokens (thinking_budget.py).
        With a think-tag parser, structured outputs (and forced tool calls) start once the reply's
        reasoning ends, as in vLLM (unless the reasoning is left out of the reply): a thinking
        model thinks first."""
        if (self.reasoning is not None and not self.reasoning.keeps_special_tokens
                and params.structured_outputs is not None and include_reasoning
                and not self.structured_outputs_in_reasoning):
            params = self._grammar_after_reasoning(params, (template_kwargs or {}).get("enable_thinking") is not False)
        if thinking_token_budget is not None:
            if self.reasoning is None or self.reasoning.keeps_special_tokens:
                raise APIError(400, "thinking_token_budget is set but reasoning_config is not configured. Please set "
                                    "--reasoning-parser (deepseek_r1 or qwen3: think tags) to use thinking_token_budget.",
                               "invalid_request_error", "thinking_token_budget")
            tokenizer, markers = self.text_tokenizer(), self.reasoning_markers
            start, end = markers.think_start, markers.think_end

            def prompt_opens(prompt_ids: list[int]) -> bool:
                tail = tokenizer.decode(prompt_ids[-64:])
                return tail.rfind(THINK_START) > tail.rfind(THINK_END)

            budget = budget_processor(thinking_token_budget, start, end, prompt_opens)
            processors = [*(params.logits_processors or ()), budget]
            params = dataclasses.replace(params, logits_processors=processors)
        if self.reasoning is not None and self.reasoning.keeps_special_tokens:
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def reasoning_token_count(self, token_ids: list[int]) -> int:
        """A whole reply's reasoning tokens (reasoning_tokens.py), 0 without a reasoning parser."""
        if self.reasoning_markers is None:
            return 0
        return count_reasoning_tokens(self.reasoning, self.reasoning_markers, token_ids)

    def _grammar_after_reasoning(self, params, thinking: bool):
        tokenizer, parser = self.text_tokenizer(), self.reasoning
        end = tuple(self.reasoning_markers.think_end)

        def prompt_ends_reasoning(prompt_ids: list[int]) -> bool:
            # (read as text: a template's tags may merge with the tokens around them)
            return parser.prompt_ends_reasoning(tokenizer.decode(prompt_ids[-256:]), thinking)

        # (qwen3: a reply may start a tool call without closing its think block, vLLM's implicit end)
        implicit = self.reasoning_markers.tool_call_start if parser.name == "qwen3" else ()
        after = AfterReasoning(ReasoningEnd(end, implicit), prompt_ends_reasoning)
        return dataclasses.replace(params, structured_outputs=dataclasses.replace(params.structured_outputs,
                                                                                  after_reasoning=after))

    # -- the engine requests of an HTTP request --------------------------------------------------
    async def submit(self, request_ids: list[str], prompts: list, params, priority: int, served: str, chat: bool,
                     prompt_field: str = "prompt", check_context_room: bool = False) -> list[RequestStream]:
        """Queues one engine request per prompt (all or none), with the adapter `served` names if
        it is one; a refusal is the answer `submit_error` makes of it."""
        try:
            streams = await self.client.add_requests(list(zip(request_ids, prompts)), params, priority,
                                                     self.adapters.get(served), check_context_room)
        except Exception as error:
            if isinstance(error, OverloadedError):
                self.metrics.vllm.admission_rejections["max_num_queued_reqs"].inc()
            raise submit_error(error, chat, prompt_field) from error
        for _ in streams:
            self.metrics.observe_params(getattr(params, "n", 1), getattr(params, "max_tokens", None))
        return streams

    @contextlib.contextmanager
    def aborting_unfinished(self, streams: list[RequestStream]):
        """Aborts the requests still unfinished when the block is left (freeing their blocks): the
        client disconnected, the handler was cancelled, or the answer failed."""
        client = self.client  # (held here: a stream may outlive `stop`, which drops the context's)
        try:
            yield
        finally:
            for stream in streams:
                if not stream.finished:
                    client.abort(stream.request_id)

    async def final_outputs(self, request: Request, streams: list[RequestStream]) -> list:
        """Each request's final output, for a non-streamed answer. A client that disconnects
        first (499) or a cancelled handler aborts the unfinished ones; so does a shutdown, which
        answers 503."""
        finals: list = [None] * len(streams)

        async def collect() -> None:
            for i, stream in enumerate(streams):
                while not stream.finished:
                    finals[i] = await next_output(stream)

        collecting = asyncio.ensure_future(collect())
        leaving = asyncio.ensure_future(client_disconnected(request))
        with self.aborting_unfinished(streams):
            try:
                await asyncio.wait({collecting, leaving}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                leaving.cancel()
                collecting.cancel()
        if not collecting.done() or collecting.cancelled():  # (cancel() only asks: it may still be pending)
            raise APIError(499, "the client closed the connection", "client_closed_request")
        collecting.result()  # (raises what collecting raised)
        if self.draining and any(was_aborted(final) for final in finals):
            raise APIError(503, "the server is shutting down", "server_overloaded", None, "shutting_down",
                           {"Retry-After": "1"})
        return finals

    def event_stream(self, streams: list[RequestStream], events: AsyncIterator[str]) -> StreamingResponse:
        """The SSE answer of `events`; a client that goes away mid-stream aborts the requests. A
        failure after the stream began (the engine stopped) ends it with an error event and
        [DONE], as vLLM's server does: the status line was sent already."""

        async def guarded():
            with self.aborting_unfinished(streams):
                try:
                    async for event in events:
                        yield event
                except (APIError, EngineStoppedError) as error:
                    message = error.message if isinstance(error, APIError) else str(error)
                    kind = error.type if isinstance(error, APIError) else "server_overloaded"
                    logger.warning("stream ended by an error: %s", message)
                    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
                    yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"

        return StreamingResponse(guarded(), media_type="text/event-stream")


def serving(request: Request) -> ServingContext:
    """The app's serving context (a route dependency)."""
    return request.app.state.serving


def make_params(build: Callable[[], Params]) -> Params:
    """`build()`, its ValueError a 400 naming the field the message starts with."""
    try:
        return build()
    except ValueError as error:
        field = str(error).split(" ", 1)[0]
        raise APIError(400, str(error), "invalid_request_error", field)


def streamed_output_kind(params) -> str:
    """The engine outputs a streamed answer is built from: what is new each step ("delta": no
    per-step copy of the tokens and text so far), or for beam search, whose beams are rewritten
    until the end, the final beams at once ("final_only"). (Answers that are not streamed read
    the final output alone: "final_only", no per-step detokenizing.)"""
    return "final_only" if params.use_beam_search else "delta"


def with_tools(params, tools: Optional[ToolCalling], structured_fields: str):
    """The request's sampling params with its tools: a forced call is a grammar (none other may
    be asked for, in `structured_fields`); with "auto", Llama 3's <|python_tag|> and
    Mistral's [TOOL_CALLS] are special tokens, kept in the text where the parser looks for
    them (as vLLM does)."""
    if tools is None:
        return params
    if tools.constrained:
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice required or a named function cannot be combined with "
                           f"{structured_fields}", "invalid_request_error", "tool_choice")
        try:
            constraint = tools.constraint()
        except ValueError as error:
            raise APIError(400, str(error), "invalid_request_error", "tools") from error
        return dataclasses.replace(params, structured_outputs=constraint)
    if tools.parser != "hermes":
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


async def next_output(stream: RequestStream) -> Union[RequestOutput, PoolingRequestOutput]:
    """The stream's next output; EngineStoppedError (503: shutting down, or the engine failed)
    passes, any other error (a failed step) is a 500."""
    try:
        return await stream.next()
    except EngineStoppedError:
        raise
    except Exception as error:
        raise APIError(500, str(error), "server_error") from error


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every request's stream as they arrive."""
    if len(streams) == 1:
        while True:
            yield 0, await next_output(streams[0])
    combined: asyncio.Queue = asyncio.Queue()

    async def forward(index: int, stream: RequestStream) -> None:
        try:
            while not stream.finished:
                await combined.put((index, await next_output(stream)))
        except Exception as error:  # (APIError, EngineStoppedError: raised to the reader)
            await combined.put((index, error))

    tasks = [asyncio.create_task(forward(i, stream)) for i, stream in enumerate(streams)]
    try:
        while True:
            index, item = await combined.get()
            if isinstance(item, Exception):
                raise item
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


def was_aborted(final: Union[RequestOutput, PoolingRequestOutput]) -> bool:
    """Whether the engine aborted the request (a drain's deadline passed) before it finished."""
    if isinstance(final, PoolingRequestOutput):
        return not any(dataclasses.astuple(final.outputs))  # (an aborted prompt pooled nothing)
    return any(completion.finish_reason == "abort" for completion in final.outputs)


async def client_disconnected(request: Request) -> None:
    """Returns once the client has gone (its body is read: the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.1)  # (a body chunk after the end: not expected, but never spin)

"""The FastAPI application: /v1/completions, /v1/chat/completions (with SSE streaming),
/v1/embeddings, vLLM's /classify, /score and /rerank, /v1/models, /health, /metrics, vLLM's /tokenize, /detokenize and /version, and OpenAI-shaped
errors. With an API key, every route but /health asks for `Authorization: Bearer <key>`.
Request bodies are bounded (413 beyond max_request_body_bytes), prompts are rendered and
tokenized on the engine loop's worker pool, and a client that leaves aborts its requests."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import signal
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from pagedkv import __version__
from pagedkv.config import EngineConfig
from pagedkv.engine import LLMEngine
from pagedkv.errors import (
    DuplicateRequestError,
    EngineStoppedError,
    InvalidConfigError,
    OverloadedError,
    PromptTooLongError,
)
from pagedkv.engine_loop import EngineLoop
from pagedkv.lora import LoRARequest
from pagedkv.outputs import PoolingRequestOutput, RequestOutput
from pagedkv.server.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodySizeLimit, BodyTooLargeError
from pagedkv.server.metrics import ServerMetrics
from pagedkv.pooling_params import PoolingParams
from pagedkv.sampling_params import check_unicode
from pagedkv.scoring import score_pairs, scores_of, scoring_requests
from pagedkv.server.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RequestFieldError,
    RerankRequest,
    ResponsesRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagedkv.server.openapi import (
    ERROR_RESPONSES,
    ChatCompletion,
    ClassificationList,
    Completion,
    DetokenizeResponse,
    EmbeddingList,
    ModelList,
    RerankList,
    ResponseBody,
    ScoreList,
    StatusResponse,
    TokenizeResponse,
    VersionResponse,
    answer,
    install_openapi,
    streamed_answer,
)
from pagedkv.server.reasoning import ReasoningParser
from pagedkv.server.responses import ResponseBuilder
from pagedkv.server.responses_api import ResponseState, usage as responses_usage
from pagedkv.server.tools import PARSERS as TOOL_CALL_PARSERS
from pagedkv.server.tools import ToolCalling

logger = logging.getLogger("pagedkv.server")

# Engine ValueErrors that start with one of these name a sampling field; others are about the prompt.
SAMPLING_FIELDS = frozenset({"logit_bias", "stop_token_ids", "n", "structured_outputs", "priority", "allowed_token_ids",
                             "max_tokens", "logprobs"})
# Sampling fields a chat request calls by another name.
CHAT_FIELDS = {"logprobs": "top_logprobs"}
# Parts of a validation error's location that name a union's branch, not a field of the request.
_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "dict", "list"})
# The one route --api-key leaves open: load balancers and orchestrators probe it.
UNGUARDED_ROUTES = frozenset({"/health"})


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: Optional[str] = None, code=None, headers=None):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_response(status: int, message: str, type_: str, param=None, code=None, headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(engine: LLMEngine, served_model_name: Optional[str] = None, chat_template: Optional[str] = None,
               api_key: Optional[str] = None, lora_modules: Optional[dict[str, str]] = None,
               allow_runtime_lora_updating: bool = False, reasoning_parser: Optional[str] = None,
               tool_call_parser: str = "hermes",
               max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    """The app around an engine; the engine loop runs for the app's lifetime. `chat_template`
    (Jinja) replaces the tokenizer's own, e.g. for a base model that has none. `api_key`: /v1
    routes (all but /health) answer 401 unless the request carries `Authorization: Bearer <api_key>`; an
    empty key is an InvalidConfigError. Bodies longer than `max_request_body_bytes` get 413.
    `lora_modules` ({name: PEFT directory}, engine with enable_lora): each adapter is served as a
    model of its own name, loaded now. `allow_runtime_lora_updating` adds vLLM's
    /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters from the server's disk).
    `reasoning_parser` ("deepseek_r1", "qwen3", "openai_gptoss"): chat replies' think blocks become
    `reasoning_content` (server/reasoning.py). `tool_call_parser` ("hermes", "llama3_json",
    "mistral", "openai"): how tool calls are found in replies with tool_choice "auto" (server/tools.py)."""
    check_api_key(api_key)
    if not isinstance(max_request_body_bytes, int) or max_request_body_bytes <= 0:
        raise InvalidConfigError(f"max_request_body_bytes must be a positive integer, got {max_request_body_bytes!r}")
    if tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {tool_call_parser!r}")
    model_name = served_model_name or engine.model_name
    adapters = {name: LoRARequest(name, index + 1, path) for index, (name, path) in enumerate((lora_modules or {}).items())}
    if model_name in adapters:
        raise ValueError(f"LoRA module name {model_name!r} is the base model's served name")
    for adapter in adapters.values():
        engine.add_lora(adapter)  # (a bad adapter stops the server from starting, not a request)
    reasoning = ReasoningParser(reasoning_parser) if reasoning_parser else None
    builders = {name: ResponseBuilder(engine.tokenizer, name, reasoning) for name in (model_name, *adapters)}
    # Routes reach the engine through `state`, emptied at shutdown: an app that is done must not
    # keep its engine alive (FastAPI caches route functions, and with them their closures).
    state: dict = {"engine": engine, "draining": False}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = EngineLoop(state["engine"])
        metrics = ServerMetrics(lambda: loop.stats)
        loop.metrics = metrics
        state.update(loop=loop, metrics=metrics)
        loop.start()
        logger.info("serving %s", model_name)
        try:
            yield
        finally:
            loop.stop()
            state.clear()
            state["engine_failure"] = loop.failure  # (what `serve` exits non-zero for)
            builders.clear()  # (they hold the tokenizer)

    app = FastAPI(title="pagedkv", version=__version__, lifespan=lifespan, responses=ERROR_RESPONSES)
    app.state.pagedkv = state
    install_openapi(app)

    def drain(grace_seconds: float) -> None:
        """Starts a graceful shutdown (serve calls it at SIGTERM): the requests still running
        after `grace_seconds` are aborted; their streams end with finish_reason "abort" and
        [DONE], their non-streamed answers are a 503 error."""
        state["draining"] = True
        timer = threading.Timer(grace_seconds, lambda: "loop" in state and state["loop"].abort_all())
        timer.daemon = True
        timer.start()

    app.state.drain = drain
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            if request.method != "OPTIONS" and request.url.path not in UNGUARDED_ROUTES:
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):  # (constant time: no key guessing by timing)
                    return error_response(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                          "authentication_error", None, "invalid_api_key")
            return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError):
        return error_response(error.status, error.message, error.type, error.param, error.code, error.headers)

    @app.exception_handler(BodyTooLargeError)
    async def body_too_large(_: Request, error: BodyTooLargeError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError):
        # Of a union's failed branches, the deepest error is the one that names the actual mistake.
        first = max(error.errors(), key=lambda detail: len(detail.get("loc", ())), default={})
        where = first.get("loc", ())
        location = [str(part) for part in where[1:] if "[" not in str(part) and part not in _TYPE_LABELS]
        param = where[1] if len(where) > 1 and isinstance(where[1], str) else None  # (not a JSON error's offset)
        message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(RequestFieldError)
    async def request_field_error(_: Request, error: RequestFieldError):
        return error_response(400, str(error), "invalid_request_error", error.field or None)

    @app.exception_handler(OverloadedError)
    @app.exception_handler(EngineStoppedError)
    async def overloaded(_: Request, error: Exception):
        return error_response(503, str(error), "server_overloaded", None, "overloaded", {"Retry-After": "1"})

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException):
        """Starlette's own errors (unknown route, wrong method, unreadable body) in the OpenAI shape."""
        kind = "server_error" if error.status_code >= 500 else "invalid_request_error"
        return error_response(error.status_code, str(error.detail), kind, headers=error.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        """A fault of the server's own (never of the request: those are 4xx), logged with the request
        id the answer carries, so a client's report can be matched to the traceback."""
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        logger.error("internal error in %s %s (request id %s)", request.method, request.url.path, request_id,
                     exc_info=error)
        return error_response(500, f"internal server error (request id {request_id})", "server_error",
                              headers={"x-request-id": request_id})

    @app.get("/health", responses={**answer(StatusResponse),
                                   503: {"model": StatusResponse, "description": "The engine loop has stopped"}})
    async def health():
        if not state["loop"].alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models", responses=answer(ModelList))
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "pagedkv",
                "max_model_len": state["engine"].max_model_len}
        lora_cards = [{"id": name, "object": "model", "created": 0, "owned_by": "pagedkv", "root": adapter.lora_path,
                       "parent": model_name, "max_model_len": state["engine"].max_model_len}
                      for name, adapter in adapters.items()]
        return {"object": "list", "data": [card, *lora_cards]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(state["metrics"].render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", responses=streamed_answer(Completion))
    async def completions(body: CompletionRequest, request: Request):
        served = check_model(body.model)
        params = make_params(lambda: body.completion_params(state["engine"].generation_defaults))
        prompts = make_params(body.prompts)
        return await run(request, prompts, params, body, served, chat=False)

    @app.post("/v1/chat/completions", responses=streamed_answer(ChatCompletion))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        served = check_model(body.model)
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        default_max = max(1, state["engine"].max_model_len // 2)
        params = make_params(lambda: body.sampling_params(body.chat_logprobs(), default_max,
                                                          state["engine"].generation_defaults))
        chat_tools, tool_choice = body.chat_tools()
        tools = make_params(lambda: ToolCalling.from_request(chat_tools, tool_choice, tool_call_parser))
        params = with_reasoning(with_tools(params, tools, "structured outputs (response_format, guided_*)"))
        prompt = await chat_prompt(body.messages, True, chat_tools if tools is not None else None, body.chat_template_kwargs)
        return await run(request, [prompt], params, body, served, chat=True, tools=tools)

    @app.post("/v1/responses", responses=streamed_answer(ResponseBody))
    async def responses(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API, stateless (store is always false), whole or streamed as events."""
        served = check_model(body.model)
        params = make_params(lambda: body.responses_params(max(1, state["engine"].max_model_len // 2),
                                                           state["engine"].generation_defaults))
        messages = make_params(body.messages)
        chat_tools, tool_choice = make_params(body.chat_tools)
        tools = make_params(lambda: ToolCalling.from_request(chat_tools, tool_choice, tool_call_parser))
        params = with_reasoning(with_tools(params, tools, "text.format"))
        prompt = await chat_prompt(messages, True, chat_tools if tools is not None else None, body.chat_template_kwargs)
        response = ResponseState(served, body, reasoning, tools)
        if not body.stream:
            params = dataclasses.replace(params, output_kind="final_only")
        try:
            [queue] = await state["loop"].submit_all([(response.id, prompt)], params, body.priority, adapters.get(served),
                                                     check_context_room=body.max_output_tokens is not None)
        except Exception as error:
            raise submit_error(error, chat=False, prompt_field="input") from error

        async def events():
            yield "".join(response.start())
            output = None
            while output is None or not output.finished:
                output = await next_output(queue)
                completion = output.outputs[0]
                text = "".join(response.update(completion.text, completion.finish_reason, output.finished))
                if text:
                    yield text
            yield "".join(response.finish(completion.finish_reason, responses_usage(output)))

        if body.stream:
            return StreamingResponse(guarded([response.id], events()), media_type="text/event-stream")
        [output] = await final_outputs(request, [response.id], [queue])
        completion = output.outputs[0]
        return response.complete(completion.text, completion.finish_reason, responses_usage(output))

    @app.post("/v1/embeddings", responses=answer(EmbeddingList))
    async def embeddings(body: EmbeddingRequest, request: Request):
        served = check_model(body.model)
        inputs = make_params(body.inputs)
        hidden_size = state["engine"].runner.hf_config.hidden_size
        if body.dimensions is not None and body.dimensions != hidden_size:
            raise APIError(400, f"dimensions={body.dimensions} is not supported: this model's embeddings have "
                           f"{hidden_size}", "invalid_request_error", "dimensions")
        outputs = await pool(request, "embd-", inputs, PoolingParams(), body.priority, served)
        return builders[served].embeddings(outputs, body.encoding_format)

    @app.post("/classify", responses=answer(ClassificationList))
    @app.post("/v1/classify", responses=answer(ClassificationList))
    async def classify(body: ClassificationRequest, request: Request):
        """vLLM's /classify: each input's class probabilities and most likely label, from a
        sequence-classification checkpoint."""
        served = check_model(body.model)
        inputs = make_params(body.inputs)
        if state["engine"].classifier is None:
            raise APIError(400, f"model {served!r} is not a sequence classifier (*ForSequenceClassification)",
                           "invalid_request_error", "model")
        params = PoolingParams(task="classify", use_activation=body.use_activation)
        outputs = await pool(request, "classify-", inputs, params, body.priority, served)
        return builders[served].classifications(outputs, state["engine"].runner.hf_config)

    async def scored(request: Request, pairs_of, prefix: str, priority: int, served: str) -> tuple[list[float], int]:
        """(a score per pair (pagedkv.scoring), prompt tokens computed), or a 400 naming what is wrong."""
        try:
            pairs = pairs_of()
            prompts, params = scoring_requests(pairs, state["engine"].tokenizer, state["engine"].classifier)
        except ValueError as error:
            raise APIError(400, str(error), "invalid_request_error")
        outputs = await pool(request, prefix, prompts, params, priority, served)
        scores = [score for score, _ in scores_of(pairs, prompts, outputs, params)]
        return scores, sum(len(output.prompt_token_ids) for output in outputs)

    @app.post("/score", responses=answer(ScoreList))
    @app.post("/v1/score", responses=answer(ScoreList))
    async def score(body: ScoreRequest, request: Request):
        """vLLM's /score: a relevance score per (text_1, text_2) pair."""
        served = check_model(body.model)
        scores, num_tokens = await scored(request, lambda: score_pairs(body.text_1, body.text_2), "score-",
                                          body.priority, served)
        return builders[served].scores(scores, num_tokens)

    @app.post("/rerank", responses=answer(RerankList))
    @app.post("/v1/rerank", responses=answer(RerankList))
    @app.post("/v2/rerank", responses=answer(RerankList))
    async def rerank(body: RerankRequest, request: Request):
        """vLLM's /rerank: the documents, most relevant to the query first (the best `top_n`)."""
        served = check_model(body.model)
        scores, num_tokens = await scored(request, lambda: score_pairs(body.query, body.documents), "rerank-",
                                          body.priority, served)
        return builders[served].reranked(body.documents, scores, body.top_n, num_tokens)

    async def pool(request: Request, prefix: str, inputs: list, params: PoolingParams, priority: int,
                   served: str) -> list:
        """Queues one pooling request per input (all or none) and waits for their outputs (see
        final_outputs: a client that leaves aborts them)."""
        request_id = prefix + uuid.uuid4().hex
        request_ids = [f"{request_id}-{i}" for i in range(len(inputs))]
        try:
            queues = await state["loop"].submit_all(list(zip(request_ids, inputs)), params, priority,
                                                    adapters.get(served))
        except Exception as error:
            raise submit_error(error, chat=False, prompt_field="input") from error
        return await final_outputs(request, request_ids, queues)

    @app.post("/tokenize", responses=answer(TokenizeResponse))
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "invalid_request_error", "prompt")
        if body.messages is not None:
            text = await chat_prompt(body.messages, body.add_generation_prompt, None, body.chat_template_kwargs)
        else:
            text = body.prompt
        try:
            check_unicode(text, "prompt")
        except ValueError as error:
            raise APIError(400, str(error), "invalid_request_error", "prompt")
        tokens = await state["loop"].run_in_worker(
            lambda: state["engine"].tokenizer.encode(text, add_special_tokens=body.add_special_tokens))
        return {"count": len(tokens), "max_model_len": state["engine"].max_model_len, "tokens": tokens}

    @app.post("/detokenize", responses=answer(DetokenizeResponse))
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab_size = state["engine"].runner.vocab_size
        if any(not 0 <= token < vocab_size for token in body.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {vocab_size})", "invalid_request_error", "tokens")
        return {"prompt": await state["loop"].run_in_worker(state["engine"].tokenizer.decode, body.tokens)}

    @app.post("/reset_prefix_cache", responses=answer(StatusResponse))
    async def reset_prefix_cache():
        """vLLM's: forgets every cached prefix (after a weight update); 409 while requests run."""
        if not await state["loop"].call(lambda running: running.reset_prefix_cache()):
            raise APIError(409, "the prefix cache cannot be reset while requests are unfinished", "conflict_error", None)
        return {"status": "ok"}

    if allow_runtime_lora_updating:
        if state["engine"].runner.lora_registry is None:
            raise ValueError("allow_runtime_lora_updating needs an engine built with enable_lora=True")

        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            name = body.lora_name
            if name == model_name or name in adapters:
                raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "invalid_request_error",
                               "lora_name")
            next_id = max((known.lora_int_id for known in adapters.values()), default=0) + 1
            adapter = LoRARequest(name, next_id, body.lora_path)
            try:
                await state["loop"].call(lambda running: running.add_lora(adapter))
            except ValueError as error:  # (InvalidConfigError: the message names what is wrong)
                raise APIError(400, str(error), "invalid_request_error", "lora_path") from error
            adapters[name] = adapter
            builders[name] = ResponseBuilder(state["engine"].tokenizer, name, reasoning)
            logger.info("LoRA adapter %r loaded from %s", name, body.lora_path)
            return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            adapter = adapters.pop(body.lora_name, None)
            if adapter is None:
                raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "invalid_request_error",
                               "lora_name", "model_not_found")
            builders.pop(body.lora_name, None)
            await state["loop"].call(lambda running: running.remove_lora(adapter.lora_int_id))
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.get("/version", responses=answer(VersionResponse))
    async def version():
        return {"version": __version__}

    async def chat_prompt(messages, add_generation_prompt: bool, tools=None, template_kwargs=None) -> str:
        """The prompt text, rendered on the worker pool (megabytes of messages or thousands of
        tools take seconds); `template_kwargs` reach the template as variables (e.g. Qwen3's
        enable_thinking)."""
        turns = [message.template_fields() for message in messages]
        try:
            return await state["loop"].run_in_worker(lambda: state["engine"].tokenizer.apply_chat_template(
                turns, tools=tools, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **(template_kwargs or {})))
        except OverloadedError:
            raise
        except Exception as error:
            raise APIError(400, f"messages: cannot apply the chat template: {error}", "invalid_request_error", "messages")

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
            return dataclasses.replace(params, structured_outputs=tools.constraint())
        if tools.parser != "hermes":
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def with_reasoning(params):
        """GPT-OSS's harmony markers are special tokens: its parser reads replies with them."""
        if reasoning is not None and reasoning.keeps_special_tokens:
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def check_model(name: Optional[str]) -> str:
        """The served name a request asked for (the base model's by default)."""
        if name is None or name == model_name:
            return model_name
        if name in adapters:
            return name
        served = ", ".join(repr(known) for known in (model_name, *adapters))
        raise APIError(404, f"model {name!r} does not exist; this server serves {served}",
                       "invalid_request_error", "model", "model_not_found")

    def make_params(build):
        try:
            return build()
        except ValueError as error:
            field = str(error).split(" ", 1)[0]
            raise APIError(400, str(error), "invalid_request_error", field)

    async def run(request: Request, prompts: list, params, body, served: str, chat: bool,
                  tools: Optional[ToolCalling] = None):
        """Queues one engine request per prompt (all or none), with the adapter `served` names
        if it is one, and answers with their choices."""
        responses = builders[served]
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        request_ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        if not body.stream:  # only the final output is sent: spare the engine per-step detokenizing
            params = dataclasses.replace(params, output_kind="final_only")
        try:
            queues = await state["loop"].submit_all(list(zip(request_ids, prompts)), params, body.priority,
                                                    adapters.get(served), check_context_room=body.max_tokens is not None)
        except Exception as error:
            raise submit_error(error, chat) from error
        created = int(time.time())
        echo = bool(getattr(body, "echo", False))
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            chunks = responses.stream_chunks(request_id, merged(queues), len(queues), created, chat, include_usage,
                                             params.n, echo, tools)
            return StreamingResponse(guarded(request_ids, chunks), media_type="text/event-stream")
        finals = await final_outputs(request, request_ids, queues)
        return responses.full_response(request_id, finals, created, chat, params.n, echo, tools)

    async def final_outputs(request: Request, request_ids: list[str], queues: list) -> list[RequestOutput]:
        """Each request's final output, for a non-streamed answer. A client that disconnects
        first (or a cancelled handler) aborts the unfinished ones, freeing their blocks; so does
        a shutdown, which answers 503."""
        finals: list[Optional[RequestOutput]] = [None] * len(queues)

        async def collect() -> None:
            for i, queue in enumerate(queues):
                while finals[i] is None or not finals[i].finished:
                    finals[i] = await next_output(queue)

        collecting = asyncio.ensure_future(collect())
        leaving = asyncio.ensure_future(client_disconnected(request))
        try:
            await asyncio.wait({collecting, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            collecting.cancel()
            for sub_id, final in zip(request_ids, finals):
                if final is None or not final.finished:
                    state["loop"].abort(sub_id)
        if not collecting.done() or collecting.cancelled():  # (cancel() only asks: it may still be pending)
            raise APIError(499, "the client closed the connection", "client_closed_request")
        collecting.result()  # (raises what collecting raised)
        if state["draining"] and any(was_aborted(final) for final in finals):
            raise APIError(503, "the server is shutting down", "server_overloaded", None, "shutting_down",
                           {"Retry-After": "1"})
        return finals

    def was_aborted(final: Union[RequestOutput, PoolingRequestOutput]) -> bool:
        if isinstance(final, PoolingRequestOutput):
            return not any(dataclasses.astuple(final.outputs))  # (an aborted prompt pooled nothing)
        return any(completion.finish_reason == "abort" for completion in final.outputs)

    async def client_disconnected(request: Request) -> None:
        """Returns once the client has gone (its body is read: the next message says so)."""
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.1)  # (a body chunk after the end: not expected, but never spin)

    def submit_error(error: Exception, chat: bool, prompt_field: str = "prompt") -> Exception:
        prompt_field = "messages" if chat else prompt_field
        if isinstance(error, PromptTooLongError):
            return APIError(400, str(error), "invalid_request_error", prompt_field, "context_length_exceeded")
        if isinstance(error, DuplicateRequestError):
            return APIError(409, str(error), "invalid_request_error")
        if isinstance(error, ValueError):
            message = str(error)
            field, _, rest = message.partition(" ")
            if field not in SAMPLING_FIELDS:
                return APIError(400, message, "invalid_request_error", prompt_field)
            field = CHAT_FIELDS.get(field, field) if chat else field
            return APIError(400, f"{field} {rest}", "invalid_request_error", field)
        return error

    async def merged(queues: list) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every request's queue as they arrive."""
        if len(queues) == 1:
            while True:
                yield 0, await next_output(queues[0])
        combined: asyncio.Queue = asyncio.Queue()

        async def forward(index: int, queue) -> None:
            while True:
                item = await queue.get()
                await combined.put((index, item))
                if isinstance(item, Exception) or item.finished:
                    return

        tasks = [asyncio.create_task(forward(i, queue)) for i, queue in enumerate(queues)]
        try:
            while True:
                index, item = await combined.get()
                if isinstance(item, EngineStoppedError):  # (503: shutting down, or the engine failed)
                    raise item
                if isinstance(item, Exception):
                    raise APIError(500, str(item), "server_error")
                yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def guarded(request_ids: list[str], chunks: AsyncIterator[str]):
        """Aborts the requests (freeing their blocks) if the client goes away mid-stream. A
        failure after the stream began (the engine stopped) ends it with an error event and
        [DONE], as vLLM's server does: the status line was sent already."""
        finished = False
        try:
            try:
                async for chunk in chunks:
                    yield chunk
            except (APIError, EngineStoppedError) as error:
                message = error.message if isinstance(error, APIError) else str(error)
                kind = error.type if isinstance(error, APIError) else "server_overloaded"
                logger.warning("stream ended by an error: %s", message)
                body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
                yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                for sub_id in request_ids:
                    state["loop"].abort(sub_id)

    async def next_output(outputs) -> RequestOutput:
        item = await outputs.get()
        if isinstance(item, EngineStoppedError):  # (503: shutting down, or the engine failed)
            raise item
        if isinstance(item, Exception):
            raise APIError(500, str(item), "server_error")
        return item

    return app


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, served_model_name=None,
          chat_template: Optional[str] = None, api_key: Optional[str] = None,
          lora_modules: Optional[dict[str, str]] = None, allow_runtime_lora_updating: bool = False,
          reasoning_parser: Optional[str] = None, tool_call_parser: str = "hermes",
          max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, shutdown_grace_seconds: float = 10.0) -> int:
    """Builds the engine and runs uvicorn until SIGINT/SIGTERM: stops accepting, lets in-flight
    requests finish for `shutdown_grace_seconds`, aborts the rest (see `drain` in create_app), and
    returns 0. `lora_modules` and `allow_runtime_lora_updating` turn enable_lora on."""
    import uvicorn

    check_api_key(api_key)  # (before the model loads)
    if shutdown_grace_seconds < 0:
        raise InvalidConfigError(f"shutdown_grace_seconds must be >= 0, got {shutdown_grace_seconds!r}")

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal after its graceful shutdown (exit status -15); a
            # completed graceful shutdown is a success, so only route the signals to it.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)
            yield

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                app.state.drain(shutdown_grace_seconds)
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            # An engine that cannot go on (a tensor-parallel rank lost) ends the server, non-zero.
            loop = app.state.pagedkv.get("loop")
            if loop is not None and loop.failure is not None:
                return True
            return await super().on_tick(counter)

    if (lora_modules or allow_runtime_lora_updating) and not config.enable_lora:
        config = dataclasses.replace(config, enable_lora=True)
    app = create_app(LLMEngine(config), served_model_name, chat_template, api_key, lora_modules,
                     allow_runtime_lora_updating, reasoning_parser, tool_call_parser, max_request_body_bytes)
    # uvicorn's own bound on the drain comes after ours: by then every request has ended.
    Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_grace_seconds + 5,
                          log_level="info")).run()
    failure = app.state.pagedkv.get("engine_failure")
    if failure is not None:
        logger.error("the server stopped because the engine failed: %s", failure)
        return 1
    return 0


def check_api_key(api_key: Optional[str]) -> None:
    """None serves without authentication; an empty key is a mistake (an unset variable), not a
    wish for none: InvalidConfigError."""
    if api_key is not None and not api_key.strip():
        raise InvalidConfigError("api_key must be a non-empty string (unset it, and PAGEDKV_API_KEY, to serve "
                                 "without authentication)")

"""The FastAPI application: /v1/completions, /v1/chat/completions (with SSE streaming),
/v1/responses, /v1/embeddings, vLLM's /classify, /score and /rerank, /v1/models, /health,
/metrics, vLLM's /tokenize, /detokenize and /version, and OpenAI-shaped errors. The routes live
in server/routes/ (one APIRouter per family) and work through one ServingContext
(server/serving.py) over AsyncLLM, the engine loop's only client. With an API key, every route
but /health asks for `Authorization: Bearer <key>`. Request bodies are bounded (413 beyond
max_request_body_bytes), prompts are rendered and tokenized on the engine's worker pool, and a
client that leaves aborts its requests."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hmac
import logging
import signal
from contextlib import asynccontextmanager
from typing import Optional, Union

from fastapi import FastAPI, Request

from pagedkv import __version__
from pagedkv.config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.errors import InvalidConfigError
from pagedkv.entrypoints.server.header_timeout import DEFAULT_REQUEST_HEADER_TIMEOUT_SECONDS, header_timeout_protocol
from pagedkv.entrypoints.server.body_screen import BodyScreen
from pagedkv.entrypoints.server.body_limit import BODY_PAUSE_SECONDS, DEFAULT_MAX_REQUEST_BODY_BYTES, BodySizeLimit
from pagedkv.entrypoints.server.errors import error_response, install_error_handlers
from pagedkv.entrypoints.server.openapi import ERROR_RESPONSES, install_openapi
from pagedkv.entrypoints.server.routes import (admin, completions, decisions, pooling, responses, sagemaker,
                                               tokenization)
from pagedkv.entrypoints.server.request_id_header import RequestIdHeader
from pagedkv.entrypoints.server.load_reports import LoadReports, ServerLoad
from pagedkv.entrypoints.server.sagemaker_sessions import SessionStore
from pagedkv.entrypoints.server.serving import ServingContext

logger = logging.getLogger("pagedkv.entrypoints.server")

# The one route --api-key leaves open: load balancers and orchestrators probe it.
UNGUARDED_ROUTES = frozenset({"/health", "/ping"})  # (health checks)


def create_app(engine: LLMEngine, served_model_name: Optional[str] = None, chat_template: Optional[str] = None,
               api_key: Optional[str] = None, lora_modules: Optional[dict[str, Union[str, dict]]] = None,
               allow_runtime_lora_updating: bool = False, reasoning_parser: Optional[str] = None,
               tool_call_parser: str = "hermes",
               max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
               request_body_pause_seconds: float = BODY_PAUSE_SECONDS,
               enable_force_include_usage: bool = False, enable_tokenizer_info_endpoint: bool = False,
               enable_server_load_tracking: bool = False, root_path: str = "",
               enable_prompt_tokens_details: bool = False, enable_per_request_metrics: bool = False,
               return_tokens_as_token_ids: bool = False, enable_request_id_headers: bool = False,
               enable_sagemaker_sessions: bool = False, trust_request_chat_template: bool = False,
               structured_outputs_in_reasoning: bool = False) -> FastAPI:
    """The app around an engine; an AsyncLLM steps it for the app's lifetime. `chat_template`
    (Jinja) replaces the tokenizer's own, e.g. for a base model that has none. `api_key`: /v1
    routes (all but /health) answer 401 unless the request carries `Authorization: Bearer <api_key>`; an
    empty key is an InvalidConfigError. Bodies longer than `max_request_body_bytes` get 413, bodies
    that pause longer than `request_body_pause_seconds` 408. `enable_force_include_usage`: every
    streamed chunk carries the usage so far and every stream ends with a usage chunk, asked for or
    not (vLLM's flag). `root_path`: a path prefix routes answer under as well as without it (a
    proxy in front may strip it or not, as vLLM's `--root-path`); links and /openapi.json name it. `enable_tokenizer_info_endpoint`
    adds vLLM's GET /tokenizer_info (off by default, as in vLLM: it shows the tokenizer's setup).
    `enable_server_load_tracking`: GET /load counts the requests in flight (vLLM's; server/load_reports.py).
    `enable_prompt_tokens_details`: usage carries `prompt_tokens_details.cached_tokens`, the prompt
    tokens the prefix cache served (vLLM's flag; off, as there). `enable_per_request_metrics`: a
    one-choice reply carries `metrics` (its queue time, time to first token, decode time, mean
    inter-token latency, tokens per second; streamed: on the usage chunk), vLLM's flag.
    `return_tokens_as_token_ids`: logprobs name every request's tokens "token_id:<id>" (vLLM's flag).
    `enable_request_id_headers`: every answer carries X-Request-Id, the request's or a fresh one (vLLM's).
    `enable_sagemaker_sessions`: /invocations opens and closes SageMaker's stateful sessions.
    `trust_request_chat_template`: a chat request may bring its own `chat_template` (vLLM's flag;
    without it such a request is a 400: a template is Jinja the server runs).
    `lora_modules` ({name: PEFT directory, or {"path", "base_model_name"}}, engine with enable_lora): each adapter is served as a
    model of its own name, loaded now. `allow_runtime_lora_updating` adds vLLM's
    /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters from the server's disk).
    `reasoning_parser` ("deepseek_r1", "qwen3", "openai_gptoss"): chat replies' think blocks become
    `reasoning_content` (server/reasoning.py), and with a think-tag parser structured outputs and
    forced tool calls start once the reply's reasoning has ended, unless
    `structured_outputs_in_reasoning` (vLLM's --structured-outputs-config.enable_in_reasoning)
    constrains the reasoning too. `tool_call_parser` ("hermes", "llama3_json",
    "mistral", "openai"): how tool calls are found in replies with tool_choice "auto" (server/tools.py)."""
    check_api_key(api_key)
    if not isinstance(max_request_body_bytes, int) or max_request_body_bytes <= 0:
        raise InvalidConfigError(f"max_request_body_bytes must be a positive integer, got {max_request_body_bytes!r}")
    context = ServingContext(engine, served_model_name, chat_template, lora_modules, reasoning_parser, tool_call_parser,
                             enable_force_include_usage, enable_prompt_tokens_details, enable_per_request_metrics,
                             return_tokens_as_token_ids)
    if enable_sagemaker_sessions:
        context.sagemaker_sessions = SessionStore()
    context.trust_request_chat_template = trust_request_chat_template
    context.structured_outputs_in_reasoning = structured_outputs_in_reasoning
    if allow_runtime_lora_updating and not context.supports_lora:
        raise ValueError("allow_runtime_lora_updating needs an engine built with enable_lora=True")

    app = FastAPI(title="pagedkv", version=__version__, lifespan=lifespan, responses=ERROR_RESPONSES,
                  root_path=root_path)
    # Routes reach the engine through app.state.serving, emptied at shutdown: an app that is done
    # must not keep its engine alive.
    app.state.serving = context
    app.state.engine_failure = None  # (what `serve` exits non-zero for)
    app.state.server_load = ServerLoad(enable_server_load_tracking)
    app.state.body_screen = BodyScreen()
    install_openapi(app)
    app.add_middleware(LoadReports, load=app.state.server_load,
                       stats_source=lambda: context.client.stats() if context.client is not None else {})
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes, pause_seconds=request_body_pause_seconds)
    if enable_request_id_headers:
        app.add_middleware(RequestIdHeader)
    if api_key is not None:
        require_api_key(app, api_key)
    install_error_handlers(app)
    for router in (admin.router, completions.router, responses.router, decisions.router, pooling.router,
                   tokenization.router, sagemaker.router):
        app.include_router(router)
    if allow_runtime_lora_updating:
        app.include_router(admin.lora_router)
    if enable_tokenizer_info_endpoint:
        app.include_router(tokenization.info_router)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The engine steps (AsyncLLM's loop thread) while the app serves."""
    context: ServingContext = app.state.serving
    context.start()
    with contextlib.suppress(OSError):  # (then large bodies are parsed in the server, as without it)
        await app.state.body_screen.start()
    logger.info("serving %s", context.model_name)
    try:
        yield
    finally:
        await app.state.body_screen.close()
        app.state.engine_failure = context.stop()
        app.state.serving = None


def require_api_key(app: FastAPI, api_key: str) -> None:
    """Every route but UNGUARDED_ROUTES answers 401 without `Authorization: Bearer <api_key>`."""
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        path = request.scope["path"].removeprefix(request.scope.get("root_path", ""))
        if request.method != "OPTIONS" and path not in UNGUARDED_ROUTES:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):  # (constant time: no key guessing by timing)
                return error_response(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                      "authentication_error", None, "invalid_api_key")
        return await call_next(request)


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, served_model_name=None,
          chat_template: Optional[str] = None, api_key: Optional[str] = None,
          lora_modules: Optional[dict[str, Union[str, dict]]] = None, allow_runtime_lora_updating: bool = False,
          reasoning_parser: Optional[str] = None, tool_call_parser: str = "hermes",
          max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, shutdown_grace_seconds: float = 10.0,
          enable_force_include_usage: bool = False, enable_tokenizer_info_endpoint: bool = False,
          enable_server_load_tracking: bool = False, root_path: str = "", uds: Optional[str] = None,
          enable_prompt_tokens_details: bool = False, enable_per_request_metrics: bool = False,
          return_tokens_as_token_ids: bool = False, enable_request_id_headers: bool = False,
          enable_sagemaker_sessions: bool = False, trust_request_chat_template: bool = False,
          request_header_timeout_seconds: float = DEFAULT_REQUEST_HEADER_TIMEOUT_SECONDS,
          structured_outputs_in_reasoning: bool = False) -> int:
    """Builds the engine and runs uvicorn until SIGINT/SIGTERM: stops accepting, lets in-flight
    requests finish for `shutdown_grace_seconds`, aborts the rest (ServingContext.drain), and
    returns 0. `lora_modules` and `allow_runtime_lora_updating` turn enable_lora on. `uds`: a Unix
    socket path to serve on instead of host and port. `root_path`: see `create_app`. A request head (request line and headers) not
    all arrived `request_header_timeout_seconds` after its connection opened (or after its first
    bytes on a kept-alive connection) gets 408 and its connection closes (header_timeout.py)."""
    import uvicorn

    check_api_key(api_key)  # (before the model loads)
    if shutdown_grace_seconds < 0:
        raise InvalidConfigError(f"shutdown_grace_seconds must be >= 0, got {shutdown_grace_seconds!r}")
    if not request_header_timeout_seconds > 0:
        raise InvalidConfigError(f"request_header_timeout_seconds must be > 0, got {request_header_timeout_seconds!r}")

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal after its graceful shutdown (exit status -15); a
            # completed graceful shutdown is a success, so only route the signals to it.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)
            yield

        def handle_exit(self, sig, frame) -> None:
            context = app.state.serving
            if not self.should_exit and context is not None:
                context.drain(shutdown_grace_seconds)
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            # An engine that cannot go on (a tensor-parallel rank lost) ends the server, non-zero.
            context = app.state.serving
            if context is not None and context.failure is not None:
                return True
            return await super().on_tick(counter)

    if (lora_modules or allow_runtime_lora_updating) and not config.enable_lora:
        config = dataclasses.replace(config, enable_lora=True)
    app = create_app(LLMEngine(config), served_model_name, chat_template, api_key, lora_modules,
                     allow_runtime_lora_updating, reasoning_parser, tool_call_parser, max_request_body_bytes,
                     enable_force_include_usage=enable_force_include_usage,
                     enable_tokenizer_info_endpoint=enable_tokenizer_info_endpoint,
                     enable_server_load_tracking=enable_server_load_tracking, root_path=root_path,
                     enable_prompt_tokens_details=enable_prompt_tokens_details,
                     enable_per_request_metrics=enable_per_request_metrics,
                     return_tokens_as_token_ids=return_tokens_as_token_ids,
                     enable_request_id_headers=enable_request_id_headers,
                     enable_sagemaker_sessions=enable_sagemaker_sessions,
                     trust_request_chat_template=trust_request_chat_template,
                     structured_outputs_in_reasoning=structured_outputs_in_reasoning)
    # The startup heap (torch, the model, the tokenizer: ~440k objects) lives as long as the server:
    # frozen, the full collections skip it. Each paused every stream and /health 0.25 s (as vLLM).
    gc.collect()
    gc.freeze()
    # uvicorn's own bound on the drain comes after ours: by then every request has ended.
    Server(uvicorn.Config(app, host=host, port=port, uds=uds,
                          timeout_graceful_shutdown=shutdown_grace_seconds + 5,
                          http=header_timeout_protocol(request_header_timeout_seconds),
                          log_level="info")).run()
    failure = app.state.engine_failure
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

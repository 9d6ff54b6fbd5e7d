"""The FastAPI application: /v1/completions, /v1/chat/completions (with SSE streaming),
/v1/models, /health, /metrics, and OpenAI-shaped errors."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.config import EngineConfig
from pagedkv.engine import LLMEngine
from pagedkv.errors import DuplicateRequestError, OverloadedError, PromptTooLongError
from pagedkv.outputs import RequestOutput
from pagedkv.server.engine_loop import EngineLoop
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("pagedkv.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: Optional[str] = None, code=None, headers=None):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_response(status: int, message: str, type_: str, param=None, code=None, headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(engine: LLMEngine, served_model_name: Optional[str] = None) -> FastAPI:
    """The app around an engine; the engine loop runs for the app's lifetime."""
    model_name = served_model_name or engine.model_name
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = EngineLoop(engine)
        metrics = ServerMetrics(lambda: loop.stats)
        loop.metrics = metrics
        state.update(loop=loop, metrics=metrics)
        loop.start()
        logger.info("serving %s", model_name)
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="pagedkv", lifespan=lifespan)
    app.state.pagedkv = state

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError):
        return error_response(error.status, error.message, error.type, error.param, error.code, error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = location[0] if location else None
        message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, message, "invalid_request_error", param)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "pagedkv"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(state["metrics"].render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        params = make_params(lambda: body.sampling_params(body.logprobs, 16))
        return await run(request, body.prompt, params, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        default_max = max(1, engine.max_model_len // 2)
        params = make_params(lambda: body.sampling_params(body.chat_logprobs(), default_max))
        messages = [{"role": message.role, "content": message.text()} for message in body.messages]
        try:
            prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:
            raise APIError(400, f"messages: cannot apply the chat template: {error}", "invalid_request_error", "messages")
        return await run(request, prompt, params, body, chat=True)

    def check_model(name: Optional[str]) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {model_name!r}",
                           "invalid_request_error", "model", "model_not_found")

    def make_params(build):
        try:
            return build()
        except ValueError as error:
            field = str(error).split(" ", 1)[0]
            raise APIError(400, str(error), "invalid_request_error", field)

    async def run(request: Request, prompt, params, body, chat: bool):
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if not body.stream:  # only the final output is sent: spare the engine per-step detokenizing
            params = dataclasses.replace(params, output_kind="final_only")
        try:
            outputs = await state["loop"].submit(request_id, prompt, params)
        except PromptTooLongError as error:
            raise APIError(400, str(error), "invalid_request_error", "messages" if chat else "prompt",
                           "context_length_exceeded")
        except OverloadedError as error:
            raise APIError(503, str(error), "server_overloaded", None, "overloaded", {"Retry-After": "1"})
        except DuplicateRequestError as error:
            raise APIError(409, str(error), "invalid_request_error")
        except ValueError as error:
            raise APIError(400, str(error), "invalid_request_error", "prompt")
        created = int(time.time())
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            chunks = stream_chunks(request_id, outputs, created, chat, include_usage, params.n)
            return StreamingResponse(guarded(request_id, chunks), media_type="text/event-stream")
        final = None
        try:
            while final is None or not final.finished:
                final = await next_output(outputs)
        finally:
            if final is None or not final.finished:
                state["loop"].abort(request_id)
        return full_response(request_id, final, created, chat)

    async def guarded(request_id: str, chunks: AsyncIterator[str]):
        """Aborts the request (freeing its blocks) if the client goes away mid-stream."""
        finished = False
        try:
            async for chunk in chunks:
                yield chunk
            finished = True
        finally:
            if not finished:
                state["loop"].abort(request_id)

    async def next_output(outputs) -> RequestOutput:
        item = await outputs.get()
        if isinstance(item, Exception):
            raise APIError(500, str(item), "server_error")
        return item

    async def stream_chunks(request_id, outputs, created, chat, include_usage, num_choices):
        sent: dict[int, int] = {}
        kind = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                     for i in range(num_choices)]
            yield sse({"id": request_id, "object": kind, "created": created, "model": model_name, "choices": first})
        while True:
            output = await next_output(outputs)
            choices = []
            for completion in output.outputs:
                text = completion.text
                delta = text[sent.get(completion.index, 0):]
                sent[completion.index] = len(text)
                if not delta and completion.finish_reason is None:
                    continue
                if chat:
                    choices.append({"index": completion.index, "delta": {"content": delta} if delta else {},
                                    "finish_reason": completion.finish_reason})
                else:
                    choices.append({"index": completion.index, "text": delta, "logprobs": None,
                                    "finish_reason": completion.finish_reason})
            if choices:
                yield sse({"id": request_id, "object": kind, "created": created, "model": model_name, "choices": choices})
            if output.finished:
                if include_usage:
                    yield sse({"id": request_id, "object": kind, "created": created, "model": model_name,
                               "choices": [], "usage": usage(output)})
                yield "data: [DONE]\n\n"
                return

    def full_response(request_id: str, output: RequestOutput, created: int, chat: bool) -> dict:
        choices = []
        for completion in output.outputs:
            if chat:
                choice = {"index": completion.index, "message": {"role": "assistant", "content": completion.text},
                          "finish_reason": completion.finish_reason, "logprobs": chat_logprobs(completion)}
            else:
                choice = {"index": completion.index, "text": completion.text,
                          "finish_reason": completion.finish_reason, "logprobs": completion_logprobs(completion)}
            choices.append(choice)
        return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": choices, "usage": usage(output)}

    def completion_logprobs(completion):
        if completion.logprobs is None:
            return None
        tokenizer = engine.tokenizer
        tokens = [tokenizer.decode([t]) for t in completion.token_ids]
        return {
            "tokens": tokens,
            "token_logprobs": [entry.get(t) for entry, t in zip(completion.logprobs, completion.token_ids)],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in entry.items()} for entry in completion.logprobs],
            "text_offset": [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))],
        }

    def chat_logprobs(completion):
        if completion.logprobs is None:
            return None
        decode = engine.tokenizer.decode
        content = []
        for entry, token in zip(completion.logprobs, completion.token_ids):
            content.append({
                "token": decode([token]),
                "logprob": entry.get(token),
                "top_logprobs": [{"token": decode([t]), "logprob": lp} for t, lp in entry.items() if t != token],
            })
        return {"content": content}

    def usage(output: RequestOutput) -> dict:
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        prompt_tokens = len(output.prompt_token_ids)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    return app


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, served_model_name=None) -> int:
    """Builds the engine and runs uvicorn until SIGINT/SIGTERM: stops accepting, lets in-flight
    requests finish (10 s), aborts the rest, and returns 0."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal after its graceful shutdown (exit status -15); a
            # completed graceful shutdown is a success, so only route the signals to it.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)
            yield

    app = create_app(LLMEngine(config), served_model_name)
    Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=10, log_level="info")).run()
    return 0

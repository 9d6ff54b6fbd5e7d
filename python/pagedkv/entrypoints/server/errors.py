"""The server's errors, all in OpenAI's JSON shape ({"error": {message, type, param, code}}):
APIError (what a route raises), what the engine's refusals become (`submit_error`), and the
app's exception handlers (validation errors are 400s naming the field, never 422)."""

from __future__ import annotations

import logging
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagedkv.errors import DuplicateRequestError, EngineStoppedError, OverloadedError, PromptTooLongError
from pagedkv.entrypoints.server.body_limit import RefusedBodyError
from pagedkv.entrypoints.server.protocol import RequestFieldError

logger = logging.getLogger("pagedkv.entrypoints.server")

# Engine ValueErrors that start with one of these name a sampling field; others are about the prompt.
SAMPLING_FIELDS = frozenset({"logit_bias", "stop_token_ids", "n", "structured_outputs", "priority", "allowed_token_ids",
                             "max_tokens", "logprobs", "logprob_token_ids"})
# Sampling fields a chat request calls by another name.
CHAT_FIELDS = {"logprobs": "top_logprobs"}
# Parts of a validation error's location that name a union's branch, not a field of the request.
_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "dict", "list"})


class APIError(Exception):
    """An answer other than success: its status, message, OpenAI error type, the request field
    at fault (`param`), a machine-readable `code` and extra headers."""

    def __init__(self, status: int, message: str, type_: str, param: Optional[str] = None, code=None, headers=None):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def too_many_tokens(field: str, count: int, max_model_len: int) -> APIError:
    """The 400 for token ids in `field` that cannot fit max_model_len (worded as the engine's refusal)."""
    return APIError(400, f"{field} has {count} tokens, more than max_model_len={max_model_len}",
                    "invalid_request_error", field, "context_length_exceeded")


def error_response(status: int, message: str, type_: str, param=None, code=None, headers=None) -> JSONResponse:
    """The error JSON every failure answers with."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def submit_error(error: Exception, chat: bool, prompt_field: str = "prompt") -> Exception:
    """What the engine's refusal to queue a request answers: a 400 naming the prompt field
    (`messages` for chat) or the sampling field at fault, 409 for a duplicate id; other errors
    (OverloadedError, EngineStoppedError: 503) pass through to their handlers."""
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


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can meet, answered as the error JSON."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError):
        return error_response(error.status, error.message, error.type, error.param, error.code, error.headers)

    @app.exception_handler(RefusedBodyError)
    async def refused_body(_: Request, error: RefusedBodyError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError):
        # Of a union's failed branches, the deepest error is the one that names the actual mistake.
        first = max(error.errors(), key=lambda detail: len(detail.get("loc", ())), default={})
        where = first.get("loc", ())
        location = [str(part) for part in where[1:] if "[" not in str(part) and part not in _TYPE_LABELS]
        param = where[1] if len(where) > 1 and isinstance(where[1], str) else None  # (not a JSON error's offset)
        # (pydantic's own `[type=...]`, as vLLM's message carries it: clients match on it)
        kind = f" [type={first['type']}]" if first.get("type") else ""
        message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}{kind}"
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

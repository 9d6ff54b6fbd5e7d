"""Large JSON bodies are parsed and validated on a worker thread: megabytes of token ids took
seconds of json.loads and of validating every value on the event loop, where every stream and
/health waited for them (FastAPI parses and validates the body on the loop before the handler).
Bodies of megabytes are screened in a child process first (server/body_screen.py): the thread
still holds the GIL while it parses, and a prompt too long for the model is refused unparsed."""

from __future__ import annotations

import json

import orjson
from typing import Any, Callable

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from pagedkv.entrypoints.server.body_screen import SCREEN_BYTES
from pagedkv.entrypoints.server.errors import too_many_tokens

# Bodies up to this size are parsed on the loop, as FastAPI does: a worker-thread hop costs more.
OFF_LOOP_BYTES = 256 << 10


class OffLoopJSONRoute(APIRoute):
    """An APIRoute whose large JSON body becomes its request model on a worker thread. FastAPI then
    finds the model where it reads the parsed body (Starlette's cache of `request.json()`) and
    accepts it as it is; a body that does not parse or validate is refused with FastAPI's own
    errors (RequestValidationError) or the request model's (RequestFieldError)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        # (Only a body that is one request model: FastAPI takes a model instance for that as it is.)
        one_model = self.body_field is not None and not getattr(self, "_embed_body_fields", True)

        async def parse_large_body_off_loop(request: Request) -> Any:
            if one_model and "json" in request.headers.get("content-type", "json"):
                body = await request.body()
                if len(body) > SCREEN_BYTES:
                    await self._screen(request, body)
                if len(body) > OFF_LOOP_BYTES:
                    parsed = await run_in_threadpool(self._parse_and_validate, body)
                    if parsed is not None:
                        request._json = parsed
            return await handler(request)

        return parse_large_body_off_loop

    async def _screen(self, request: Request, body: bytes) -> None:
        """Refuses, unparsed here, a body that is not JSON or holds a token-id prompt longer than
        max_model_len (see body_screen.py)."""
        serving = request.app.state.serving
        if serving is None:
            return
        fields = getattr(self.body_field.field_info.annotation, "TOKEN_ID_FIELDS", ())
        verdict = await request.app.state.body_screen.screened(body, fields, serving.max_model_len)
        if verdict is None:
            return
        if "json_error" in verdict:
            raise _json_error(*verdict["json_error"], body)
        raise too_many_tokens(verdict["field"], verdict["tokens"], serving.max_model_len)

    def _parse_and_validate(self, body: bytes) -> Any:
        """The body as the route's request model; None where FastAPI should refuse it itself (not
        UTF-8, nested too deep: it finds out as early in the body as this did)."""
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:  # (or JSON's extensions Python reads, NaN and 1e999; ints past 64 bits)
            try:
                parsed = json.loads(body)
            except json.JSONDecodeError as error:
                raise _json_error(error.pos, error.msg, error.doc) from None
            except (ValueError, RecursionError):
                return None
        value, errors = self.body_field.validate(parsed, {}, loc=("body",))
        if errors:
            raise RequestValidationError(errors, body=parsed)
        return value


def _json_error(position: int, message: str, document: Any) -> RequestValidationError:
    """FastAPI's error for a body that is not JSON, word for word."""
    return RequestValidationError([{"type": "json_invalid", "loc": ("body", position), "ctx": {"error": message},
                                    "msg": "JSON decode error", "input": {}}], body=document)

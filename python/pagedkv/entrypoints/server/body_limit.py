"""Bounds on how a request body arrives: one oversize request must not fill the server's memory
(a 50 MB JSON body costs gigabytes once parsed and tokenized), a body that stops arriving must
not hold its connection forever, and a request framed two ways is refused (request smuggling)."""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

# The default bound: far above any prompt a model's context holds, far below what hurts.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
# How long a body may pause between two of its parts before the request gets 408.
BODY_PAUSE_SECONDS = 15.0


class RefusedBodyError(HTTPException):
    """A request refused while its body was being read. (An HTTPException: FastAPI lets those out
    of its body reading unchanged, where any other error would become a 400.)"""

    code = "invalid_request"

    def response(self) -> JSONResponse:
        """The OpenAI-shaped error; the connection closes (the rest of the body is not read)."""
        error = {"message": self.detail, "type": "invalid_request_error", "param": None, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status_code, headers={"connection": "close"})


class BodyTooLargeError(RefusedBodyError):
    code = "request_too_large"

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body exceeds max_request_body_bytes={max_bytes}")


class BodyPausedError(RefusedBodyError):
    code = "request_timeout"

    def __init__(self, seconds: float):
        super().__init__(408, f"request body stopped arriving (nothing for {seconds:g} s)")


class AmbiguousFramingError(RefusedBodyError):
    def __init__(self):
        super().__init__(400, "a request may not carry both Content-Length and Transfer-Encoding (RFC 9112, 6.3)")


class BodySizeLimit:
    """ASGI middleware: a request whose body is longer than `max_bytes` gets 413 at once if its
    Content-Length says so, else (a chunked body) as soon as the bytes received pass the bound;
    a body that pauses longer than `pause_seconds` gets 408; Content-Length together with
    Transfer-Encoding gets 400. The app registers `RefusedBodyError.response` as the handler of
    the errors raised while the app reads the body."""

    def __init__(self, app, max_bytes: int, pause_seconds: float = BODY_PAUSE_SECONDS):
        self.app = app
        self.max_bytes = max_bytes
        self.pause_seconds = pause_seconds

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        names = [name for name, _ in scope["headers"]]
        if b"content-length" in names and b"transfer-encoding" in names:
            return await AmbiguousFramingError().response()(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await BodyTooLargeError(self.max_bytes).response()(scope, receive, send)
        received = 0
        body_done = False

        async def limited_receive():
            nonlocal received, body_done
            if body_done:  # (after the body, receive waits for a disconnect: no bound)
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.pause_seconds)
            except asyncio.TimeoutError:
                raise BodyPausedError(self.pause_seconds) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
                body_done = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)

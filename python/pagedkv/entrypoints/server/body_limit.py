"""A bound on request bodies: one oversize request must not fill the server's memory (a 50 MB
JSON body costs gigabytes once parsed and tokenized)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

# The default bound: far above any prompt a model's context holds, far below what hurts.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20


class BodyTooLargeError(HTTPException):
    """A request body passed the bound. (An HTTPException: FastAPI lets those out of its body
    reading unchanged, where any other error would become a 400.)"""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body exceeds max_request_body_bytes={max_bytes}")

    def response(self) -> JSONResponse:
        """The OpenAI-shaped 413 (the connection closes: the rest of the body is not read)."""
        error = {"message": self.detail, "type": "invalid_request_error", "param": None, "code": "request_too_large"}
        return JSONResponse({"error": error}, status_code=413, headers={"connection": "close"})


class BodySizeLimit:
    """ASGI middleware: a request whose body is longer than `max_bytes` gets 413 at once if its
    Content-Length says so, else (a chunked body) as soon as the bytes received pass the bound;
    the app registers `BodyTooLargeError.response` as the handler of the latter."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await BodyTooLargeError(self.max_bytes).response()(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)

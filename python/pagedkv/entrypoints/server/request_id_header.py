"""vLLM's --enable-request-id-headers: every answer carries `X-Request-Id`, the request's own or a
fresh 32-hex-digit one (the id a 500's message names is the same)."""

from __future__ import annotations

import uuid

_HEADER = b"x-request-id"


class RequestIdHeader:
    """ASGI middleware: a request without `X-Request-Id` gets one (so the routes and the error
    handlers see it) and its answer carries it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = list(scope["headers"])
        request_id = next((value for name, value in headers if name == _HEADER), None)
        if request_id is None:
            request_id = uuid.uuid4().hex.encode()
            scope = {**scope, "headers": [*headers, (_HEADER, request_id)]}

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                kept = [(name, value) for name, value in message.get("headers", []) if name.lower() != _HEADER]
                message = {**message, "headers": [*kept, (_HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)

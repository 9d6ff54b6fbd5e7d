"""A bound on how long a request's head may take to arrive: uvicorn closes idle keep-alive
connections, but a connection that sends part of a request line or headers and then nothing is
held forever, so a few hundred of them exhaust the server's sockets (a slowloris attack). The
body's pauses are bounded apart (body_limit.py)."""

from __future__ import annotations

import logging

logger = logging.getLogger("pagedkv.entrypoints.server")

DEFAULT_REQUEST_HEADER_TIMEOUT_SECONDS = 15.0

_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def header_timeout_protocol(seconds: float, base=None) -> type:
    """uvicorn's HTTP protocol class (`base`, else the one uvicorn picks: httptools where installed,
    else h11) with a deadline: a request's head must have fully arrived `seconds` after the
    connection opened, or on a kept-alive connection after its first bytes came (idle time between
    requests is uvicorn's keep-alive timeout's), else the client gets 408 and the connection
    closes. Pass it as `uvicorn.Config(http=...)`."""
    if base is None:
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base  # noqa: N813
        except ImportError:
            from uvicorn.protocols.http.h11_impl import H11Protocol as base  # noqa: N813

    class HeaderTimeoutProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_deadline = None
            self._await_head()

        def data_received(self, data: bytes) -> None:
            if self._head_deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._await_head()  # (the first bytes of the next request on a kept-alive connection)
            super().data_received(data)
            # uvicorn starts a request's cycle once its head is complete.
            if self._head_deadline is not None and self.cycle is not self._cycle_before_head:
                self._head_deadline.cancel()
                self._head_deadline = None

        def connection_lost(self, exc) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None
            super().connection_lost(exc)

        def _await_head(self) -> None:
            self._cycle_before_head = self.cycle
            self._head_deadline = self.loop.call_later(seconds, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._head_deadline = None
            if self.cycle is self._cycle_before_head and not self.transport.is_closing():
                logger.info("closed a connection whose request head did not arrive within %g s", seconds)
                self.transport.write(_TIMEOUT_RESPONSE)
                self.transport.close()

    HeaderTimeoutProtocol.__name__ = HeaderTimeoutProtocol.__qualname__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol

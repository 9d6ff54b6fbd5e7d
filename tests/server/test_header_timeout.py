"""Slow request heads: a connection whose request line and headers do not arrive within the
deadline gets 408 and is closed, on a fresh connection and on a kept-alive one (counted from the
next request's first bytes), while a request whose head arrives in time is served (uvicorn with `header_timeout_protocol`, a bare ASGI app)."""

import asyncio
import socket
import threading
import time

import pytest

from pagedkv.entrypoints.server.header_timeout import header_timeout_protocol

DEADLINE = 0.5


async def hello(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module", params=["h11", "httptools"])
def server_port(request):
    import uvicorn

    if request.param == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        base = pytest.importorskip("uvicorn.protocols.http.httptools_impl").HttpToolsProtocol
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(hello, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=30,
                            http=header_timeout_protocol(DEADLINE, base))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield port
    server.should_exit = True
    thread.join(10)


def read_until_closed(connection: socket.socket, limit: float = 10.0) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and when it closed it."""
    connection.settimeout(limit)
    received = b""
    while chunk := connection.recv(4096):
        received += chunk
    return received, time.monotonic()


def test_a_head_that_stops_arriving_gets_408_and_the_connection_closes(server_port):
    with socket.create_connection(("127.0.0.1", server_port)) as connection:
        started = time.monotonic()
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # (no blank line: the head never ends)
        received, closed = read_until_closed(connection)
    assert received.startswith(b"HTTP/1.1 408")
    assert DEADLINE <= closed - started < DEADLINE + 2


def test_a_head_sent_slowly_but_in_time_is_served(server_port):
    with socket.create_connection(("127.0.0.1", server_port)) as connection:
        for part in (b"GET / HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
            connection.sendall(part)
            time.sleep(DEADLINE / 4)
        connection.settimeout(5)
        assert connection.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(DEADLINE * 2)  # (idle between requests: uvicorn's keep-alive timeout, 30 s here, applies)
        # The next request on the kept-alive connection has the same deadline for its head.
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        received, closed = read_until_closed(connection)
    assert received.startswith(b"HTTP/1.1 408")
    assert closed - started < DEADLINE + 2

"""vLLM's load reports, for load balancers: GET /load counts the requests in flight on the routes
that use the engine (with --enable-server-load-tracking), and an answer to a request that asks
with `endpoint-load-metrics-format: text` or `json` carries the ORCA header `endpoint-load-metrics`
(the KV cache's usage and the requests waiting; the format gateways such as Envoy read)."""

from __future__ import annotations

import json
from typing import Callable, Optional

# The routes whose requests reach the engine (vLLM's list, for the routes pagedkv has).
ENGINE_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/classify",
                           "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/invocations",
                           "/v2/embed", "/v1/decisions"})


class ServerLoad:
    """The count /load answers: requests in flight on ENGINE_ROUTES, while tracking is on."""

    def __init__(self, tracking: bool):
        self.tracking = tracking
        self.in_flight = 0


def orca_header(metrics_format: str, stats: dict) -> Optional[tuple[bytes, bytes]]:
    """The `endpoint-load-metrics` header in ORCA's TEXT or JSON form; None for another format."""
    total, free = stats.get("num_device_blocks", 0), stats.get("num_free_device_blocks", 0)
    named = {"kv_cache_usage_perc": float((total - free) / max(total, 1)),
             "num_requests_waiting": float(stats.get("num_waiting", 0) + stats.get("num_swapped", 0))}
    if metrics_format.lower() == "text":
        value = "TEXT " + ", ".join(f"named_metrics.{name}={number}" for name, number in named.items())
    elif metrics_format.lower() == "json":
        value = "JSON " + json.dumps({"named_metrics": named})
    else:
        return None
    return b"endpoint-load-metrics", value.encode()


class LoadReports:
    """ASGI middleware: counts ENGINE_ROUTES requests from their start to the end of their answer
    (a stream's last byte) in `load`, and adds the ORCA header where a request asks for it."""

    def __init__(self, app, load: ServerLoad, stats_source: Callable[[], dict]):
        self.app = app
        self.load = load
        self.stats_source = stats_source

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", "") or "") or "/"
        if scope["type"] != "http" or path not in ENGINE_ROUTES:
            return await self.app(scope, receive, send)
        metrics_format = dict(scope["headers"]).get(b"endpoint-load-metrics-format", b"").decode("latin-1")
        if metrics_format:
            inner_send = send

            async def send(message):  # noqa: F811 (the answer's start gains the header)
                if message["type"] == "http.response.start":
                    header = orca_header(metrics_format, self.stats_source())
                    if header is not None:
                        message = {**message, "headers": [*message.get("headers", []), header]}
                await inner_send(message)

        if not self.load.tracking:
            return await self.app(scope, receive, send)
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1

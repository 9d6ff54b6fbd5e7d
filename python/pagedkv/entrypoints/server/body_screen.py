"""Bodies of megabytes are screened in a child process before this one parses them. Parsing holds
the GIL throughout (orjson, then the request model: ~1 s for 30 MB of token ids, a worker thread
does not help), so /health and every stream waited for a body that was then refused anyway: a
prompt of millions of token ids cannot fit max_model_len. The child parses the body and answers
with the first prompt over that bound (or the body's JSON error); only bodies that pass are
parsed here. One child serves the app's screens one at a time; it starts and stops with the app
(and again at the next large body if it failed: starting it then stalled the server ~0.15 s)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any, Optional

logger = logging.getLogger("pagedkv.entrypoints.server")

# Bodies above this size are screened (below it, parsing takes milliseconds).
SCREEN_BYTES = 1 << 20


class BodyScreen:
    """The app's screening child and its one-at-a-time protocol: a JSON header line (the body's
    length, the token-id fields, the bound), the body's bytes; the answer is one JSON line."""

    def __init__(self):
        self._child: Optional[asyncio.subprocess.Process] = None
        self._lock = asyncio.Lock()

    async def screened(self, body: bytes, token_id_fields: tuple[str, ...], max_model_len: int) -> Optional[dict]:
        """{"field", "tokens"} for the first prompt in `token_id_fields` with more than
        `max_model_len` token ids (unless the body asks to truncate prompts), {"json_error":
        [position, message]} for a body that is not JSON, else None: parse it here. A child that
        fails (or a request cancelled mid-screen) is stopped; the body is then parsed here."""
        async with self._lock:
            try:
                child = await self.start()
                header = {"length": len(body), "fields": list(token_id_fields), "max_model_len": max_model_len}
                child.stdin.write(json.dumps(header).encode() + b"\n")
                child.stdin.write(body)
                await child.stdin.drain()
                answer = await child.stdout.readline()
                return json.loads(answer) if answer else self._failed("closed its output")
            except (OSError, ValueError) as error:
                return self._failed(repr(error))
            except BaseException:  # (cancelled between header and answer: the protocol is lost)
                await self.close()
                raise

    async def close(self) -> None:
        child, self._child = self._child, None
        if child is not None and child.returncode is None:
            child.kill()
            await child.wait()

    async def start(self) -> asyncio.subprocess.Process:
        """The running child, started if it is not (OSError if it cannot be)."""
        if self._child is None or self._child.returncode is not None:
            self._child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", __name__, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        return self._child

    def _failed(self, why: str) -> None:
        logger.warning("the body screening child failed (%s); large bodies are parsed in the server until it restarts", why)
        if self._child is not None and self._child.returncode is None:
            self._child.kill()
        self._child = None
        return None


def screen(body: bytes, token_id_fields: list[str], max_model_len: int) -> Optional[dict]:
    """The child's verdict on one body (see BodyScreen.screened)."""
    import orjson

    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:  # (also JSON's extensions Python reads: NaN, 1e999, ints past 64 bits)
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError as error:
            return {"json_error": [error.pos, error.msg]}
        except (ValueError, RecursionError):
            return None
    if not isinstance(parsed, dict) or parsed.get("truncate_prompt_tokens") is not None:
        return None
    for field in token_id_fields:
        value = parsed.get(field)
        if not isinstance(value, list) or not value:
            continue
        prompts = [value] if isinstance(value[0], int) else [item for item in value if isinstance(item, list)]
        for prompt in prompts:
            if len(prompt) > max_model_len:
                return {"field": field, "tokens": len(prompt)}
    return None


def serve_screens() -> None:
    """The child: screens bodies from stdin until it closes."""
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while header := source.readline():
        request = json.loads(header)
        body = source.read(request["length"])
        sink.write(json.dumps(screen(body, request["fields"], request["max_model_len"])).encode() + b"\n")
        sink.flush()


if __name__ == "__main__":
    serve_screens()

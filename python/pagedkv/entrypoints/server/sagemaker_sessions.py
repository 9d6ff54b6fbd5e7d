"""SageMaker's stateful sessions, as vLLM serves them (its `model_hosting_container_standards`):
POST /invocations {"requestType": "NEW_SESSION"} opens one (its id and expiry in
`X-Amzn-SageMaker-New-Session-Id`), {"requestType": "CLOSE"} with `X-Amzn-SageMaker-Session-Id`
closes it, and an invocation that names a session must name an open one. Sessions hold no state
here: the platform uses them to send a client's requests to the same instance, where the prefix
cache keeps its conversation."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Literal

from pydantic import BaseModel, ConfigDict

SESSION_ID = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_ID = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION_ID = "X-Amzn-SageMaker-Closed-Session-Id"
DEFAULT_LIFETIME_SECONDS = 20 * 60  # (the standard's)
MAX_SESSIONS = 100_000  # (beyond it, opening one is refused: memory stays bounded)


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    requestType: Literal["NEW_SESSION", "CLOSE"]


class SessionStore:
    """Open sessions' expiry times, in memory (the standard keeps them on disk; nothing is stored in them)."""

    def __init__(self, lifetime_seconds: float = DEFAULT_LIFETIME_SECONDS):
        self.lifetime_seconds = lifetime_seconds
        self._expiries: dict[str, float] = {}
        self._lock = threading.Lock()

    def open(self) -> tuple[str, str]:
        """A new session's id and the `X-Amzn-SageMaker-New-Session-Id` value announcing it."""
        with self._lock:
            self._forget_expired()
            if len(self._expiries) >= MAX_SESSIONS:
                raise ValueError(f"{MAX_SESSIONS} sessions are open; close one first")
            session_id, expires = str(uuid.uuid4()), time.time() + self.lifetime_seconds
            self._expiries[session_id] = expires
        stamp = datetime.fromtimestamp(expires, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return session_id, f"{session_id}; Expires={stamp}"

    def check(self, session_id: str) -> None:
        """Raises ValueError unless `session_id` is open (an expired one is closed now)."""
        with self._lock:
            expires = self._expiries.get(session_id)
            if expires is not None and time.time() > expires:
                del self._expiries[session_id]
                expires = None
        if expires is None:
            raise ValueError(f"session not found: {session_id}")

    def close(self, session_id: str) -> None:
        with self._lock:
            if self._expiries.pop(session_id, None) is None:
                raise ValueError(f"session not found: {session_id}")

    def _forget_expired(self) -> None:
        now = time.time()
        for session_id in [known for known, expires in self._expiries.items() if now > expires]:
            del self._expiries[session_id]

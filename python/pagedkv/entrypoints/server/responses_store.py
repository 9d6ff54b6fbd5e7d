"""Stored responses of OpenAI's Responses API: a response created with `store` (the default) can
be read back (GET /v1/responses/{id}) and continued (`previous_response_id`: its conversation,
input and output, comes before the new input). Kept in memory, the newest `max_entries` only. A
`background` response is stored at once (status "queued") and again as it ends; its task is kept
here until then, so that POST /v1/responses/{id}/cancel can stop it."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import NamedTuple, Optional

DEFAULT_MAX_STORED_RESPONSES = 1024


class StoredResponse(NamedTuple):
    body: dict  # the response object as it was answered
    conversation: list  # ChatMessages: every input and output turn so far, without instructions


class ResponseStore:
    """The newest `max_entries` stored responses by id (the oldest go first)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES):
        self.max_entries = max_entries
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self.running: dict[str, asyncio.Task] = {}  # background responses not ended yet

    def put(self, response_id: str, body: dict, conversation: list) -> None:
        self._responses[response_id] = StoredResponse(body, conversation)
        while len(self._responses) > self.max_entries:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        return self._responses.get(response_id)

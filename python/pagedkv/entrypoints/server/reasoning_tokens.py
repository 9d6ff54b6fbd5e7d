"""How many of a reply's tokens are reasoning: vLLM's `usage.completion_tokens_details.reasoning_tokens`
(chat) and `output_tokens_details.reasoning_tokens` (Responses), with a reasoning parser on.

Counted over token ids as they arrive, by the parts `ReasoningParser.split` makes of the text:
tokens inside the think block (its `<think>` / `</think>` markers are not reasoning), or GPT-OSS's
`analysis` messages. A marker is found as the token ids the tokenizer writes it with (one special
token in the models that use it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pagedkv.entrypoints.server.reasoning import CHANNEL, END, HARMONY_ENDS, MESSAGE, START, ReasoningParser

TOOL_CALL_START = "<tool_call>"


@dataclass(frozen=True)
class ReasoningMarkers:
    """The reasoning parsers' markers as one tokenizer writes them (encoded once, at startup)."""

    think_start: list[int]
    think_end: list[int]
    harmony_message: list[int]
    harmony_ends: list[list[int]]
    decode: Callable[[list[int]], str]
    # `<tool_call>` where the vocabulary has it as one token (qwen3's implicit end of reasoning)
    tool_call_start: tuple[int, ...] = ()

    @classmethod
    def of(cls, tokenizer) -> "ReasoningMarkers":
        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        tool_call = encode(TOOL_CALL_START)
        return cls(encode(START), encode(END), encode(MESSAGE), [encode(marker) for marker in HARMONY_ENDS],
                   tokenizer.decode, tuple(tool_call) if len(tool_call) == 1 else ())


class ReasoningTokenCounter:
    """One reply's reasoning tokens so far (`count`); `add` its next token ids."""

    def __init__(self, parser: ReasoningParser, markers: ReasoningMarkers):
        self.parser, self.count = parser.name, 0
        self._ids: list[int] = []
        if self.parser == "openai_gptoss":
            self._decode = markers.decode
            self._message, self._ends = markers.harmony_message, markers.harmony_ends
            self._header_start = 0  # where the current message's header begins (in _ids)
            self._in_body: bool = False
            self._body_is_reasoning = False
        else:
            self._start, self._end = markers.think_start, markers.think_end
            # deepseek_r1: reasoning from the first token; qwen3: only in a block the reply opens
            # (or, a reply that closes one it never opened: all before the close, counted then)
            self._state = "reasoning" if self.parser == "deepseek_r1" else "undecided"
            self._unopened = 0  # qwen3: tokens before any marker

    def add(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            self._ids.append(token_id)
            if self.parser == "openai_gptoss":
                self._harmony_step()
            else:
                self._think_step()

    def _ends_with(self, marker: list[int]) -> bool:
        return bool(marker) and self._ids[-len(marker):] == marker

    def _think_step(self) -> None:
        if self._state == "content":
            return
        if self._ends_with(self._end):
            closing = len(self._end) - 1  # (its other tokens were counted as they came)
            if self._state == "undecided":
                self.count = self._unopened - closing
            else:
                self.count -= closing
            self._state = "content"
            return
        if len(self._ids) == len(self._start) and self._ids == self._start:  # (a block the reply opens)
            self.count -= len(self._start) - 1 if self._state == "reasoning" else 0
            self._state = "reasoning"
            return
        if self._state == "reasoning":
            self.count += 1
        else:
            self._unopened += 1

    def _harmony_step(self) -> None:
        ids = self._ids
        if not self._in_body:
            if self._ends_with(self._message):
                header = self._decode(ids[self._header_start:len(ids) - len(self._message)])
                channel_at = header.find(CHANNEL)
                channel = header[channel_at + len(CHANNEL):].strip() if channel_at >= 0 else ""
                self._body_is_reasoning = channel.startswith("analysis") and " to=" not in header
                self._in_body = True
            return
        ended = next((marker for marker in self._ends if self._ends_with(marker)), None)
        if ended is not None:
            if self._body_is_reasoning:
                self.count -= len(ended) - 1
            self._in_body, self._header_start = False, len(ids)
        elif self._body_is_reasoning:
            self.count += 1


def count_reasoning_tokens(parser: ReasoningParser, markers: ReasoningMarkers, token_ids: list[int]) -> int:
    """The reasoning tokens of a whole reply."""
    counter = ReasoningTokenCounter(parser, markers)
    counter.add(token_ids)
    return counter.count

"""Bodies and stream events of OpenAI's Responses API (/v1/responses) from engine outputs.

A reply becomes output items: a `reasoning` item (with a reasoning parser), a `message` item
with one `output_text` part, and a `function_call` item per tool call. Streamed, the items open,
grow by deltas and close in that order, between `response.created` / `response.in_progress` and
`response.completed`, every event numbered by `sequence_number`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional

from pagedkv.entrypoints.server.protocol import ChatMessage, FunctionCall, ToolCall, flat_tool_name
from pagedkv.entrypoints.server.reasoning import ReasoningParser
from pagedkv.entrypoints.server.tools import ToolCalling


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseState:
    """One response, built up from its growing reply text (whole, or streamed as events)."""

    def __init__(self, model: str, request, reasoning: Optional[ReasoningParser], tools: Optional[ToolCalling]):
        self.id, self.created_at, self.model, self.request = _id("resp"), time.time(), model, request
        self.reasoning, self.tools = reasoning, tools
        self.items: list[dict] = []  # output items, in order
        self.sent = {"reasoning": 0, "content": 0}
        self.open_kind: Optional[str] = None  # the item still growing: "reasoning" or "message"
        self.sequence_number = 0
        # Logprob entries of tokens whose text has not gone out yet (`include` asked for them): they
        # join the next output_text delta, and the message's part
        self.pending_logprobs: list[dict] = []
        # vLLM's enable_response_messages: the prompt and the reply as raw text and token ids
        self.raw_messages: dict = {}

    # -- whole ------------------------------------------------------------------------------------
    def body(self, status: str, finish_reason: Optional[str] = None, usage: Optional[dict] = None) -> dict:
        request = self.request
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "incomplete_details": incomplete, "error": None, "output": self.items,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p, "metadata": request.metadata or {},
            "parallel_tool_calls": request.parallel_tool_calls is not False, **request.echoed_fields(), "store": request.store,
            "previous_response_id": request.previous_response_id, "background": request.background, "usage": usage,
            **self.raw_messages,
        }

    def keep_raw_messages(self, output, text: str, token_ids: list[int]) -> None:
        """With enable_response_messages, the body carries the prompt (`output`'s) and the reply
        (`text`, `token_ids`) as vLLM's raw_message_tokens."""
        if self.request.enable_response_messages:
            self.raw_messages = {
                "input_messages": [_raw_message(output.prompt or "", output.prompt_token_ids)],
                "output_messages": [_raw_message(text, token_ids)],
            }

    def reply_messages(self) -> list[ChatMessage]:
        """The reply as chat turns (for a stored conversation): its text, then its tool calls."""
        text = "".join(item["content"][0]["text"] for item in self.items if item["type"] == "message")
        calls = [ToolCall(id=item["call_id"], function=FunctionCall(name=flat_tool_name(item["name"], item.get("namespace")),
                                                                        arguments=item["arguments"]))
                 for item in self.items if item["type"] == "function_call"]
        return [ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)]

    def complete(self, text: str, finish_reason: Optional[str], usage: dict, logprobs: Optional[list] = None) -> dict:
        """The whole response of a finished reply (`logprobs`: its tokens' entries, where asked)."""
        self.pending_logprobs += logprobs or []
        for _ in self.update(text, finish_reason, finished=True):
            pass
        return self.body("completed", finish_reason, usage)

    # -- streamed ---------------------------------------------------------------------------------
    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def start(self) -> list[str]:
        snapshot = self.body("in_progress")
        return [self.event("response.created", response=snapshot), self.event("response.in_progress", response=snapshot)]

    def update(self, text: str, finish_reason: Optional[str], finished: bool) -> list[str]:
        """Events for what the reply's text added (all remaining ones once `finished`)."""
        reasoning, content = self.reasoning.split(text, finished) if self.reasoning else ("", text)
        events = []
        if len(reasoning) > self.sent["reasoning"]:
            events += self._grow("reasoning", reasoning[self.sent["reasoning"]:])
            self.sent["reasoning"] = len(reasoning)
        calls = []
        if self.tools is None:
            end = len(content)
        elif not finished:
            end = self.tools.streamable_len(content)
        else:
            content, calls, _ = self.tools.parse(content, finish_reason)
            content = content or ""
            end = len(content)
        if end > self.sent["content"]:
            events += self._grow("message", content[self.sent["content"]:end])
            self.sent["content"] = end
        if finished:
            if not calls and not any(item["type"] == "message" for item in self.items):
                events += self._grow("message", "")  # an empty reply is still a message
            messages = [item for item in self.items if item["type"] == "message"]
            if messages and self.pending_logprobs:  # (tokens whose text came out as tool calls or reasoning)
                messages[-1]["content"][0]["logprobs"] += self.pending_logprobs
            self.pending_logprobs = []
            events += self._close()
            for call in calls:
                namespace, name = self.request.split_tool_name(call["function"]["name"])
                item = {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "status": "completed",
                        "name": name, "arguments": call["function"]["arguments"]}
                if namespace is not None:
                    item["namespace"] = namespace
                index = len(self.items)
                self.items.append(item)
                # (as OpenAI streams a call: the item opens empty, its arguments arrive as deltas,
                # here one, since calls are read from the whole reply)
                events.append(self.event("response.output_item.added", output_index=index,
                                         item={**item, "arguments": "", "status": "in_progress"}))
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=index, delta=item["arguments"]))
                events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=index, arguments=item["arguments"]))
                events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def finish(self, finish_reason: Optional[str], usage: dict) -> list[str]:
        """The closing event; `final_body` keeps the response it carries."""
        body = self.final_body = self.body("completed", finish_reason, usage)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [self.event(kind, response=body)]

    def _grow(self, kind: str, delta: str) -> list[str]:
        events = []
        if self.open_kind != kind:
            events += self._close()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress",
                        "content": [{"type": "reasoning_text", "text": ""}]}
            else:
                item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress",
                        "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
            self.items.append(item)
            self.open_kind = kind
            index = len(self.items) - 1
            events.append(self.event("response.output_item.added", output_index=index, item=_copy(item)))
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=dict(item["content"][0])))
        item, index = self.items[-1], len(self.items) - 1
        item["content"][0]["text"] += delta
        kind_name = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {}
        if kind != "reasoning":
            extra["logprobs"], self.pending_logprobs = self.pending_logprobs, []
            item["content"][0]["logprobs"] += extra["logprobs"]
        events.append(self.event(f"response.{kind_name}.delta", item_id=item["id"], output_index=index,
                                 content_index=0, delta=delta, **extra))
        return events

    def _close(self) -> list[str]:
        if self.open_kind is None:
            return []
        item, index = self.items[-1], len(self.items) - 1
        kind_name = "reasoning_text" if self.open_kind == "reasoning" else "output_text"
        self.open_kind = None
        item["status"] = "completed"
        part = item["content"][0]
        return [
            self.event(f"response.{kind_name}.done", item_id=item["id"], output_index=index, content_index=0,
                       text=part["text"]),
            self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                       part=dict(part)),
            self.event("response.output_item.done", output_index=index, item=_copy(item)),
        ]


def _raw_message(text: str, token_ids: list[int]) -> dict:
    return {"type": "raw_message_tokens", "message": text, "tokens": list(token_ids)}


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


def usage(output, output_tokens: Optional[int] = None, reasoning_tokens: int = 0) -> dict:
    """The Responses API's usage of one finished RequestOutput (`output_tokens`: counted by the
    caller where the output holds only its last tokens; `reasoning_tokens`: those of its reasoning)."""
    input_tokens = output.num_prompt_tokens
    if output_tokens is None:
        output_tokens = len(output.outputs[0].token_ids)
    cached = getattr(output.metrics, "num_prefix_hit_tokens", 0) if output.metrics is not None else 0
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached or 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}

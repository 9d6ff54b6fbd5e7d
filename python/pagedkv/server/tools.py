"""OpenAI tool calling for chat completions: `tools` and `tool_choice` ("none", "auto",
"required" or {"type": "function", "function": {"name": ...}}).

A named function or "required" constrains the output with a JSON schema (structured outputs),
so the call is well-formed whatever the model: the named function's arguments, or a list of
{"name", "parameters"} calls to the given tools (as vLLM does). With "auto" the model writes
text, and Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in it
become tool calls. The tools reach the model through its chat template.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional, Union

from pagedkv.structured_output import StructuredOutputsParams

_HERMES_TAG = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


@dataclass
class ToolCalling:
    """The tools of one request and how the output becomes tool calls."""

    functions: dict[str, dict]  # name -> parameters schema
    choice: Union[str, dict]  # "auto", "required" or the name of the forced function

    @classmethod
    def from_request(cls, tools: Optional[list[dict]], tool_choice) -> Optional["ToolCalling"]:
        """None when the request does not call tools. Raises ValueError naming the field."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise ValueError("tool_choice needs tools")
            return None
        functions = {}
        for tool in tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if tool.get("type", "function") != "function" or not isinstance(function, dict) or not function.get("name"):
                raise ValueError(f"tools must be {{'type': 'function', 'function': {{'name': ...}}}} entries, got {tool!r}")
            functions[function["name"]] = function.get("parameters") or {"type": "object", "properties": {}}
        if tool_choice in (None, "auto"):
            return cls(functions, "auto")
        if tool_choice == "none":
            return None
        if tool_choice == "required":
            return cls(functions, "required")
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
        if name not in functions:
            raise ValueError(f"tool_choice must be none, auto, required or one of the tools' names, got {tool_choice!r}")
        return cls(functions, {"name": name})

    @property
    def constrained(self) -> bool:
        return self.choice != "auto"

    def constraint(self) -> Optional[StructuredOutputsParams]:
        if isinstance(self.choice, dict):
            return StructuredOutputsParams(json=self.functions[self.choice["name"]])
        if self.choice == "required":
            calls = [
                {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                 "required": ["name", "parameters"]}
                for name, schema in self.functions.items()
            ]
            return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})
        return None

    def streamable_len(self, text: str) -> int:
        """How much of a growing output can be streamed as content: none of a constrained call,
        and with "auto" the text before a tool-call tag (or before what may become one)."""
        if self.constrained:
            return 0
        tag = text.find(_HERMES_TAG)
        if tag >= 0:
            return tag
        for length in range(min(len(_HERMES_TAG) - 1, len(text)), 0, -1):
            if text.endswith(_HERMES_TAG[:length]):
                return len(text) - length
        return len(text)

    def finish_stream(self, text: str, sent: int, finish_reason: Optional[str]) -> tuple[str, list[dict], Optional[str]]:
        """(content not streamed yet, tool calls, finish_reason) of a finished streamed output
        whose first `sent` characters went out as content."""
        _, calls, reason = self.parse(text, finish_reason)
        if not calls:
            return text[sent:], [], reason
        return ("" if self.constrained else _HERMES_CALL.sub("", text[sent:]).strip()), calls, reason

    def parse(self, text: str, finish_reason: Optional[str]) -> tuple[Optional[str], list[dict], Optional[str]]:
        """(content, tool calls, finish_reason) of a finished output. Text that does not parse
        (cut off by max_tokens, say) stays content, with no tool calls."""
        if isinstance(self.choice, dict):
            try:
                json.loads(text)
            except ValueError:
                return text, [], finish_reason
            return None, [_call(self.choice["name"], text)], finish_reason
        if self.choice == "required":
            try:
                calls = [_call(call["name"], json.dumps(call["parameters"])) for call in json.loads(text)]
            except (ValueError, KeyError, TypeError):
                return text, [], finish_reason
            return None, calls, "tool_calls"
        calls = []
        for match in _HERMES_CALL.finditer(text):
            try:
                call = json.loads(match.group(1))
                name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
            except (ValueError, KeyError, TypeError):
                continue
            if name in self.functions:
                calls.append(_call(name, arguments if isinstance(arguments, str) else json.dumps(arguments)))
        if not calls:
            return text, [], finish_reason
        content = _HERMES_CALL.sub("", text).strip()
        return content or None, calls, "tool_calls"


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}

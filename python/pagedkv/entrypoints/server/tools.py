"""OpenAI tool calling for chat completions: `tools` and `tool_choice` ("none", "auto",
"required" or {"type": "function", "function": {"name": ...}}).

A named function or "required" constrains the output with a JSON schema (structured outputs),
so the call is well-formed whatever the model: the named function's arguments, or a list of
{"name", "parameters"} calls to the given tools (as vLLM does). With "auto" the model writes
text, and the server's tool-call parser (vLLM's `--tool-call-parser`) finds the calls in it:

- `hermes` (Qwen, Hermes, SmolLM3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks;
- `llama3_json` (Llama 3.1+): the reply is one JSON call `{"name": ..., "parameters": {...}}` (or
  several separated by `;`), optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` calls, or (newer
  tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call;
- `openai` (GPT-OSS, with `--reasoning-parser openai_gptoss`): harmony messages to a tool,
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`.

The tools reach the model through its chat template.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional, Union

from pagedkv.params.structured_output import StructuredOutputsParams

PARSERS = ("hermes", "llama3_json", "mistral", "openai")
_HERMES_TAG = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_TAG = "[TOOL_CALLS]"
_HARMONY_TAG = "<|"  # what starts a harmony tool message left in the content
_HARMONY_CALL = re.compile(r"to=functions\.([^\s<]+)[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>(.*?)(?=<\||$)", re.S)


@dataclass
class ToolCalling:
    """The tools of one request and how the output becomes tool calls."""

    functions: dict[str, dict]  # name -> parameters schema
    choice: Union[str, dict]  # "auto", "required" or the name of the forced function
    parser: str = "hermes"  # how "auto" finds calls in the text (PARSERS)
    parallel: bool = True  # false: a reply's first call only (the request's parallel_tool_calls)

    @classmethod
    def from_request(cls, tools: Optional[list[dict]], tool_choice, parser: str = "hermes",
                     parallel: bool = True) -> Optional["ToolCalling"]:
        """None when the request does not call tools. Raises ValueError naming the field."""
        if parser not in PARSERS:
            raise ValueError(f"tool-call parser must be one of {PARSERS}, got {parser!r}")
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
            return cls(functions, "auto", parser, parallel)
        if tool_choice == "none":
            return None
        if tool_choice == "required":
            return cls(functions, "required", parser, parallel)
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
        if name not in functions:
            raise ValueError(f"tool_choice must be none, auto, required or one of the tools' names, got {tool_choice!r}")
        return cls(functions, {"name": name}, parser, parallel)

    @property
    def constrained(self) -> bool:
        return self.choice != "auto"

    def constraint(self) -> Optional[StructuredOutputsParams]:
        if isinstance(self.choice, dict):
            return StructuredOutputsParams(json=self.functions[self.choice["name"]])
        if self.choice == "required":
            calls, definitions = [], {}
            for name, schema in self.functions.items():
                # (each tool's $defs move to the root, where its "#/$defs/..." references now point)
                schema = dict(schema)
                for key, definition in schema.pop("$defs", {}).items():
                    if definitions.setdefault(key, definition) != definition:
                        raise ValueError(f"tools define $defs {key!r} twice, differently")
                calls.append({"type": "object", "required": ["name", "parameters"],
                              "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema}})
            combined = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if definitions:
                combined["$defs"] = definitions
            return StructuredOutputsParams(json=combined)
        return None

    def streamable_len(self, text: str) -> int:
        """How much of a growing output can be streamed as content: none of a constrained call,
        and with "auto" the text before a tool-call tag (or before what may become one)."""
        if self.constrained:
            return 0
        if self.parser == "llama3_json":
            # A call is the whole reply: hold back a reply that starts like one.
            start = text.lstrip()
            if start.startswith(("{", _PYTHON_TAG)) or (start and _PYTHON_TAG.startswith(start)):
                return 0
            return len(text)
        tag = {"hermes": _HERMES_TAG, "mistral": _MISTRAL_TAG, "openai": _HARMONY_TAG}[self.parser]
        found = text.find(tag)
        if found >= 0:
            return found
        for length in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:length]):
                return len(text) - length
        return len(text)

    def finish_stream(self, text: str, sent: int, finish_reason: Optional[str]) -> tuple[str, list[dict], Optional[str]]:
        """(content not streamed yet, tool calls, finish_reason) of a finished streamed output
        whose first `sent` characters went out as content."""
        content, calls, reason = self.parse(text, finish_reason)
        if not calls:
            return text[sent:], [], reason
        return ("" if self.constrained else (content or "")[sent:].strip()), calls, reason

    def parse(self, text: str, finish_reason: Optional[str]) -> tuple[Optional[str], list[dict], Optional[str]]:
        """(content, tool calls, finish_reason) of a finished output: `_parse`'s, the first call
        only unless `parallel`."""
        content, calls, reason = self._parse(text, finish_reason)
        return content, calls if self.parallel else calls[:1], reason

    def _parse(self, text: str, finish_reason: Optional[str]) -> tuple[Optional[str], list[dict], Optional[str]]:
        """A named function's call is its text, whole or cut off by max_tokens (finish_reason
        "length" says so, as in vLLM); otherwise text that does not parse stays content, with no
        tool calls."""
        if isinstance(self.choice, dict):
            return None, [_call(self.choice["name"], text)], finish_reason
        if self.choice == "required":
            try:
                calls = [_call(call["name"], json.dumps(call["parameters"])) for call in json.loads(text)]
            except (ValueError, KeyError, TypeError):
                return text, [], finish_reason
            return None, calls, "tool_calls"
        parsers = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral, "openai": _harmony}
        content, found = parsers[self.parser](text)
        calls = []
        for name, arguments in found:
            if name in self.functions:
                calls.append(_call(name, arguments if isinstance(arguments, str) else json.dumps(arguments)))
        if not calls:
            return text, [], finish_reason
        return content.strip() or None, calls, "tool_calls"


def _hermes(text: str) -> tuple[str, list[tuple]]:
    """(text around the calls, [(name, arguments)]) of `<tool_call>` blocks."""
    found = []
    for match in _HERMES_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            found.append((call["name"], call.get("arguments", call.get("parameters", {}))))
        except (ValueError, KeyError, TypeError):
            continue
    return _HERMES_CALL.sub("", text), found


def _llama3_json(text: str) -> tuple[str, list[tuple]]:
    """A reply that is nothing but calls: `{"name", "parameters"}` objects separated by `;`."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):]
    found = []
    decoder = json.JSONDecoder()
    position = 0
    try:
        while position < len(body):
            call, end = decoder.raw_decode(body, position)
            found.append((call["name"], call.get("parameters", call.get("arguments", {}))))
            position = end
            while position < len(body) and body[position] in " \n\t;":
                position += 1
    except (ValueError, KeyError, TypeError):
        return text, []
    return "", found


def _mistral(text: str) -> tuple[str, list[tuple]]:
    """`[TOOL_CALLS]` then a JSON list of calls, or `[TOOL_CALLS]name[ARGS]{...}` per call."""
    tag = text.find(_MISTRAL_TAG)
    if tag < 0:
        return text, []
    found = []
    decoder = json.JSONDecoder()
    try:
        for part in text[tag:].split(_MISTRAL_TAG)[1:]:
            part = part.strip()
            if "[ARGS]" in part:
                name, arguments = part.split("[ARGS]", 1)
                found.append((name.strip(), decoder.raw_decode(arguments.strip())[0]))
            else:
                for call in decoder.raw_decode(part)[0]:
                    found.append((call["name"], call.get("arguments", call.get("parameters", {}))))
    except (ValueError, KeyError, TypeError):
        return text, []
    return text[:tag], found


def _harmony(text: str) -> tuple[str, list[tuple]]:
    """Harmony tool messages (the content before the first is the text)."""
    found = []
    for match in _HARMONY_CALL.finditer(text):
        try:
            found.append((match.group(1), json.loads(match.group(2))))
        except ValueError:
            continue
    start = text.find(_HARMONY_TAG)
    return (text if start < 0 else text[:start]), found


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}

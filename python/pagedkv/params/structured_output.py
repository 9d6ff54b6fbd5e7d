"""Structured outputs: generation constrained to a JSON schema, any JSON, a regex, a choice of
strings or an EBNF grammar, through xgrammar (the grammar engine vLLM uses).

Each constrained sequence owns a `GrammarMatcher`; before sampling, the sampler masks every
token its grammar does not allow next, and each sampled token advances the matcher. Once the
grammar is complete only the end-of-sequence tokens are allowed, so the sequence stops there.
With `after_reasoning` (the server sets it where a reasoning parser is on, as vLLM does) the
grammar starts once the reply's reasoning has ended: a thinking model thinks freely first.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's `StructuredOutputsParams`); set exactly one field.

    json: a JSON schema (dict or string); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: one of these strings; grammar: an EBNF grammar
    (llama.cpp's GBNF dialect) whose start rule is `root`.
    """

    json: Optional[Union[str, dict]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    # Where the grammar starts when not at the first token (vLLM's with --reasoning-parser). Not
    # part of the constraint: `key` leaves it out.
    after_reasoning: Optional["AfterReasoning"] = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                f"got {given or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or any(not isinstance(option, str) or not option for option in self.choice)
        ):
            raise ValueError(f"structured_outputs choice must be a non-empty list of non-empty strings, got {self.choice!r}")
        if self.json is not None:
            check_local_refs(self.json)

    def key(self) -> tuple:
        """A hashable description of the constraint (compiled grammars are cached by it)."""
        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return ("json", schema)
        if self.json_object:
            return ("json_object",)
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", tuple(self.choice))
        return ("grammar", self.grammar)


@dataclass(frozen=True)
class ReasoningEnd:
    """What ends a reply's reasoning: the output writing `marker` (`</think>`), or one of the
    `implicit` tokens, which end it and are also the grammar's first token (qwen3's `<tool_call>`:
    vLLM's implicit reasoning end)."""

    marker: tuple[int, ...]
    implicit: tuple[int, ...] = ()


@dataclass(frozen=True)
class AfterReasoning:
    """The grammar waits for the reasoning to end (`end`), unless `prompt_ends_reasoning(prompt
    ids)` says the prompt already ended it (a template that writes an empty think block, thinking
    turned off). Until then every token is allowed (but an implicit end the grammar could not
    start with) and none advances the grammar (vLLM's structured outputs with a reasoning parser,
    `enable_in_reasoning` off)."""

    end: ReasoningEnd
    prompt_ends_reasoning: Callable[[list[int]], bool]

    def __post_init__(self) -> None:
        if not self.end.marker:
            raise ValueError("after_reasoning needs the reasoning's end marker as token ids")

    def awaited(self, prompt_token_ids: list[int]) -> Optional[ReasoningEnd]:
        """The end a request's grammar waits for, or None where it starts at once."""
        return None if self.prompt_ends_reasoning(prompt_token_ids) else self.end


class MatcherAfterMarker:
    """A grammar matcher that starts after the output writes `marker`, or with an `implicit`
    end token, which is also the grammar's first: until then it allows every token (`waiting`;
    but the implicit ends the grammar cannot start with, `disallowed_while_waiting`) and sampled
    tokens do not advance the grammar. The methods the engine calls are xgrammar's
    GrammarMatcher's."""

    def __init__(self, matcher, marker: tuple[int, ...], implicit: tuple[int, ...] = ()):
        self.matcher, self.marker, self.implicit = matcher, list(marker), frozenset(implicit)
        self.waiting = True
        self._tail: list[int] = []
        self._disallowed: Optional[list[int]] = None

    def accept_token(self, token_id: int) -> bool:
        if not self.waiting:
            return self.matcher.accept_token(token_id)
        if token_id in self.implicit:
            self.waiting = False
            return self.matcher.accept_token(token_id)
        self._tail = (self._tail + [token_id])[-len(self.marker):]
        self.waiting = self._tail != self.marker
        return True

    def disallowed_while_waiting(self, vocab_size: int) -> list[int]:
        """The implicit ends the grammar does not allow as its first token (vLLM masks them while
        the request reasons: sampled, one would end the reasoning with an invalid reply)."""
        if self._disallowed is None:
            self._disallowed = []
            if self.implicit:
                import xgrammar

                bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
                self.matcher.fill_next_token_bitmask(bitmask, 0)
                words = bitmask[0].tolist()
                self._disallowed = sorted(token for token in self.implicit
                                          if token < vocab_size and not (words[token // 32] >> (token % 32)) & 1)
        return self._disallowed

    def is_terminated(self) -> bool:
        return not self.waiting and self.matcher.is_terminated()

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def grammar_applies(matcher) -> bool:
    """Whether a sequence's matcher (None: no grammar) constrains its next token."""
    return matcher is not None and not getattr(matcher, "waiting", False)


def check_local_refs(schema: Union[str, dict]) -> None:
    """Raises ValueError naming structured_outputs unless every `$ref` in a JSON schema points
    into the schema itself ("#..."): a server must never read files or URLs a request names."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise ValueError(f"structured_outputs json is not valid JSON: {error}") from None
    pending = [schema]
    while pending:  # (iterative: any depth of nesting)
        value = pending.pop()
        if isinstance(value, dict):
            ref = value.get("$ref")
            if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
                raise ValueError(f"structured_outputs json may only $ref its own definitions (#/...), got {ref!r}")
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and hands out matchers. xgrammar is imported on
    first use, so unconstrained serving does not need it. Safe to call from several threads:
    requests are compiled on a worker pool, off the engine's step thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], max_cached_grammars: int = 64):
        try:
            import xgrammar
        except ImportError as error:
            raise ImportError("structured outputs need xgrammar: pip install xgrammar") from error
        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids) or None
        )
        # (xgrammar's own cache has no bound: ours, an LRU of max_cached_grammars, is the only one)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.max_cached_grammars = max_cached_grammars
        self._compiled: OrderedDict[tuple, object] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams):
        """The compiled constraint (cached, least recently used evicted first). Raises ValueError
        naming structured_outputs when the schema, regex or grammar is invalid."""
        key = params.key()
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        try:  # (outside the lock: other threads' cache hits need not wait for a compile)
            compiled = self._compile(params)
        except Exception as error:  # xgrammar raises RuntimeError / its own errors on bad input
            raise ValueError(f"structured_outputs {key[0]} is invalid: {error}") from None
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > self.max_cached_grammars:
                self._compiled.popitem(last=False)
        return compiled

    @property
    def num_cached_grammars(self) -> int:
        return len(self._compiled)

    def matcher(self, compiled, after: Optional[ReasoningEnd] = None):
        """A fresh matcher at the start of a compiled constraint (cheap: no compiling); with
        `after`, one that starts once the output's reasoning ends."""
        matcher = self._xgr.GrammarMatcher(compiled)
        return matcher if after is None else MatcherAfterMarker(matcher, after.marker, after.implicit)

    def _compile(self, params: StructuredOutputsParams):
        compiler = self._compiler
        # Compact JSON: with free whitespace small models can loop on spaces and newlines.
        if params.json is not None:
            return compiler.compile_json_schema(params.json, any_whitespace=False)
        if params.json_object:
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(option) for option in params.choice))
        return compiler.compile_grammar(params.grammar)


def mask_disallowed_tokens(logits: torch.Tensor, matchers: dict[int, object]) -> None:
    """Sets to -inf, in place, every logit of row i that matchers[i] does not allow next (of a
    row whose grammar has not started, only the implicit reasoning ends it could not start with).
    `logits` [rows, vocab] float32."""
    import xgrammar

    vocab_size = logits.shape[1]
    for row, matcher in matchers.items():
        if getattr(matcher, "waiting", False):
            disallowed = matcher.disallowed_while_waiting(vocab_size)
            if disallowed:
                logits[row, disallowed] = float("-inf")
    matchers = {row: matcher for row, matcher in matchers.items() if grammar_applies(matcher)}
    if not matchers:
        return

    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], vocab_size)
    for row, matcher in matchers.items():
        matcher.fill_next_token_bitmask(bitmask, row)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab_size, indices=list(matchers))

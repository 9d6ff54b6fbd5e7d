"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from pagedkv.params.repetition import RepetitionDetectionParams
from pagedkv.params.structured_output import StructuredOutputsParams

# Bounds on the lists a client sends, checked here and declared in the server's request models.
MAX_STOP_STRINGS = 64  # stop strings, and stop token ids
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by them
# overflows to infinities, which would make the draw uniform over the tied tokens.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How to pick the next tokens of a request.

    `n` independent samples share the prompt's KV blocks (fork + copy-on-write); with
    `use_beam_search` the request keeps `beam_width` beams (default: `n`) and returns the best `n`.
    Invalid values raise `ValueError` naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # number of top candidates to report per token
    # vLLM's logprob_token_ids: report these tokens' logprobs per token (with the sampled one's)
    # instead of the top `logprobs` candidates; setting them turns logprobs on.
    logprob_token_ids: Optional[list[int]] = None
    prompt_logprobs: Optional[int] = None  # the same for each prompt token (its prefix is then computed, not cached)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None  # token id -> value added to its logit, in [-100, 100]
    allowed_token_ids: Optional[list[int]] = None  # only these tokens may be generated
    bad_words: Optional[list[str]] = None  # words never generated (as a whole, with or without a leading space)
    truncate_prompt_tokens: Optional[int] = None  # keep only the prompt's last k tokens (-1: the model's limit)
    truncation_side: str = "left"  # the end truncate_prompt_tokens cuts (vLLM's): left keeps the last, right the first
    # Callables (output_token_ids, logits) or (prompt_token_ids, output_token_ids, logits) -> logits,
    # logits being the row's 1-D float32 vocabulary scores (vLLM's logits_processors).
    logits_processors: Optional[list[Callable]] = None
    use_beam_search: bool = False
    beam_width: Optional[int] = None
    length_penalty: float = 1.0
    skip_special_tokens: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None  # a JSON schema, regex, choice or grammar to match
    include_stop_str_in_output: bool = False  # keep the stop string or stop token's text at the end
    # vLLM's: end a sequence whose tail repeats a pattern (finish_reason "repetition"; params/repetition.py)
    repetition_detection: Optional[RepetitionDetectionParams] = None
    # Prefix-cache isolation (vLLM's cache_salt): only requests with the same salt share cached blocks.
    cache_salt: Optional[str] = None
    # "cumulative": each output holds everything so far; "delta" (vLLM's DELTA): only the tokens, text and
    # logprobs new since the request's previous output (streams: no per-step copy of the whole output);
    # "final_only": LLMEngine.step reports the request only when it finishes.
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        self.allowed_token_ids = list(self.allowed_token_ids) if self.allowed_token_ids is not None else None
        self.logprob_token_ids = list(self.logprob_token_ids) if self.logprob_token_ids else None
        self.bad_words = list(self.bad_words) if self.bad_words else None
        self.logits_processors = list(self.logits_processors) if self.logits_processors else None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.repetition_detection, dict):
            self.repetition_detection = RepetitionDetectionParams(**self.repetition_detection)
        if self.repetition_detection is not None and not self.repetition_detection.on:
            self.repetition_detection = None  # (all zero: off, as vLLM's)
        if self.beam_width is None:
            self.beam_width = self.n
        self._validate()
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            self.temperature = 0.0
        if self.logprob_token_ids and self.logprobs is None:
            self.logprobs = 0

    def _validate(self) -> None:
        def fail(name: str, value: object, rule: str) -> None:
            raise ValueError(f"{name} must be {rule}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", self.n, "an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "length_penalty"):
            if not isinstance(getattr(self, name), (int, float)) or not math.isfinite(getattr(self, name)):
                fail(name, getattr(self, name), "a finite number")
        if self.temperature < 0:
            fail("temperature", self.temperature, ">= 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", self.top_k, "-1 (disabled), 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            fail("min_p", self.min_p, "in [0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            fail("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            fail("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):  # (their limit is the engine's: see check_logprobs)
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < -1):
                fail(name, value, "None, an integer >= 0, or -1 (the whole vocabulary)")
        if not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if self.repetition_penalty <= 0:
            fail("repetition_penalty", self.repetition_penalty, "> 0")
        if len(self.stop) > MAX_STOP_STRINGS:
            fail("stop", f"{len(self.stop)} strings", f"at most {MAX_STOP_STRINGS} strings")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            fail("stop_token_ids", f"{len(self.stop_token_ids)} ids", f"at most {MAX_STOP_STRINGS} token ids")
        if len(self.logit_bias or ()) > MAX_LOGIT_BIAS_ENTRIES:
            fail("logit_bias", f"{len(self.logit_bias)} entries", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        if any(not isinstance(token_id, int) or token_id < 0 for token_id in self.stop_token_ids):
            fail("stop_token_ids", self.stop_token_ids, "a list of token ids (integers >= 0)")
        for token_id, bias in (self.logit_bias or {}).items():
            if not isinstance(token_id, int) or token_id < 0:
                fail("logit_bias", token_id, "keyed by token ids (integers >= 0)")
            if not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                fail("logit_bias", bias, f"a number in [-100, 100] (token {token_id})")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            fail("allowed_token_ids", self.allowed_token_ids, "None or a non-empty list of token ids (integers >= 0)")
        if self.logprob_token_ids is not None and (
            len(self.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS
            or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.logprob_token_ids)
        ):
            fail("logprob_token_ids", self.logprob_token_ids,
                 f"None or a list of at most {MAX_LOGPROB_TOKEN_IDS} token ids (integers >= 0)")
        if any(not isinstance(word, str) or not word.strip() for word in self.bad_words or ()):
            fail("bad_words", self.bad_words, "a list of non-empty strings")
        for word in self.bad_words or ():
            check_unicode(word, "bad_words")
        if any(not callable(processor) for processor in self.logits_processors or ()):
            fail("logits_processors", self.logits_processors, "a list of callables")
        if self.truncate_prompt_tokens is not None and (
            not isinstance(self.truncate_prompt_tokens, int) or (self.truncate_prompt_tokens < 1
                                                                 and self.truncate_prompt_tokens != -1)
        ):
            fail("truncate_prompt_tokens", self.truncate_prompt_tokens, "None, -1 (the model's limit) or >= 1")
        if self.truncation_side not in ("left", "right"):
            fail("truncation_side", self.truncation_side, "left or right")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(1 << 63) <= self.seed < (1 << 64)):
            fail("seed", self.seed, "a 64-bit integer, in [-2**63, 2**64)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", self.stop, "a non-empty string or a list of them")
        for stop in self.stop:
            check_unicode(stop, "stop")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            fail("cache_salt", self.cache_salt, "a non-empty string")
        if self.output_kind not in ("cumulative", "delta", "final_only"):
            fail("output_kind", self.output_kind, "'cumulative', 'delta' or 'final_only'")
        if self.use_beam_search:
            if not isinstance(self.beam_width, int) or self.beam_width < self.n:
                fail("beam_width", self.beam_width, f"an integer >= n={self.n}")
            if self.temperature != 0 and self.temperature != 1.0:
                fail("temperature", self.temperature, "0 with use_beam_search (beams are greedy)")
            if self.structured_outputs is not None:
                fail("structured_outputs", self.structured_outputs, "None with use_beam_search")
            if self.logprob_token_ids:
                fail("logprob_token_ids", self.logprob_token_ids, "None with use_beam_search")
            if self.output_kind == "delta":  # (beams are rewritten until the end: nothing to add to)
                fail("output_kind", self.output_kind, "'cumulative' or 'final_only' with use_beam_search")

    def check_context_room(self, num_prompt_tokens: int, max_model_len: int) -> None:
        """Raises ValueError naming max_tokens if the prompt leaves less room in the context than
        max_tokens asks for (the server's rule, as vLLM's: a client that names max_tokens gets
        them or a 400; the engine itself stops such a request at max_model_len)."""
        room = max_model_len - num_prompt_tokens
        if 0 < room < self.max_tokens:  # (a prompt that leaves no room is the engine's PromptTooLongError)
            raise ValueError(f"max_tokens must be at most {room}, the context left after the prompt (max_model_len="
                             f"{max_model_len} - {num_prompt_tokens} prompt tokens), got {self.max_tokens}")

    def check_logprobs(self, max_logprobs: int, vocab_size: int) -> None:
        """Raises ValueError naming logprobs or prompt_logprobs if it asks for more candidates
        per token than the engine allows: `max_logprobs` (EngineConfig.max_logprobs; -1 = the
        vocabulary size) and never more than `vocab_size`. A request's -1 (the whole vocabulary)
        becomes `vocab_size` here."""
        if max_logprobs == -1 or max_logprobs > vocab_size:
            limit, source = vocab_size, "the vocabulary size"
        else:
            limit, source = max_logprobs, "max_logprobs"
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value == -1:  # (vLLM's: the whole vocabulary, which max_logprobs must allow)
                if limit < vocab_size:
                    raise ValueError(f"{name} must be at most {limit} ({source}), got -1 (the whole vocabulary, "
                                     f"{vocab_size}); serve with --max-logprobs -1 to allow it")
                setattr(self, name, vocab_size)
            elif value is not None and value > limit:
                raise ValueError(f"{name} must be at most {limit} ({source}), got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.use_beam_search

    @property
    def num_sequences(self) -> int:
        """How many sequences the request keeps at once (samples or beams)."""
        return self.beam_width if self.use_beam_search else self.n


def check_unicode(text: str, field: str) -> None:
    """Raises ValueError naming `field` if `text` is not valid Unicode: JSON lets a request carry
    a lone surrogate, which no tokenizer (or UTF-8 response) can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{field} must be valid Unicode text; found {error.reason} at index {error.start}") from None


def kept_slice(keep: int, truncation_side: str) -> slice:
    """The part of a prompt truncate_prompt_tokens keeps: its last `keep` tokens (side "left") or its first."""
    return slice(-keep, None) if truncation_side == "left" else slice(0, keep)

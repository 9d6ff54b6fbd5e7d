"""The input processor: a request (prompt, parameters, adapter) checked and turned into the
engine's `RequestState` with everything that could fail built up front: tokens, the compiled
grammar, seeded generators, bad-word spellings, its prefix-cache key. Touches neither the
scheduler nor the engine's books, so any thread may run it while the engine steps."""

from __future__ import annotations

import hashlib
import operator
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch

from pagedkv.engine import prompt_embeds as embeds_input
from pagedkv.engine.beam_search import BeamSearch
from pagedkv.engine.request_state import RequestState, SequenceState
from pagedkv.errors import PromptTooLongError
from pagedkv.outputs import RequestMetrics
from pagedkv.params.lora_request import LoRARequest
from pagedkv.params.pooling import PoolingParams
from pagedkv.params.sampling import SamplingParams, check_unicode, kept_slice
from pagedkv.params.structured_output import GrammarCompiler, ReasoningEnd
from pagedkv.runner.step_messages import PromptEmbeds


@dataclass
class PreparedRequest:
    """A request `LLMEngine.prepare_request` checked and built, not yet queued: what could fail
    (tokenizing, grammar compiling, seeded generators) is done."""

    state: RequestState
    priority: int
    lora_request: Optional[LoRARequest]
    extra_key: Optional[int]  # prefix-cache key of its cache salt and adapter, else None


class InputProcessor:
    """Checks requests against the model and the engine's limits and builds their states."""

    def __init__(self, config, model_info, tokenizer, max_model_len: int, device):
        self.config = config
        self.model_info = model_info
        self.tokenizer = tokenizer
        self.eos_token_ids = model_info.eos_token_ids
        self.max_model_len = max_model_len
        self.device = device
        self.grammar_compiler: Optional[GrammarCompiler] = None  # built at the first structured-output request
        self._grammar_compiler_lock = threading.Lock()
        # Longer prompt texts are refused before tokenizing: they cannot fit in max_model_len.
        # (Without a tokenizer every text is refused, by `tokenize`.)
        self.max_prompt_chars = 2 * max_model_len * longest_token_chars(tokenizer) if tokenizer else sys.maxsize

    def default_sampling_params(self) -> SamplingParams:
        """pagedkv's defaults, overridden by the model's generation config."""
        return SamplingParams(**self.model_info.generation_defaults)

    def prepare(
        self,
        request_id: str,
        prompt: Union[str, list[int], dict],
        params: Optional[Union[SamplingParams, PoolingParams]] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        lora_request: Optional[LoRARequest] = None,
    ) -> PreparedRequest:
        """See `LLMEngine.prepare_request`."""
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None and pooling.task == "classify" and not self.model_info.is_classifier:
            raise ValueError("task='classify' needs a sequence-classification checkpoint (*ForSequenceClassification, "
                             "with a score head); this model generates text")
        if pooling is None and self.model_info.is_classifier:
            raise ValueError("this model is a sequence classifier (*ForSequenceClassification): it does not generate "
                             "text; classify prompts with LLM.classify or the server's /classify")
        if pooling is not None:  # computed like a one-token greedy request, reported only at the end
            params = SamplingParams(temperature=0.0, max_tokens=1, output_kind="final_only")
        params = params or self.default_sampling_params()
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority must be 0 unless scheduling_policy is 'priority' (got {priority}; "
                             f"this engine runs {self.config.scheduling_policy!r})")
        embeds = None
        if embeds_input.prompt_embeds_of(prompt) is not None:
            prompt_token_ids, embeds = self._prompt_embeds(prompt, params, pooling)
            prompt_text = None
        else:
            prompt_text, prompt_token_ids = self._prompt_tokens(prompt, params)
        if params.stop and self.tokenizer is None:
            raise ValueError(no_tokenizer("stop strings (stop_token_ids need none)"))
        vocab_size = self.model_info.vocab_size
        token_id_fields = (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids),
                           ("allowed_token_ids", params.allowed_token_ids or ()),
                           ("logprob_token_ids", params.logprob_token_ids or ()))
        for name, token_ids in token_id_fields:
            outside = outside_vocabulary(token_ids, vocab_size)
            if outside:
                raise ValueError(f"{name} names token ids outside the vocabulary [0, {vocab_size}): {outside}")
        if params.num_sequences > self.config.max_num_seqs:
            raise ValueError(f"n / beam_width={params.num_sequences} exceeds max_num_seqs={self.config.max_num_seqs}")
        params.check_logprobs(self.config.max_logprobs, vocab_size)
        grammar = self.compiled_grammar(params)  # (an invalid schema or grammar raises here, before queueing)
        after_reasoning = params.structured_outputs.after_reasoning if grammar is not None else None
        grammar_after = after_reasoning.awaited(prompt_token_ids) if after_reasoning is not None else None
        first = SequenceState(seq_id=-1, index=0, generator=self.generator(params, 0),
                              matcher=self.matcher(grammar, grammar_after))
        metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic(), num_prompt_tokens=len(prompt_token_ids))
        request = RequestState(request_id, prompt_text, prompt_token_ids, params, metrics, [first], pooling=pooling,
                               bad_words_token_ids=self.bad_words_token_ids(params.bad_words), grammar=grammar,
                               grammar_after=grammar_after, prompt_embeds=embeds)
        request.allow_plain_booking(self.eos_token_ids, self.max_model_len)
        if params.use_beam_search:
            request.beam_search = BeamSearch(
                beam_width=params.beam_width,
                num_outputs=params.n,
                max_tokens=min(params.max_tokens, self.max_model_len - len(prompt_token_ids)),
                length_penalty=params.length_penalty,
                eos_token_ids=self.eos_token_ids,
                ignore_eos=params.ignore_eos,
            )
        embeds_key = None if embeds is None else embeds_input.digest(embeds)
        return PreparedRequest(request, priority, lora_request, cache_key(params, lora_request, embeds_key))

    def _prompt_embeds(self, prompt: dict, params: SamplingParams,
                       pooling: Optional[PoolingParams]) -> tuple[list[int], PromptEmbeds]:
        """A prompt with embeddings checked (embeds_input.checked_prompt_embeds) and what they rule out."""
        if not self.config.enable_prompt_embeds:
            raise ValueError("prompt_embeds needs an engine built with enable_prompt_embeds=True (the server's "
                             "--enable-prompt-embeds)")
        if pooling is not None:
            raise ValueError("prompt_embeds are for generation: pooling requests take text or token ids")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not compatible with prompt_embeds: an embedded prompt has no "
                             "tokens to score")
        if self.config.tensor_parallel_size > 1:
            raise ValueError("prompt_embeds is not supported with tensor_parallel_size > 1")
        return embeds_input.checked_prompt_embeds(prompt, self.model_info.hidden_size, self.model_info.vocab_size,
                                                  self.max_model_len, params.truncate_prompt_tokens,
                                                  params.truncation_side)

    def _prompt_tokens(self, prompt, params: SamplingParams) -> tuple[Optional[str], list[int]]:
        """The prompt's text (None for token ids) and tokens, truncated as `params` asks."""
        vocab_size = self.model_info.vocab_size
        # (a rendered chat template holds its special tokens already: {"prompt": ..., "add_special_tokens": False})
        add_special_tokens = not isinstance(prompt, dict) or prompt.get("add_special_tokens", True)
        prompt = prompt_of(prompt)
        if isinstance(prompt, str):
            if params.truncate_prompt_tokens is None and len(prompt) > self.max_prompt_chars:
                raise PromptTooLongError(
                    f"prompt of {len(prompt)} characters exceeds max_model_len={self.max_model_len} tokens: no "
                    f"{self.max_model_len} tokens of this tokenizer span more than {self.max_prompt_chars} characters")
            prompt_text, prompt_token_ids = prompt, self.tokenize(prompt, "prompt", bool(add_special_tokens))
        else:
            try:
                prompt_text, prompt_token_ids = None, [operator.index(t) for t in prompt]
            except TypeError:
                raise ValueError("prompt token ids must be integers") from None
            outside = outside_vocabulary(prompt_token_ids, vocab_size)
            if outside:  # (vLLM's words, which its tests match)
                raise ValueError(f"prompt token ids out of vocabulary [0, {vocab_size}): {outside}")
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            if len(prompt_token_ids) > keep:  # (the text reported is what was kept)
                prompt_token_ids = prompt_token_ids[kept_slice(keep, params.truncation_side)]
                prompt_text = None if prompt_text is None else self.tokenizer.decode(prompt_token_ids)
        return prompt_text, prompt_token_ids

    def tokenize(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of request text (with the tokenizer's special tokens, a BOS, where
        `add_special_tokens`); ValueError naming `field` for text that is not valid Unicode (a lone
        surrogate, which JSON allows): the tokenizer would raise a TypeError."""
        check_unicode(text, field)
        if self.tokenizer is None:
            raise ValueError(NO_TEXT_PROMPTS)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def bad_words_token_ids(self, bad_words: Optional[list[str]]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as the model writes it: alone and after a space (vLLM's two spellings)."""
        spellings = set()
        if bad_words and self.tokenizer is None:
            raise ValueError(no_tokenizer("bad_words"))
        for word in bad_words or ():
            for text in (word.lstrip(), " " + word.lstrip()):
                token_ids = self.tokenizer.encode(text, add_special_tokens=False)
                if token_ids:
                    spellings.add(tuple(token_ids))
        return tuple(sorted(spellings))

    def compiled_grammar(self, params: SamplingParams):
        """The compiled constraint of a structured-output request, else None (any thread)."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ValueError(no_tokenizer("structured outputs"))
        with self._grammar_compiler_lock:
            if self.grammar_compiler is None:
                self.grammar_compiler = GrammarCompiler(self.tokenizer, self.model_info.vocab_size, self.eos_token_ids,
                                                        self.config.max_cached_grammars)
        return self.grammar_compiler.compile(params.structured_outputs)

    def matcher(self, grammar, after: Optional[ReasoningEnd] = None):
        """A fresh matcher of a compiled grammar (one per sample), else None; with `after`, one
        that starts once the output's reasoning ends."""
        return None if grammar is None else self.grammar_compiler.matcher(grammar, after)

    def generator(self, params: SamplingParams, index: int) -> Optional[torch.Generator]:
        """Sample `index`'s generator of a seeded request, else None."""
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.device)
        # Each sample's stream from one 64-bit seed (torch takes seeds in [0, 2**64)).
        generator.manual_seed((params.seed * 1_000_003 + index) % (1 << 64))
        return generator


def cache_key(params: SamplingParams, lora_request: Optional[LoRARequest],
              embeds_key: Optional[bytes] = None) -> Optional[int]:
    """The prefix-cache key of a request's cache salt, adapter and prompt embeddings (their
    `prompt_embeds.digest`), else None."""
    if params.cache_salt is None and lora_request is None and embeds_key is None:
        return None
    # An adapter changes every layer's K/V: its prompts get prefix-cache keys of their own.
    # (Top bit clear: never one of the unique keys of add_prepared.)
    adapter = f"\0lora:{lora_request.lora_int_id}:{lora_request.lora_path}" if lora_request else ""
    embedded = f"\0embeds:{embeds_key.hex()}" if embeds_key is not None else ""
    salt = (params.cache_salt or "") + adapter + embedded
    digest = hashlib.blake2b(salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def text_prompt(text: str, add_special_tokens: bool = False) -> dict:
    """A text prompt that says whether the tokenizer's special tokens (a BOS) go with it: a
    rendered chat template holds its own, so it takes none (vLLM's rule)."""
    return {"prompt": text, "add_special_tokens": add_special_tokens}


def prompt_of(prompt) -> Union[str, list[int], dict]:
    """Text or token ids from vLLM's prompt dicts ({"prompt": ...} or {"prompt_token_ids": ...}; a
    text's "add_special_tokens": False, as a rendered chat template's, is read by the caller); a
    {"prompt_embeds": ...} dict is kept as it is (`prompt_embeds.prompt_embeds_of` reads it)."""
    if isinstance(prompt, dict) and "prompt_embeds" not in prompt:
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(
            f"a prompt dict needs 'prompt', 'prompt_token_ids' or 'prompt_embeds', got keys {sorted(prompt)}")
    return prompt


# vLLM's words, which its tests match.
NO_TEXT_PROMPTS = "You cannot pass text prompts when `skip_tokenizer_init=True`"


def no_tokenizer(what: str) -> str:
    return f"{what} need a tokenizer, and this engine has none (`skip_tokenizer_init=True`)"


def longest_token_chars(tokenizer) -> int:
    """Characters of the tokenizer's longest token (as its vocabulary spells it, which is never
    shorter than the text it stands for): a text of c characters has at least c / this tokens."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def outside_vocabulary(token_ids, vocab_size: int) -> str:
    """The ids of `token_ids` outside [0, vocab_size), the first five of them as a message shows
    them; "" when there are none."""
    outside = sorted({token_id for token_id in token_ids if not 0 <= token_id < vocab_size})
    return ", ".join(map(str, outside[:5])) + (", ..." if len(outside) > 5 else "")

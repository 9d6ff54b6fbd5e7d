"""The engine's view of one request: its sequences' outputs, stop conditions and detokenized text."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Union

from pagedkv.engine.detokenizer import DetokenizerState, detokenize_final, detokenize_incrementally
from pagedkv.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from pagedkv.params.pooling import PoolingParams
from pagedkv.params.repetition import STOP_REASON as REPETITION_STOP_REASON
from pagedkv.params.sampling import SamplingParams
from pagedkv.params.structured_output import ReasoningEnd
from pagedkv.runner.step_messages import PromptEmbeds


@dataclass
class SequenceState:
    """One sample or beam: what it generated so far and why it stopped."""

    seq_id: int
    index: int
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[dict[int, float]]] = None
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    generator: object = None  # torch.Generator of a seeded request
    matcher: object = None  # xgrammar GrammarMatcher of a structured-output request
    text: str = ""
    detokenizer: DetokenizerState = field(default_factory=DetokenizerState)
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens the next step verifies
    sampling_row: object = None  # its runner.sampler.SamplingRow, once it sampled (engine._sampling_row)
    # What earlier outputs held, for output_kind="delta": tokens (and logprobs) and characters of text.
    num_reported_tokens: int = 0
    num_reported_chars: int = 0
    # Length of the text that has been checked for stop strings.
    _checked_text_len: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text_so_far(self) -> str:
        """Its text as far as it was decoded: cut at its stop string if one ended it, else the
        decode so far (the final one once `detokenize_final` ran). (`text` is set when the
        sequence is reported finished, not step by step: one string less referring to the
        growing decode lets it grow in place.)"""
        return self.text if self.stopped_by_string else self.detokenizer.text

    @property
    def stopped_by_string(self) -> bool:
        """Whether a stop string ended it (its text cut there already)."""
        return self.finish_reason == "stop" and isinstance(self.stop_reason, str)


@dataclass
class RequestState:
    """Everything the engine tracks for one request between steps."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[SequenceState]
    forked: bool = False  # n > 1: children are forked at the first sampled token
    beam_search: object = None  # BeamSearch of a beam-search request
    final_outputs: Optional[list[CompletionOutput]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None  # filled chunk by chunk
    pooling: Optional[PoolingParams] = None  # a pooling request: its prompt's embedding or class scores, no tokens
    pooled: Optional[list[float]] = None
    lora: object = None  # the LoRAAdapter the request runs with, else None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words, tokenized
    grammar: object = None  # xgrammar CompiledGrammar of a structured-output request (samples' matchers start from it)
    grammar_after: Optional[ReasoningEnd] = None  # what the output writes before the grammar starts (reasoning's end)
    failed: bool = False  # an error while stepping it aborted it (alone)
    # A prompt with embeddings (its prompt_token_ids hold placeholders where they go)
    prompt_embeds: Optional[PromptEmbeds] = None
    # Set by `allow_plain_booking` for a request whose tokens need no more than `record_token`'s
    # first lines: (tokens that may end it, generated tokens at which its length ends it).
    plain_booking: Optional[tuple[frozenset[int], int]] = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def allow_plain_booking(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        """Lets `record_token` book most of this request's tokens by appending them (see
        `plain_booking`): where it reports no logprobs and has no stop strings or grammar, a
        token that is no stop token or EOS and leaves the sequence short of its length is only
        appended and counted."""
        params = self.params
        if (params.logprobs is None and not params.stop and self.grammar is None and self.pooling is None
                and params.repetition_detection is None):
            stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
            self.plain_booking = (stops, min(params.max_tokens, max_model_len - len(self.prompt_token_ids)))

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def record_pooled(self, vector: list[float]) -> None:
        """The prompt's embedding or class scores (the runner pooled them): the request is done."""
        self.pooled = vector
        self.seqs[0].finish_reason = "stop"
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.monotonic()

    @property
    def finished(self) -> bool:
        if self.final_outputs is not None:
            return True
        seqs = self.seqs
        if len(seqs) == 1:  # (the common case, asked for twice per request per step)
            return seqs[0].finish_reason is not None and (self.forked or self.params.n == 1)
        return all(seq.finished for seq in seqs) and (self.forked or self.params.n == 1)

    def record_token(
        self,
        seq: SequenceState,
        token_id: int,
        logprob: Optional[float],
        top_logprobs: Optional[dict[int, float]],
        tokenizer,
        eos_token_ids: frozenset[int],
        max_model_len: int,
    ) -> None:
        """Adds a sampled token and decides whether the sequence is done (sets finish_reason)."""
        generated, booking, metrics = seq.output_token_ids, self.plain_booking, self.metrics
        if (booking is not None and token_id not in booking[0] and len(generated) + 1 < booking[1]
                and metrics.first_token_time is not None):  # (most tokens: nothing below applies)
            generated.append(token_id)
            metrics.num_generated_tokens += 1
            return
        params = self.params
        generated.append(token_id)
        if logprob is not None:
            seq.cumulative_logprob += logprob
        if params.logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            entry = dict(top_logprobs or {})
            if logprob is not None:
                entry[token_id] = logprob
            seq.logprobs.append(entry)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.monotonic()
        self.metrics.num_generated_tokens += 1

        num_generated = len(seq.output_token_ids)
        may_stop = num_generated >= params.min_tokens
        if seq.matcher is not None and (not seq.matcher.accept_token(token_id) or seq.matcher.is_terminated()):
            seq.finish_reason = "stop"  # the grammar is complete (only end-of-sequence tokens were allowed)
        elif may_stop and not params.ignore_eos and token_id in eos_token_ids:
            seq.finish_reason = "stop"
        elif may_stop and token_id in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token_id
        elif params.stop:
            text = detokenize_incrementally(tokenizer, seq.output_token_ids, seq.detokenizer, params.skip_special_tokens)
            if may_stop and self._truncate_at_stop_string(seq, text):
                return
        if seq.finish_reason is None:
            repetition = params.repetition_detection
            if num_generated >= params.max_tokens or len(self.prompt_token_ids) + num_generated >= max_model_len:
                seq.finish_reason = "length"
            elif may_stop and repetition is not None and repetition.repeats(seq.output_token_ids):
                seq.finish_reason, seq.stop_reason = "repetition", REPETITION_STOP_REASON

    def _truncate_at_stop_string(self, seq: SequenceState, text: str) -> bool:
        """Ends the sequence, its text cut before the first stop string that appeared in `text`
        (its decode so far), if one did (looking only past what earlier calls looked at)."""
        longest = max(len(stop) for stop in self.params.stop)
        search_from = max(0, seq._checked_text_len - longest + 1)
        seq._checked_text_len = len(text)
        found = [(text.find(stop, search_from), stop) for stop in self.params.stop]
        found = [(position, stop) for position, stop in found if position >= 0]
        if not found:
            return False
        position, stop = min(found)
        seq.text = text[: position + (len(stop) if self.params.include_stop_str_in_output else 0)]
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    def completion(self, seq: SequenceState, tokenizer) -> CompletionOutput:
        params = self.params
        if seq.finish_reason is None:
            # (the decode so far, referred to by its state alone: it grows in place, no copy a step)
            text = detokenize_incrementally(tokenizer, seq.output_token_ids, seq.detokenizer, params.skip_special_tokens)
            end = len(text)
            if params.stop and not params.include_stop_str_in_output:
                # A stop string may be ending the text: hold back what could be its start (as vLLM),
                # so a stream never sends characters the finished text will not have.
                end = max(0, end - max(len(stop) for stop in params.stop) + 1)
            if params.output_kind == "delta":
                return self._delta(seq, text, seq.output_token_ids, seq.logprobs, None, None, end)
            text = text[:end]
        else:
            if not seq.stopped_by_string:
                token_ids = seq.output_token_ids
                if seq.finish_reason == "stop" and not params.include_stop_str_in_output:
                    token_ids = token_ids[:-1]  # as in vLLM, the stop token or EOS is not part of the text
                seq.text = detokenize_final(tokenizer, token_ids, seq.detokenizer, params.skip_special_tokens)
            text = seq.text
        if params.output_kind == "delta":
            return self._delta(seq, text, seq.output_token_ids, seq.logprobs, seq.finish_reason, seq.stop_reason)
        # (positional: a streamed step makes one per request)
        return CompletionOutput(seq.index, text, seq.output_token_ids[:], seq.finish_reason, seq.stop_reason,
                                seq.cumulative_logprob if params.logprobs is not None else None, seq.logprobs)

    def _delta(self, seq: SequenceState, text: str, token_ids: list[int], logprobs: Optional[list],
               finish_reason: Optional[str], stop_reason: object, end: Optional[int] = None) -> CompletionOutput:
        """What is new in a sequence since its previous output (output_kind "delta"); text is
        new past the characters sent, up to `end` (default: all of it; the whole decode a
        finished sequence ends with extends the incremental one; a stop string cut within text
        already sent sends nothing more)."""
        end = len(text) if end is None else end
        sent_tokens, sent_chars = seq.num_reported_tokens, seq.num_reported_chars
        seq.num_reported_tokens, seq.num_reported_chars = len(token_ids), max(sent_chars, end)
        # (positional: a streamed step makes one per request)
        return CompletionOutput(seq.index, text[sent_chars:end], token_ids[sent_tokens:], finish_reason, stop_reason,
                                seq.cumulative_logprob if self.params.logprobs is not None else None,
                                None if logprobs is None else logprobs[sent_tokens:])

    def to_output(self, tokenizer) -> Union[RequestOutput, EmbeddingRequestOutput, ClassificationRequestOutput]:
        if self.pooling is not None and self.pooling.task == "classify":
            return ClassificationRequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                                               ClassificationOutput(self.pooled or []), self.finished, self.metrics)
        if self.pooling is not None:
            return EmbeddingRequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                                          EmbeddingOutput(self.pooled or []), self.finished, self.metrics)
        final_outputs = self.final_outputs
        if final_outputs is None:
            outputs = [self.completion(seq, tokenizer) for seq in self.seqs]
        elif self.params.output_kind == "delta":  # (a request that failed)
            seqs = {seq.index: seq for seq in self.seqs}
            outputs = [self._delta(seqs[out.index], out.text, out.token_ids, out.logprobs, out.finish_reason,
                                   out.stop_reason) if out.index in seqs else out for out in final_outputs]
        else:
            outputs = final_outputs
        prompt_token_ids = self.prompt_token_ids if self.prompt_embeds is None else []
        return RequestOutput(self.request_id, self.prompt, prompt_token_ids, outputs, self.finished,
                             None if self.needs_prompt_logprobs else self.prompt_logprobs, self.metrics,
                             len(self.prompt_token_ids))

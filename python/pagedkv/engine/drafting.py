"""Speculative decoding's side of the books: which requests speculate, and the prompt-lookup
drafts each of their tokens is reported with (the next step computes token and drafts together
and verifies the drafts)."""

from __future__ import annotations

from pagedkv.engine.books import Books
from pagedkv.engine.ngram_proposer import propose_ngram_drafts
from pagedkv.engine.request_state import RequestState, SequenceState
from pagedkv.engine.step_requests import sampling_row
from pagedkv.runner.sampler import changes_logits


class Drafter:
    """Decides and proposes drafts (config.num_speculative_tokens > 0)."""

    def __init__(self, config, books: Books, eos_token_ids: frozenset[int], max_model_len: int):
        self.config = config
        self.books = books
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    @property
    def enabled(self) -> bool:
        return self.config.num_speculative_tokens > 0

    def speculates(self, request: RequestState, seq: SequenceState) -> bool:
        """Greedy requests whose next token is the plain argmax (no penalties, biases, grammars
        or minimum length in force) and that report no logprobs, while the engine is not busy:
        verifying a draft is then one comparison, and the output is what decoding one token at a
        time gives (exactly, in float32; bfloat16 rounds the multi-token pass differently)."""
        params, config = request.params, self.config
        busy = (config.speculative_disable_by_batch_size is not None
                and len(self.books.requests) >= config.speculative_disable_by_batch_size)
        return (config.num_speculative_tokens > 0 and not busy and params.temperature == 0 and params.n == 1
                and request.beam_search is None and params.logprobs is None
                and not changes_logits(sampling_row(request, seq, self.eos_token_ids)))

    def drafts(self, request: RequestState, seq: SequenceState) -> list[int]:
        """The drafts to report after the sequence's newest token ([] when it does not speculate)."""
        if not self.speculates(request, seq):
            return []
        generated = len(seq.output_token_ids)
        room = min(self.config.num_speculative_tokens, request.params.max_tokens - generated - 1,
                   self.max_model_len - len(request.prompt_token_ids) - generated - 1)
        return propose_ngram_drafts(request.prompt_token_ids + seq.output_token_ids, room,
                                    self.config.prompt_lookup_max, self.config.prompt_lookup_min)

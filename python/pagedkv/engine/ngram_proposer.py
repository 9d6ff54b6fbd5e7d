"""Prompt-lookup (n-gram) drafts for speculative decoding: the tokens that followed the last
earlier occurrence of the sequence's final n tokens (vLLM's `ngram` method). Free to compute,
and often right when the output repeats the input: summaries, code edits, extraction, RAG."""

from __future__ import annotations

import numpy as np


def propose_ngram_drafts(token_ids: list[int], num_drafts: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to `num_drafts` tokens: for n from `lookup_max` down to `lookup_min`, find the latest
    earlier place where the last n tokens occur and copy what came after them; [] if none."""
    if num_drafts <= 0 or len(token_ids) <= lookup_min:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        pattern = tokens[-n:]
        # Candidate starts: every position whose n-gram ends before the final one.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == pattern).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start : start + num_drafts].tolist()
    return []

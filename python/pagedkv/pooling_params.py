"""Pooling parameters: a request that returns an embedding of its prompt instead of generating."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """The prompt's embedding is the final hidden state of its last token (vLLM's LAST pooling,
    what it uses for decoder-only models), L2-normalized unless `normalize=False`."""

    normalize: bool = True

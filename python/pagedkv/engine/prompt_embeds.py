"""Prompts given as embeddings (vLLM's `{"prompt_embeds": tensor}`): checked once at admission;
the runner puts their rows in place of the token embedding lookup at the prompt's positions
(runner/prompt_embeds.py), for the first prefill and for any recompute of it."""

from __future__ import annotations

import hashlib
from typing import Optional

import torch

from pagedkv.errors import PromptTooLongError

# The token id the scheduler, the prefix cache and the step's input ids see at an embedded
# prompt's positions. The prefix cache tells such prompts apart by a key of their bytes
# (`digest`), so equal placeholders never share blocks unless the embeddings are equal.
PLACEHOLDER_TOKEN_ID = 0


def prompt_embeds_of(prompt) -> Optional[object]:
    """The `prompt_embeds` of a prompt dict, else None."""
    return prompt.get("prompt_embeds") if isinstance(prompt, dict) else None


def checked_prompt_embeds(embeds, hidden_size: int, max_model_len: int,
                          truncate_prompt_tokens: Optional[int]) -> torch.Tensor:
    """`embeds` as a contiguous CPU tensor [length, hidden_size] (a leading batch dimension of 1
    is dropped, as vLLM drops it); ValueError for anything else, PromptTooLongError beyond
    `max_model_len` rows unless `truncate_prompt_tokens` keeps the last ones."""
    if not isinstance(embeds, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}")
    if embeds.is_sparse:
        embeds = embeds.to_dense()
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[0] == 0 or embeds.shape[1] != hidden_size:
        raise ValueError(f"prompt_embeds must be [length >= 1, hidden_size={hidden_size}], got {list(embeds.shape)}")
    if not embeds.is_floating_point():
        raise ValueError(f"prompt_embeds must hold floating-point values, got {embeds.dtype}")
    if truncate_prompt_tokens is not None:
        keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        embeds = embeds[-keep:]
    if embeds.shape[0] > max_model_len:
        raise PromptTooLongError(f"prompt_embeds of {embeds.shape[0]} positions exceeds max_model_len={max_model_len}")
    embeds = embeds.detach().to("cpu").contiguous()
    if not bool(torch.isfinite(embeds).all()):
        raise ValueError("prompt_embeds holds a NaN or infinite value")
    return embeds


def digest(embeds: torch.Tensor) -> bytes:
    """A key of the embeddings' values (shape, dtype and bytes) for the prefix cache."""
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(f"{list(embeds.shape)}:{embeds.dtype}".encode())
    hasher.update(embeds.view(torch.uint8).numpy())  # (a byte view: numpy has no bfloat16)
    return hasher.digest()

"""Prompts given as embeddings: vLLM's `{"prompt_embeds": tensor}` (the whole prompt), or
`{"prompt_token_ids": ids, "prompt_embeds": rows, "prompt_embeds_positions": positions}` (some
positions embedded: how the server passes a chat message's `prompt_embeds` parts). Checked once
at admission; the runner puts the rows in place of the token embedding lookup at their positions
(runner/prompt_embeds.py), in the first prefill and in any recompute of it."""

from __future__ import annotations

import hashlib
from typing import Optional

import numpy as np
import torch

from pagedkv.errors import PromptTooLongError
from pagedkv.params.sampling import kept_slice
from pagedkv.runner.step_messages import PromptEmbeds

# The token id the scheduler, the prefix cache and the step's input ids see at an embedded
# position. The prefix cache tells such prompts apart by a key of their embeddings (`digest`),
# so equal placeholders never share blocks unless the embeddings are equal too.
PLACEHOLDER_TOKEN_ID = 0


def prompt_embeds_of(prompt) -> Optional[object]:
    """The `prompt_embeds` of a prompt dict, else None."""
    return prompt.get("prompt_embeds") if isinstance(prompt, dict) else None


def checked_prompt_embeds(prompt: dict, hidden_size: int, vocab_size: int, max_model_len: int,
                          truncate_prompt_tokens: Optional[int],
                          truncation_side: str = "left") -> tuple[list[int], PromptEmbeds]:
    """(the prompt's token ids, placeholders at embedded positions; its PromptEmbeds): ValueError
    for anything malformed, PromptTooLongError beyond `max_model_len` positions unless
    `truncate_prompt_tokens` keeps the last ones (the first with `truncation_side` "right")."""
    rows = _checked_rows(prompt["prompt_embeds"], hidden_size)
    if "prompt_token_ids" in prompt:
        token_ids = [int(token) for token in prompt["prompt_token_ids"]]
        if any(not 0 <= token < vocab_size for token in token_ids):
            raise ValueError(f"prompt_token_ids must be ints in [0, {vocab_size})")
        positions = np.asarray(prompt.get("prompt_embeds_positions", ()), dtype=np.int64).reshape(-1)
        if (len(positions) != rows.shape[0] or len(np.unique(positions)) != len(positions)
                or (positions.size and not (0 <= positions.min() and positions.max() < len(token_ids)))):
            raise ValueError(f"prompt_embeds_positions must name {rows.shape[0]} distinct positions of the "
                             f"{len(token_ids)} prompt tokens, one per prompt_embeds row")
        row_of_position = np.full(len(token_ids), -1, dtype=np.int64)
        row_of_position[positions] = np.arange(len(positions))
        for position in positions.tolist():
            token_ids[position] = PLACEHOLDER_TOKEN_ID
    else:
        token_ids = [PLACEHOLDER_TOKEN_ID] * rows.shape[0]
        row_of_position = np.arange(rows.shape[0], dtype=np.int64)
    if truncate_prompt_tokens is not None:
        keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if len(token_ids) > keep:
            kept = kept_slice(keep, truncation_side)
            token_ids, row_of_position = token_ids[kept], row_of_position[kept]
            used = row_of_position >= 0
            rows = rows[torch.from_numpy(row_of_position[used])]
            row_of_position = row_of_position.copy()
            row_of_position[used] = np.arange(int(used.sum()))
    if len(token_ids) > max_model_len:
        raise PromptTooLongError(f"prompt of {len(token_ids)} positions (with prompt_embeds) exceeds "
                                 f"max_model_len={max_model_len}")
    return token_ids, PromptEmbeds(rows.contiguous(), row_of_position)


def _checked_rows(embeds, hidden_size: int) -> torch.Tensor:
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
    embeds = embeds.detach().to("cpu").contiguous()
    if not bool(torch.isfinite(embeds).all()):
        raise ValueError("prompt_embeds holds a NaN or infinite value")
    return embeds


def digest(embeds: PromptEmbeds) -> bytes:
    """A key of the embeddings (their values and where they go) for the prefix cache."""
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(f"{list(embeds.rows.shape)}:{embeds.rows.dtype}".encode())
    hasher.update(embeds.rows.view(torch.uint8).numpy())  # (a byte view: numpy has no bfloat16)
    hasher.update(embeds.row_of_position.tobytes())
    return hasher.digest()

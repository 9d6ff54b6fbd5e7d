"""Prompts given as embeddings in the forward pass: at a step's rows whose position lies inside
such a prompt, the model's token embedding lookup gives way to the prompt's row (what HF's
`inputs_embeds` means: scaling or position embeddings a model adds to its lookup apply to them
too). A forward hook on the lookup module does it, so every architecture takes them alike."""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch
from torch import nn

from pagedkv.runner.step_messages import PromptEmbeds


def embedded_rows(seq_ids: list[int], query_start_loc: np.ndarray, positions: np.ndarray,
                  prompt_embeds: dict[int, PromptEmbeds]) -> tuple[np.ndarray, list[torch.Tensor]]:
    """(the step's rows that take a prompt's embedding, those embeddings' rows in the same order)."""
    rows, values = [], []
    if not prompt_embeds:  # (most steps: nothing to look at per sequence)
        return np.empty(0, dtype=np.int64), values
    for index, seq_id in enumerate(seq_ids):
        embeds = prompt_embeds.get(seq_id)
        if embeds is None:
            continue
        start, end = int(query_start_loc[index]), int(query_start_loc[index + 1])
        chunk, row_of = positions[start:end], embeds.row_of_position
        taken = np.full(len(chunk), -1, dtype=np.int64)
        inside = chunk < len(row_of)
        taken[inside] = row_of[chunk[inside]]
        embedded = np.flatnonzero(taken >= 0)
        if embedded.size:
            rows.append(start + embedded)
            values.append(embeds.rows[torch.from_numpy(taken[embedded])])
    return (np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)), values


@contextlib.contextmanager
def embeddings_in_place(lookup: nn.Module, rows: np.ndarray, values: list[torch.Tensor]) -> Iterator[None]:
    """While open, `lookup`'s output takes `values` at `rows` (nothing changes without rows)."""
    if rows.size == 0:
        yield
        return

    def replace(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
        index = torch.from_numpy(rows).to(output.device)
        output[index] = torch.cat(values).to(output.device, output.dtype)
        return output

    handle = lookup.register_forward_hook(replace)
    try:
        yield
    finally:
        handle.remove()

"""vLLM's `prompt_embeds`, in the completions API (whole prompts) and as chat content parts: base64
of what `torch.save` writes for one tensor [length, hidden_size], read with
`torch.load(weights_only=True)` (tensors only: no code runs while loading). The engine checks
shapes and values (engine/prompt_embeds.py)."""

from __future__ import annotations

import base64
import binascii
import io
import uuid
from typing import Union

import torch


def decode_prompt_embeds(encoded: Union[str, list[str]]) -> list[torch.Tensor]:
    """Each base64 text's tensor, in order; ValueError (a 400) naming what is wrong."""
    texts = [encoded] if isinstance(encoded, str) else list(encoded)
    tensors = []
    for index, text in enumerate(texts):
        where = "prompt_embeds" if isinstance(encoded, str) else f"prompt_embeds[{index}]"
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where} is not base64 text") from None
        try:
            tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        except Exception as error:  # (torch raises several kinds for bytes that are not its format)
            raise ValueError(f"{where} is not a tensor saved by torch.save: {type(error).__name__}") from None
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{where} holds a {type(tensor).__name__}, not one tensor")
        tensors.append(tensor)
    return tensors


def embeds_marker() -> str:
    """Text that stands for a prompt_embeds part while the chat template renders the messages (a
    fresh one per request: no message text can hold it)."""
    return f"<|prompt-embeds-{uuid.uuid4().hex}|>"


def spliced_prompt(text: str, marker: str, tensors: list[torch.Tensor], tokenizer,
                   add_special_tokens: bool = False) -> dict:
    """The engine's prompt for a rendered chat prompt whose prompt_embeds parts are `marker`s: the
    text between them tokenized piece by piece (the tokenizer's special tokens before the first
    where `add_special_tokens`, as the text alone would be), each part's rows at the positions it fills."""
    pieces = text.split(marker)
    if len(pieces) != len(tensors) + 1:
        raise ValueError("messages: the chat template dropped or repeated a prompt_embeds part")
    token_ids: list[int] = []
    positions: list[int] = []
    rows = []
    for index, piece in enumerate(pieces):
        if piece:
            token_ids += tokenizer.encode(piece, add_special_tokens=add_special_tokens and index == 0)
        if index < len(tensors):
            tensor = tensors[index]
            tensor = tensor[0] if tensor.dim() == 3 and tensor.shape[0] == 1 else tensor
            if tensor.dim() != 2 or not tensor.is_floating_point():
                raise ValueError(f"prompt_embeds parts must be floating-point [length, hidden_size], got "
                                 f"{tensor.dtype} {list(tensor.shape)}")
            positions += range(len(token_ids), len(token_ids) + tensor.shape[0])
            token_ids += [0] * tensor.shape[0]
            rows.append(tensor.float())
    widths = {row.shape[1] for row in rows}
    if len(widths) > 1:
        raise ValueError(f"prompt_embeds parts must share one hidden size, got {sorted(widths)}")
    return {"prompt_token_ids": token_ids, "prompt_embeds": torch.cat(rows), "prompt_embeds_positions": positions}

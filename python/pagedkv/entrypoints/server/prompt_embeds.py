"""The completions API's `prompt_embeds` (vLLM's): base64 of what `torch.save` writes for one
tensor [length, hidden_size], read with `torch.load(weights_only=True)` (tensors only: no code
runs while loading). The engine checks shapes and values (engine/prompt_embeds.py)."""

from __future__ import annotations

import base64
import binascii
import io
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

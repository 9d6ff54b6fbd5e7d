"""Cohere's /v2/embed, as vLLM serves it: texts (or text `inputs`) embedded as /v1/embeddings
embeds them, answered in the embedding types asked for: float, binary and ubinary (one bit per
dimension, set where the value is >= 0, packed eight to a byte, most significant first; binary
as signed bytes) and base64 (little-endian float32 bytes)."""

from __future__ import annotations

import base64
import struct
from typing import Literal, Optional

import numpy as np
from pydantic import Field, model_validator

from pagedkv.entrypoints.server.protocol import Priority, _Part, _Request

EmbeddingType = Literal["float", "binary", "ubinary", "base64"]


class EmbedContent(_Part):
    type: Literal["text", "image_url"]
    text: Optional[str] = None
    image_url: Optional[dict[str, str]] = None


class EmbedInput(_Part):
    content: list[EmbedContent] = Field(min_length=1)


class CohereEmbedRequest(_Request):
    model: Optional[str] = None
    input_type: Optional[str] = None  # (a model's task prefixes; this model has none: no effect)
    texts: Optional[list[str]] = None
    images: Optional[list[str]] = None
    inputs: Optional[list[EmbedInput]] = None
    output_dimension: Optional[int] = None
    embedding_types: Optional[list[EmbeddingType]] = None
    truncate: Literal["NONE", "START", "END"] = "END"
    priority: Priority = 0

    @model_validator(mode="after")
    def _one_kind_of_input(self):
        given = [field for field in (self.texts, self.images, self.inputs) if field is not None]
        if len(given) != 1 or not given[0]:
            raise ValueError("Exactly one of texts, images, or inputs must be provided, and it must be non-empty")
        return self

    def text_inputs(self) -> list[str]:
        """The texts to embed; ValueError for images (a text-only model)."""
        if self.images is not None or any(part.type != "text" for item in self.inputs or () for part in item.content):
            raise ValueError("images are not supported: this model embeds text only")
        if self.texts is not None:
            return list(self.texts)
        return ["".join(part.text or "" for part in item.content) for item in self.inputs]


def truncated(token_ids: list[int], side: str, limit: int) -> Optional[list[int]]:
    """`token_ids` cut to `limit` as Cohere's `truncate` says (END drops the end, START the start);
    None where NONE forbids a cut that is needed."""
    if len(token_ids) <= limit:
        return token_ids
    if side == "NONE":
        return None
    return token_ids[:limit] if side == "END" else token_ids[-limit:]


def typed_embeddings(vectors: list[list[float]], kinds: list[str]) -> dict:
    """{kind: the vectors in that type} for each kind asked for."""
    typed: dict = {}
    for kind in kinds:
        if kind == "float":
            typed["float"] = vectors
        elif kind == "base64":
            typed["base64"] = [base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() for v in vectors]
        else:
            packed = np.packbits(np.asarray(vectors) >= 0, axis=-1).astype(np.int16)
            typed[kind] = (packed - 128 if kind == "binary" else packed).tolist()
    return typed

"""A GGUF file's tensors (name, type, data mapped from the file) without its metadata values.

gguf-py's GGUFReader builds every metadata field first, the tokenizer's ~49k strings and merges
element by element: ~3.5 s of a load that keeps the embedded model's blocks, for tensors whose
index takes milliseconds. Here the metadata values are skipped by their lengths (read for
`general.alignment` only) and each tensor's data is a view of the file's memory map, shaped as
GGUFReader shapes it (its `ReaderTensor.data`), so the two are interchangeable for the loader.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

MAGIC = b"GGUF"
STRING, ARRAY, UINT32 = 8, 9, 4
# Bytes of each fixed-size metadata value type (GGUF's numbering; 8 and 9 have lengths).
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
ELEMENT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray


class _Cursor:
    def __init__(self, buffer: np.ndarray):
        self.buffer, self.at = buffer, 0

    def read(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.read("Q")
        self.at += length
        return bytes(self.buffer[self.at - length:self.at]).decode("utf-8")

    def skip_value(self, value_type: int) -> None:
        if value_type == STRING:
            length = self.read("Q")  # (read first: `self.at += self.read(...)` loses the read's own step)
            self.at += length
        elif value_type == ARRAY:
            item_type, count = self.read("IQ")
            if item_type in FIXED_SIZES:
                self.at += FIXED_SIZES[item_type] * count
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        elif value_type in FIXED_SIZES:
            self.at += FIXED_SIZES[value_type]
        else:
            raise ValueError(f"unknown GGUF metadata value type {value_type}")


def _header(path: str) -> tuple[np.ndarray, _Cursor, int, int]:
    """(the file's mapping, a cursor at its first metadata key, tensor count, metadata count)."""
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(buffer)
    if bytes(buffer[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    version, tensor_count, kv_count = cursor.read("4xIQQ")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not read here (2 and 3 are)")
    return buffer, cursor, tensor_count, kv_count


def gguf_architecture(path: str) -> str | None:
    """The GGUF's `general.architecture` (llama.cpp's name: "llama", "qwen2", "gemma2"...), or None."""
    _, cursor, _, kv_count = _header(path)
    for _ in range(kv_count):
        key, value_type = cursor.string(), cursor.read("I")
        if key == "general.architecture" and value_type == STRING:
            return cursor.string()
        cursor.skip_value(value_type)
    return None


def gguf_tensors(path: str) -> dict[str, GGUFTensor]:
    """Every tensor of the little-endian GGUF (version 2 or 3) at `path`, by name."""
    import gguf

    buffer, cursor, tensor_count, kv_count = _header(path)
    alignment = 32
    for _ in range(kv_count):
        key, value_type = cursor.string(), cursor.read("I")
        if key == "general.alignment" and value_type == UINT32:
            alignment = cursor.read("I")
        else:
            cursor.skip_value(value_type)
    infos = []
    for _ in range(tensor_count):
        name, num_dims = cursor.string(), cursor.read("I")
        dims = [cursor.read("Q") for _ in range(num_dims)]
        infos.append((name, dims, gguf.GGMLQuantizationType(cursor.read("I")), cursor.read("Q")))
    data_start = -(-cursor.at // alignment) * alignment
    tensors = {}
    for name, dims, ggml_type, offset in infos:
        shape = tuple(reversed(dims))
        num_elements = int(np.prod(dims))
        element_type = ELEMENT_TYPES.get(ggml_type.name)
        if element_type is None:  # (blocks: rows of bytes)
            block_len, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
            element_type, num_elements = np.uint8, num_elements // block_len * block_bytes
            shape = gguf.quant_shape_to_byte_shape(shape, ggml_type)
        start = data_start + offset
        count_bytes = num_elements * np.dtype(element_type).itemsize
        data = buffer[start:start + count_bytes].view(element_type).reshape(shape)
        tensors[name] = GGUFTensor(name, ggml_type, data)
    return tensors


def release_resident_pages(tensors: Iterable[GGUFTensor]) -> None:
    """Takes the file's pages a load has read out of this process's resident set (they stay in
    the page cache, and a later read maps them again): the load copies what it keeps, and a
    mapping it still holds would count the file a second time in its peak."""
    mappings = {id(m): m for m in (getattr(t.data, "_mmap", None) for t in tensors) if m is not None}
    for mapping in mappings.values():
        if not mapping.closed:
            mapping.madvise(mmap.MADV_DONTNEED)

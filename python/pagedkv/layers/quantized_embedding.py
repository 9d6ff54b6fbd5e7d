"""An embedding table kept as a GGUF stores it (blocks, or bfloat16): a lookup widens only the rows
it reads.

A GGUF's token embedding table is usually quantized (the embedded SmolLM2's is Q8_0, 35 MB,
113 MB as float32; a 7B model's Q4 table is ~70 MB, ~520 MB as float32). Kept as its blocks, the
model's resident weights stay about the file's size. Rows decode with the same float32 operations
as a load-time dequantization, so a lookup gives exactly the float table's values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.layers.quantized_linear import GGML_TYPES, dequantize, row_bytes


class QuantizedEmbedding(nn.Module):
    """nn.Embedding's lookup over `blocks` (uint8 [num_embeddings, bytes_per_row], a GGUF tensor's
    bytes as stored) of `ggml_type`. `weight` (as nn.Embedding's, for code that reads the table,
    e.g. to build prompt embeddings) is the whole table dequantized: a new float32 tensor each
    read, so the model's own paths never read it."""

    def __init__(self, blocks: torch.Tensor, ggml_type: str, embedding_dim: int):
        super().__init__()
        if ggml_type not in GGML_TYPES:
            raise ValueError(f"ggml_type must be one of {', '.join(GGML_TYPES)}, got {ggml_type!r}")
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(ggml_type, embedding_dim):
            raise ValueError(f"blocks must be uint8 [rows, {row_bytes(ggml_type, embedding_dim)}], got "
                             f"{blocks.dtype} {tuple(blocks.shape)}")
        self.ggml_type, self.num_embeddings, self.embedding_dim = ggml_type, blocks.shape[0], embedding_dim
        self.register_buffer("blocks", blocks.contiguous())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, input_ids.reshape(-1))
        values = dequantize(rows, self.ggml_type, (rows.shape[0], self.embedding_dim))
        return values.reshape(*input_ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table as float32 [num_embeddings, embedding_dim] (a new tensor each read)."""
        return dequantize(self.blocks, self.ggml_type, (self.num_embeddings, self.embedding_dim))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, ggml_type={self.ggml_type}"


class BFloat16Embedding(nn.Module):
    """nn.Embedding's lookup over a bfloat16 `table` (a BF16 GGUF's token_embd, shared with a tied
    LM head's BFloat16LMHeadProduct) giving float32 rows: widening is exact, so a lookup gives the
    float32 table's values at half its bytes (the embedded SmolLM2's table: 57 MB, not 113).
    `weight` is the whole table widened: a new float32 tensor each read."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        if table.dtype != torch.bfloat16 or table.dim() != 2:
            raise ValueError(f"table must be a 2-d bfloat16 tensor, got {table.dtype} {tuple(table.shape)}")
        self.num_embeddings, self.embedding_dim = table.shape
        # The bits as int16 (a view: a tied head's weight stays the same memory), so that casting
        # the model to its float dtype (Module.to) leaves them be
        self.register_buffer("table_bits", table.contiguous().view(torch.int16))

    @property
    def table(self) -> torch.Tensor:
        return self.table_bits.view(torch.bfloat16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.table).float()

    @property
    def weight(self) -> torch.Tensor:
        """The whole table as float32 [num_embeddings, embedding_dim] (a new tensor each read)."""
        return self.table.float()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bfloat16"

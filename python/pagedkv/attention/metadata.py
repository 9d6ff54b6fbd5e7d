"""AttentionMetadata: where a step's flat token batch comes from and where its K/V go."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    """Describes one step's flat batch of new tokens (prefill chunks first, then decodes).

    New token i of sequence b sits at position `context_lens[b] - q_len_b + i` and attends
    causally to positions 0..=that, read through `block_tables[b]`.
    """

    query_start_loc: torch.Tensor  # int32 [B+1], cumulative new-token counts (cu_seqlens_q)
    context_lens: torch.Tensor  # int32 [B], tokens in the cache for each sequence after this step
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    slot_mapping: torch.Tensor  # int64 [T], destination slot (block * block_size + offset) of each token
    max_query_len: int
    max_context_len: int
    num_decode_tokens: int  # the last num_decode_tokens sequences have exactly one new token
    # Host copies, so backends need no device->host sync to loop over sequences. None inside
    # CUDA graphs (cuda_graphs.py), whose backends use the device tensors alone.
    query_start_loc_host: Optional[list[int]]
    context_lens_host: Optional[list[int]]
    # int32 [T]: each token's sequence, when the runner keeps it on the device (decode graphs).
    seq_index: Optional[torch.Tensor] = None
    # (seq_index, context_lens) per query token, int32 on the device: set once per step by the
    # `prepare` of backends that read it (cuda.py), shared by every layer.
    token_layout: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decode_tokens

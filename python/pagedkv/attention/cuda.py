"""The CUDA kernel backend: pagedkv's own kernels (cuda/*.cu) through CuPy, on torch's
current stream. Same interface and results as the torch reference backend."""

from __future__ import annotations

from typing import Optional

import torch

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.kernels import copy_blocks, paged_attention, reshape_and_cache
from pagedkv.kernels.transfer import to_device


def token_layout(metadata: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_index, context_lens) per query token, int32 on `device`.

    New token i of a sequence with q new tokens and context c sees c - q + 1 + i tokens, so
    prefill chunks are causal. Computed once per step (every layer shares the metadata); a
    decode-only step needs no host work, so it can be captured in a CUDA graph.
    """
    cached = metadata.__dict__.get("_token_layout")
    if cached is not None:
        return cached
    if metadata.max_query_len == 1:
        seq_index = metadata.seq_index
        if seq_index is None:
            seq_index = torch.arange(metadata.num_seqs, dtype=torch.int32, device=device)
        metadata.__dict__["_token_layout"] = (seq_index, metadata.context_lens)
        return seq_index, metadata.context_lens
    seq_index, context_lens = [], []
    starts = metadata.query_start_loc_host
    for seq, context in enumerate(metadata.context_lens_host):
        num_new = starts[seq + 1] - starts[seq]
        seq_index += [seq] * num_new
        context_lens += range(context - num_new + 1, context + 1)
    layout = to_device(torch.tensor([seq_index, context_lens], dtype=torch.int32), device)
    metadata.__dict__["_token_layout"] = (layout[0], layout[1])
    return layout[0], layout[1]


class CudaAttentionBackend:
    """launcher: None runs on the tensors' GPU; tests pass an EmulatorLauncher to run on CPU."""

    name = "cuda"
    supports_cuda_graphs = True

    def __init__(self, launcher=None):
        self.launcher = launcher

    def write_kv(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, launcher=self.launcher)

    def forward(self, query, key_cache, value_cache, metadata: AttentionMetadata, scale: float,
                sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        seq_index, context_lens = token_layout(metadata, query.device)
        return paged_attention(
            query, key_cache, value_cache, metadata.block_tables, seq_index, context_lens,
            metadata.max_context_len, scale, sliding_window=sliding_window, logit_softcap=logit_softcap,
            sinks=sinks, launcher=self.launcher,
        )

    def copy_blocks(self, kv_cache, pairs) -> None:
        copy_blocks(kv_cache, pairs, launcher=self.launcher)

"""The CUDA kernel backend: pagedkv's own kernels (cuda/*.cu) through CuPy, on torch's
current stream. Same interface and results as the torch reference backend."""

from __future__ import annotations

from typing import Optional

import torch

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.kernels import UnsupportedKernelError, copy_blocks, paged_attention, reshape_and_cache
from pagedkv.kernels.sources import HEAD_DIMS
from pagedkv.kernels.transfer import to_device


def token_layout(metadata: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_index, context_lens) per query token, int32 on `device`.

    New token i of a sequence with q new tokens and context c sees c - q + 1 + i tokens, so
    prefill chunks are causal. A decode-only step needs no host work, so it can be captured in a
    CUDA graph.
    """
    if metadata.max_query_len == 1:
        seq_index = metadata.seq_index
        if seq_index is None:
            seq_index = torch.arange(metadata.num_seqs, dtype=torch.int32, device=device)
        return seq_index, metadata.context_lens
    seq_index, context_lens = [], []
    starts = metadata.query_start_loc_host
    for seq, context in enumerate(metadata.context_lens_host):
        num_new = starts[seq + 1] - starts[seq]
        seq_index += [seq] * num_new
        context_lens += range(context - num_new + 1, context + 1)
    layout = to_device(torch.tensor([seq_index, context_lens], dtype=torch.int32), device)
    return layout[0], layout[1]


class CudaAttentionBackend:
    """pagedkv's kernels (AttentionBackend). launcher: None runs on the tensors' GPU; tests pass
    an EmulatorLauncher to run on CPU."""

    name = "cuda"
    supports_cuda_graphs = True  # (a decode step's token layout is its device tensors: `token_layout`)

    @classmethod
    def check_supported(cls, device: str, head_dim: Optional[int]) -> None:
        """The head dims the kernels are built for (kernels/sources.py's HEAD_DIMS)."""
        if head_dim is not None and head_dim not in HEAD_DIMS:
            raise UnsupportedKernelError(f"the CUDA attention kernels have no head_dim={head_dim} (they have "
                                         f"{HEAD_DIMS}); use attention_backend='torch'")

    def __init__(self, launcher=None):
        self.launcher = launcher

    def prepare(self, metadata: AttentionMetadata) -> None:
        """The step's token layout (`token_layout`), computed once for every layer."""
        metadata.token_layout = token_layout(metadata, metadata.context_lens.device)

    def write_kv(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, launcher=self.launcher)

    def forward(self, query, key_cache, value_cache, metadata: AttentionMetadata, scale: float,
                sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        if metadata.token_layout is None:  # (a caller that skipped `prepare`: a test's single call)
            self.prepare(metadata)
        seq_index, context_lens = metadata.token_layout
        return paged_attention(
            query, key_cache, value_cache, metadata.block_tables, seq_index, context_lens,
            metadata.max_context_len, scale, sliding_window=sliding_window, logit_softcap=logit_softcap,
            sinks=sinks, launcher=self.launcher,
        )

    def copy_blocks(self, kv_cache, pairs) -> None:
        copy_blocks(kv_cache, pairs, launcher=self.launcher)

"""AttentionBackend: what the runner and the models ask of an attention backend.

Caches are per-layer views `[num_blocks, Hkv, block_size, D]` of the block-major cache
`[num_blocks, num_layers, 2, Hkv, block_size, D]` (runner/kv_cache.py); queries, keys and values
are the step's flat token batch, `[T, H, D]`, in the order AttentionMetadata describes. A
backend is one file of this folder and one line of registry.py.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from pagedkv.attention.metadata import AttentionMetadata


@runtime_checkable
class AttentionBackend(Protocol):
    """One step: `prepare(metadata)` once, then per layer `write_kv` and `forward`; between
    steps, `copy_blocks` for the scheduler's copy-on-write copies."""

    name: str
    """The name `attention_backend` selects it by (registry.py)."""
    supports_cuda_graphs: bool
    """Whether a decode step (one new token per sequence) runs on the device tensors of its
    metadata alone, with its host lists None, so that it can be captured in a CUDA graph
    (runner/cuda_graphs.py)."""

    @classmethod
    def check_supported(cls, device: str, head_dim: Optional[int]) -> None:
        """Raises (ValueError, or UnsupportedKernelError for a kernel's missing shape) when the
        backend cannot run a model of this head dim on this device."""
        ...

    def prepare(self, metadata: AttentionMetadata) -> None:
        """The per-step work every layer shares, done once before the first layer (into the
        metadata's fields, such as `token_layout`). Called inside CUDA graph captures as well:
        for a decode step it may not read the host lists."""
        ...

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Scatters the step's key/value [T, Hkv, D] into one layer's caches at `slot_mapping`
        (int64 [T], block * block_size + offset; -1: not written), converted to the caches' dtype."""
        ...

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: Optional[int] = None,
                logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """query [T, Hq, D] -> [T, Hq, D]: each new token over its sequence's cached context, causal
        (the last `sliding_window` positions, where given), scaled logits soft-capped to
        `logit_softcap * tanh(logit / logit_softcap)` where given, `sinks` ([Hq] logits) in each
        head's softmax as keys of zero value, where given."""
        ...

    def copy_blocks(self, kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        """Copies whole blocks of every layer: kv_cache [N, L, 2, Hkv, bs, D]; pairs int64 [P, 2]
        of (src, dst) on the cache's device."""
        ...

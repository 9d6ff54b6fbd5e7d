"""Attention backends: one small interface, a torch reference (CPU/GPU) and CUDA kernels.

Backends: `torch` (reference, CPU and GPU; the oracle), `cpu` (the reference with decode in
Rust), `cuda` (pagedkv's kernels). A backend has `write_kv(key_cache, value_cache, key, value, slot_mapping)`,
`forward(query, key_cache, value_cache, metadata, scale, sliding_window=None, logit_softcap=None,
sinks=None) -> output` and
`copy_blocks(kv_cache, pairs)`; caches are per-layer views `[num_blocks, Hkv, block_size, D]` of
the block-major cache `[num_blocks, num_layers, 2, Hkv, block_size, D]` (docs/architecture.md).
"""

from __future__ import annotations

import logging

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.torch_ref import TorchRefBackend

logger = logging.getLogger("pagedkv.attention")


def get_backend(name: str, device: str):
    """'torch', 'cpu', 'cuda', or 'auto': cuda kernels on a CUDA device when CuPy is there (else
    torch), the cpu backend (Rust decode attention) on the CPU."""
    if name == "auto":
        name = "cpu" if not device.startswith("cuda") else "torch"
        if device.startswith("cuda"):
            try:
                import cupy  # noqa: F401

                from pagedkv.attention import cuda  # noqa: F401

                name = "cuda"
            except ImportError as error:
                logger.warning("CUDA attention kernels unavailable (%s); using the torch reference", error)
    if name == "torch":
        return TorchRefBackend()
    if name == "cpu":
        if device.startswith("cuda"):
            raise ValueError("attention_backend='cpu' runs on the CPU; use 'cuda' or 'torch' on a GPU")
        from pagedkv.attention.cpu import CpuAttentionBackend

        return CpuAttentionBackend()
    if name == "cuda":
        from pagedkv.attention.cuda import CudaAttentionBackend

        return CudaAttentionBackend()
    raise ValueError(f"attention_backend must be 'auto', 'torch', 'cpu' or 'cuda', got {name!r}")


__all__ = ["AttentionMetadata", "TorchRefBackend", "get_backend"]

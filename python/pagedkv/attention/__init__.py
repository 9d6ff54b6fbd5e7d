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


def get_backend(name: str, device: str, head_dim: int | None = None):
    """'torch', 'cpu', 'cuda', or 'auto': cuda kernels on a CUDA device when CuPy is there and
    they have this head dim (else torch), the cpu backend (Rust decode attention) on the CPU."""
    from pagedkv.kernels.sources import HEAD_DIMS

    if name == "auto":
        name = "cpu" if not device.startswith("cuda") else "torch"
        if device.startswith("cuda") and head_dim is not None and head_dim not in HEAD_DIMS:
            logger.info("the CUDA attention kernels have no head dim %d (they have %s): using the torch reference",
                        head_dim, HEAD_DIMS)
        elif device.startswith("cuda"):
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
        if head_dim is not None and head_dim not in HEAD_DIMS:
            from pagedkv.kernels import UnsupportedKernelError

            raise UnsupportedKernelError(f"the CUDA attention kernels have no head_dim={head_dim} (they have {HEAD_DIMS}); "
                                         "use attention_backend='torch'")
        from pagedkv.attention.cuda import CudaAttentionBackend

        return CudaAttentionBackend()
    raise ValueError(f"attention_backend must be 'auto', 'torch', 'cpu' or 'cuda', got {name!r}")


__all__ = ["AttentionMetadata", "TorchRefBackend", "get_backend"]

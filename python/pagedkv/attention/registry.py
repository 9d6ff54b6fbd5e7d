"""The attention backends by name (`EngineConfig.attention_backend`), and the choice of 'auto'.

A new backend is a module of this folder whose class satisfies AttentionBackend (backend.py)
and one line in BACKENDS.
"""

from __future__ import annotations

import logging
from typing import Optional

from pagedkv.attention.backend import AttentionBackend
from pagedkv.attention.cpu import CpuAttentionBackend
from pagedkv.attention.cuda import CudaAttentionBackend
from pagedkv.attention.torch_ref import TorchRefBackend
from pagedkv.errors import InvalidConfigError

logger = logging.getLogger("pagedkv.attention")

BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchRefBackend,  # the reference, CPU and GPU; the oracle
    "cpu": CpuAttentionBackend,  # the reference with decode and prefill attention in Rust
    "cuda": CudaAttentionBackend,  # pagedkv's CUDA kernels
}


def auto_backend_name(device: str, head_dim: Optional[int] = None) -> str:
    """'cuda' on a CUDA device when CuPy is there and the kernels have this head dim (else
    'torch'); 'cpu' on the CPU."""
    if not device.startswith("cuda"):
        return "cpu"
    from pagedkv.kernels.sources import HEAD_DIMS

    if head_dim is not None and head_dim not in HEAD_DIMS:
        logger.info("the CUDA attention kernels have no head dim %d (they have %s): using the torch reference",
                    head_dim, HEAD_DIMS)
        return "torch"
    try:
        import cupy  # noqa: F401
    except ImportError as error:
        logger.warning("CUDA attention kernels unavailable (%s); using the torch reference", error)
        return "torch"
    return "cuda"


def get_backend(name: str, device: str, head_dim: Optional[int] = None) -> AttentionBackend:
    """The backend registered as `name` ('auto': `auto_backend_name`), for a model of this head
    dim on this device; raises where it cannot run there (its `check_supported`)."""
    if name == "auto":
        name = auto_backend_name(device, head_dim)
    check_backend_name(name)
    backend_class = BACKENDS[name]
    backend_class.check_supported(device, head_dim)
    return backend_class()


def check_backend_name(name: str) -> None:
    """Raises InvalidConfigError unless `name` is 'auto' or a registered backend's."""
    if name != "auto" and name not in BACKENDS:
        names = ", ".join(repr(known) for known in ("auto", *BACKENDS))
        raise InvalidConfigError(f"attention_backend must be one of {names}, got {name!r}")

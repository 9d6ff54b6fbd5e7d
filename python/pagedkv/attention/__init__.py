"""Attention backends behind one Protocol (backend.py): `torch` (torch_ref.py, the reference on
CPU and GPU; the oracle), `cpu` (cpu.py, the reference with decode and prefill in Rust), `cuda`
(cuda.py, pagedkv's kernels), chosen by name in registry.py. A step's forward reads them through
one StepContext (step_context.py): its AttentionMetadata (metadata.py), the KV cache, the backend
and the step's LoRA adapters.
"""

from __future__ import annotations

from pagedkv.attention.backend import AttentionBackend
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.registry import BACKENDS, get_backend
from pagedkv.attention.step_context import StepContext
from pagedkv.attention.torch_ref import TorchRefBackend

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "StepContext", "TorchRefBackend", "get_backend"]

"""Host-to-device copies of a step's inputs that never wait for the GPU."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (host) on `device`. On CUDA through pinned memory with non_blocking: a copy from
    pageable memory waits for all work queued on the stream first (CUDA's rule for pageable
    transfers), so one made after a step's forward was launched would stall the host until the
    forward ends and leave the GPU idle while the host then launches the logits and sampling."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)

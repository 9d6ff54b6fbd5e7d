"""The tensor-parallel group of this process: its rank, the group's size, the collectives.

Layers capture the group current while the model is built (`using_group`), so two engines of a
process (a tensor-parallel one and a plain one) keep their own."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: Optional[Any] = None  # torch.distributed group of the model's all-reduces (NCCL on CUDA, gloo on CPU)
    control: Optional[Any] = None  # gloo group of the step broadcasts
    agreements: Optional[Any] = None  # gloo group of the start's agreements (a longer timeout)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; returns it."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.group)
        return tensor

    def min(self, value: int) -> int:
        """The smallest of the ranks' values (the KV block count they agree on)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.agreements or self.control)
        return int(tensor.item())

    def shard(self, total: int) -> tuple[int, int]:
        """(start, stop) of this rank's part of `total` items split evenly (the caller checked
        it divides)."""
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part


SINGLE_PROCESS = TensorParallelGroup()
_current = SINGLE_PROCESS


def current_group() -> TensorParallelGroup:
    """The group the model being built belongs to (SINGLE_PROCESS outside `using_group`)."""
    return _current


@contextlib.contextmanager
def using_group(group: TensorParallelGroup):
    global _current
    previous, _current = _current, group
    try:
        yield group
    finally:
        _current = previous

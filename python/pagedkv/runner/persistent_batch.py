"""The runner's persistent batch: one block-table row per sequence, kept across steps (the
scheduler assigns rows) and patched only by the changes each step reports, so a step costs two
calls into the Rust core whatever the context lengths (vLLM V1's persistent batch). The tables
live in host memory (pinned on CUDA); each step copies its sequences' rows to the device at once."""

from __future__ import annotations

import numpy as np
import torch

from pagedkv.errors import InvalidStateError
from pagedkv.kernels.transfer import to_device


class PersistentBatch:
    """Block tables of the sequences on the device, a row each (`SchedulerOutput.rows`)."""

    def __init__(self, max_blocks_per_seq: int, device: torch.device, initial_rows: int = 64):
        self.device = device
        self.host_tables = self._new_tables(initial_rows, max_blocks_per_seq)

    def apply(self, plan) -> None:
        """Writes the step's block-table changes: sequence i's blocks from `block_table_from[i]` on
        are its reported update (blocks past its update are stale and never read)."""
        try:
            plan.write_block_tables(self.host_tables)
        except InvalidStateError:
            needed = int(plan.rows.max()) + 1 if plan.num_scheduled else 0
            if needed <= self.host_tables.shape[0]:
                raise  # (a table wider than max_model_len's blocks: a bug upstream)
            self._grow(needed)
            plan.write_block_tables(self.host_tables)

    def tables(self, plan, num_blocks: int) -> torch.Tensor:
        """[plan.num_scheduled, num_blocks] block tables of the plan's sequences, on the device."""
        out = torch.empty((plan.num_scheduled, num_blocks), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        plan.gather_block_tables(self.host_tables, out.numpy())
        return to_device(out, self.device)

    def _new_tables(self, num_rows: int, width: int) -> np.ndarray:
        pinned = self.device.type == "cuda"
        return torch.zeros((num_rows, width), dtype=torch.int32, pin_memory=pinned).numpy()

    def _grow(self, num_rows: int) -> None:
        grown = self._new_tables(max(num_rows, 2 * self.host_tables.shape[0]), self.host_tables.shape[1])
        grown[: self.host_tables.shape[0]] = self.host_tables
        self.host_tables = grown

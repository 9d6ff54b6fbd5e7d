"""The runner's persistent batch: one block-table row per sequence, kept across steps (the
scheduler assigns rows) and patched only by the changes each step reports, so a step costs two
calls into the Rust core whatever the context lengths (vLLM V1's persistent batch). The tables
live in host memory (pinned on CUDA); each step copies its sequences' rows to the device at once.
With several KV-cache groups a sequence has a row in each group's tables, kept one after another."""

from __future__ import annotations

import numpy as np
import torch

from pagedkv.errors import InvalidStateError
from pagedkv.kernels.transfer import to_device


class PersistentBatch:
    """Block tables of the sequences on the device, a row each (`SchedulerOutput.rows`)."""

    def __init__(self, max_blocks_per_seq: int, device: torch.device, initial_rows: int = 64, num_kv_groups: int = 1):
        self.device = device
        self.num_kv_groups = num_kv_groups
        self.host_tables = self._new_tables(initial_rows, max_blocks_per_seq)

    def apply(self, plan) -> None:
        """Writes the step's block-table changes: sequence i's blocks from `block_table_from[i]` on
        are its reported update (blocks past its update are stale and never read)."""
        try:
            plan.write_block_tables(self.host_tables)
        except InvalidStateError:
            needed = int(plan.rows.max()) + 1 if plan.num_scheduled else 0
            if needed <= self.rows_per_group:
                raise  # (a table wider than max_model_len's blocks: a bug upstream)
            self._grow(needed)
            plan.write_block_tables(self.host_tables)

    @property
    def rows_per_group(self) -> int:
        return self.host_tables.shape[0] // self.num_kv_groups

    def tables(self, plan, num_blocks: int) -> torch.Tensor:
        """[G * plan.num_scheduled, num_blocks] block tables of the plan's sequences in each of the
        G KV-cache groups (group after group), on the device."""
        out = torch.empty((self.num_kv_groups * plan.num_scheduled, num_blocks), dtype=torch.int32,
                          pin_memory=self.device.type == "cuda")
        plan.gather_block_tables(self.host_tables, out.numpy())
        return to_device(out, self.device)

    def _new_tables(self, num_rows: int, width: int) -> np.ndarray:
        """Room for `num_rows` sequences in each KV-cache group."""
        pinned = self.device.type == "cuda"
        return torch.zeros((self.num_kv_groups * num_rows, width), dtype=torch.int32, pin_memory=pinned).numpy()

    def _grow(self, num_rows: int) -> None:
        rows = self.rows_per_group
        grown = self._new_tables(max(num_rows, 2 * rows), self.host_tables.shape[1])
        grown_rows = grown.shape[0] // self.num_kv_groups
        for group in range(self.num_kv_groups):
            grown[group * grown_rows:group * grown_rows + rows] = self.host_tables[group * rows:(group + 1) * rows]
        self.host_tables = grown

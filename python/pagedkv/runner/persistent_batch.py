"""The runner's persistent batch: one block-table row per sequence on the device, kept across
steps (the scheduler assigns rows) and patched only by the changes each step reports, so a step
costs a few vectorised copies whatever the context lengths (vLLM V1's persistent batch)."""

from __future__ import annotations

import numpy as np
import torch

from pagedkv.transfer import to_device


class PersistentBatch:
    """Block tables of the sequences on the device, a row each (`SchedulerOutput.rows`)."""

    def __init__(self, max_blocks_per_seq: int, device: torch.device, initial_rows: int = 64):
        self.device = device
        self.block_tables = torch.zeros((initial_rows, max_blocks_per_seq), dtype=torch.int32, device=device)

    def apply(self, plan) -> None:
        """Writes the step's block-table changes: sequence i's blocks from `block_table_from[i]` on
        are its reported update (blocks past its update are stale and never read)."""
        update_loc = plan.block_table_update_loc
        num_updates = int(update_loc[-1])
        rows = plan.rows
        if rows.size and int(rows.max()) >= self.block_tables.shape[0]:
            self._grow(int(rows.max()) + 1)
        if num_updates == 0:
            return
        lengths = np.diff(update_loc)
        update_rows = np.repeat(rows, lengths)
        # Column of each update entry: its sequence's first changed block, plus its place in the run.
        columns = np.repeat(plan.block_table_from - update_loc[:-1], lengths) + np.arange(num_updates)
        values = torch.from_numpy(plan.block_table_updates)
        index = (torch.from_numpy(update_rows), torch.from_numpy(columns))
        if self.device.type != "cpu":
            index = tuple(to_device(part, self.device) for part in index)
            values = to_device(values, self.device)
        self.block_tables.index_put_(index, values)

    def tables(self, rows: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """[len(rows), num_blocks] block tables of these rows (a gather, no per-sequence work)."""
        return self.block_tables[rows, :num_blocks]

    def _grow(self, num_rows: int) -> None:
        grown = torch.zeros((max(num_rows, 2 * self.block_tables.shape[0]), self.block_tables.shape[1]),
                            dtype=torch.int32, device=self.device)
        grown[: self.block_tables.shape[0]] = self.block_tables
        self.block_tables = grown

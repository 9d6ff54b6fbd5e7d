"""The step rank 0 broadcasts to the other ranks: what ModelRunner.execute reads of the
scheduler's output (its columns and the swap/copy lists), as plain picklable arrays."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


@dataclass(frozen=True)
class StepPlan:
    num_scheduled: int
    seq_ids: np.ndarray
    rows: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    samples: np.ndarray
    query_start_loc: np.ndarray
    token_ids: np.ndarray
    slot_mapping: np.ndarray
    block_table_from: np.ndarray
    block_table_update_loc: np.ndarray
    block_table_updates: np.ndarray
    blocks_to_swap_out: list
    blocks_to_swap_in: list
    blocks_to_copy: list

    @classmethod
    def of(cls, output) -> StepPlan:
        """The plan of a SchedulerOutput (or of anything with its attributes)."""
        return cls(**{field.name: getattr(output, field.name) for field in fields(cls)})

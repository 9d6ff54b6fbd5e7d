"""The runner's persistent batch against a rebuild from scratch: under the liveness machine's
random workloads (forks, swaps, recomputes, aborts, finished sequences, tiny pools), after every
step each scheduled sequence's row, patched only by the reported changes, holds the blocks of its
whole table as the scheduler has it."""

import pathlib
import sys

import torch
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from pagedkv.runner.persistent_batch import PersistentBatch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "core"))  # (the core's tests: tests/core)
from test_scheduler_liveness import LivenessMachine  # noqa: E402


class PersistentBatchMachine(LivenessMachine):
    def step(self):
        super().step()
        if not hasattr(self, "batch"):
            self.batch = PersistentBatch(-(-96 // self.config.block_size), torch.device("cpu"), initial_rows=2)
        plan = self.last_plan
        self.batch.apply(plan)
        if plan.num_scheduled == 0:
            return
        assert len(set(plan.rows.tolist())) == plan.num_scheduled, "two sequences share a row"
        num_blocks = -(-int(plan.ends.max()) // self.config.block_size)
        tables = self.batch.tables(plan, num_blocks)
        for i, (seq_id, end) in enumerate(zip(plan.seq_ids.tolist(), plan.ends.tolist())):
            used = -(-end // self.config.block_size)
            assert tables[i, :used].tolist() == self.scheduler.block_table(seq_id)[:used], f"sequence {seq_id}"


def test_persistent_batch_equals_the_scheduler_tables_after_every_step():
    run_state_machine_as_test(PersistentBatchMachine, settings=settings(max_examples=100, stateful_step_count=60, deadline=None))

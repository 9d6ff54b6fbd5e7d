"""Stateful property tests of the block manager through its Python API.

Besides the bookkeeping invariants, the machine simulates the KV cache itself: every token is
"written" into the slot the manager gives it, copy-on-write and swap copies are executed, and each
live sequence must read back exactly its own tokens through its block table. Wrong sharing, a
missed copy or a stale prefix-cache hit shows up as a wrong token. A second machine runs the same
rules under a sliding window: blocks before each sequence's window are released, and the tokens
in the window must still read back. A third has KV-cache groups, a full one and a windowed one
over one pool: every sequence's tokens must read back through each group's table.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from pagedkv_core import BlockManager, OutOfBlocksError

BLOCK_SIZE = 4
NUM_DEVICE_BLOCKS = 12
NUM_CPU_BLOCKS = 8
# A tiny vocabulary so that prompts share prefixes and hit the prefix cache.
token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class BlockManagerMachine(RuleBasedStateMachine):
    windows = (0,)  # each KV-cache group's window: positions each token attends to (0: all)

    def __init__(self):
        super().__init__()
        self.manager = BlockManager(NUM_DEVICE_BLOCKS * len(self.windows), NUM_CPU_BLOCKS * len(self.windows),
                                    BLOCK_SIZE, enable_prefix_caching=True, kv_group_windows=list(self.windows))
        self.tokens: dict[int, list[int]] = {}  # the model: each live sequence's tokens
        self.device_slots: dict[int, int] = {}  # simulated device KV: slot -> token
        self.cpu_slots: dict[int, int] = {}
        self.next_seq = 0

    # -- helpers ---------------------------------------------------------------------------
    def first_needed_position(self, seq: int, group: int) -> int:
        """The first position the sequence's next token attends to in `group` (after its last append)."""
        window = self.windows[group]
        return max(0, len(self.tokens[seq]) - window) if window else 0

    def live_blocks(self, seq: int) -> list[int]:
        return [block for group in range(len(self.windows))
                for block in self.manager.block_table(seq, group)[self.manager.num_released_blocks(seq, group):]]

    def on_device(self):
        return [seq for seq in self.tokens if not self.manager.is_swapped(seq)]

    def swapped(self):
        return [seq for seq in self.tokens if self.manager.is_swapped(seq)]

    def write(self, seq: int, first: int) -> None:
        for group in range(len(self.windows)):
            table = self.manager.block_table(seq, group)
            for pos in range(first, len(self.tokens[seq])):
                block = table[pos // BLOCK_SIZE]
                assert self.manager.refcount(block) == 1, f"writing into shared block {block}"
                self.device_slots[block * BLOCK_SIZE + pos % BLOCK_SIZE] = self.tokens[seq][pos]

    @staticmethod
    def copy_block(src_slots, src, dst_slots, dst):
        for offset in range(BLOCK_SIZE):
            value = src_slots.get(src * BLOCK_SIZE + offset)
            if value is not None:
                dst_slots[dst * BLOCK_SIZE + offset] = value

    def free_counts(self):
        return self.manager.num_free_device_blocks, self.manager.num_free_cpu_blocks

    # -- rules -----------------------------------------------------------------------------
    @rule(tokens=token_lists)
    def allocate(self, tokens):
        seq, before = self.next_seq, self.free_counts()
        try:
            hits = self.manager.allocate(seq, tokens)
        except OutOfBlocksError:
            assert self.free_counts() == before, "a failed allocation changed the pools"
            return
        self.next_seq += 1
        assert hits % BLOCK_SIZE == 0 and hits < len(tokens)
        self.tokens[seq] = list(tokens)
        self.write(seq, hits)

    @precondition(lambda self: self.on_device())
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(self.on_device()))
        before = self.free_counts()
        try:
            copies = self.manager.append_token(seq, token)
        except OutOfBlocksError:
            assert self.free_counts() == before
            return
        assert len(copies) in (0, len(self.windows)), "a shared last block is shared in every group"
        for src, dst in copies:
            self.copy_block(self.device_slots, src, self.device_slots, dst)
        self.tokens[seq].append(token)
        self.write(seq, len(self.tokens[seq]) - 1)
        # Blocks wholly before each group's window are gone; the rest stay.
        for group in range(len(self.windows)):
            assert self.manager.num_released_blocks(seq, group) == self.first_needed_position(seq, group) // BLOCK_SIZE

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_seq
        self.next_seq += 1
        self.manager.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(seq)
        del self.tokens[seq]

    @precondition(lambda self: self.on_device())
    @rule(data=st.data())
    def swap_out(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self.on_device()), min_size=1, max_size=3, unique=True))
        before = self.free_counts()
        try:
            copies = self.manager.swap_out(seqs)
        except OutOfBlocksError:
            assert self.free_counts() == before
            return
        assert len({src for src, _ in copies}) == len(copies), "a shared block was moved twice"
        for src, dst in copies:
            self.copy_block(self.device_slots, src, self.cpu_slots, dst)

    @precondition(lambda self: self.swapped())
    @rule(data=st.data())
    def swap_in(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self.swapped()), min_size=1, max_size=3, unique=True))
        before = self.free_counts()
        try:
            copies = self.manager.swap_in(seqs)
        except OutOfBlocksError:
            assert self.free_counts() == before
            return
        for src, dst in copies:
            self.copy_block(self.cpu_slots, src, self.device_slots, dst)

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def refcounts_match_tables(self):
        STEPS_RUN[0] += 1
        holders = {True: [0] * self.manager.num_device_blocks, False: [0] * self.manager.num_cpu_blocks}
        for seq in self.tokens:
            for block in self.live_blocks(seq):
                holders[not self.manager.is_swapped(seq)][block] += 1
        for on_device, counts in holders.items():
            for block, count in enumerate(counts):
                assert self.manager.refcount(block, on_device) == count
        # Free = unreferenced (cached blocks count as free), and used + free = total.
        assert self.manager.num_free_device_blocks == holders[True].count(0)
        assert self.manager.num_free_cpu_blocks == holders[False].count(0)
        self.manager.check_invariants()

    @invariant()
    def every_sequence_reads_back_its_tokens(self):
        for seq, tokens in self.tokens.items():
            assert self.manager.num_tokens(seq) == len(tokens)
            slots = self.cpu_slots if self.manager.is_swapped(seq) else self.device_slots
            for group in range(len(self.windows)):
                table = self.manager.block_table(seq, group)
                assert len(table) == -(-len(tokens) // BLOCK_SIZE)
                first = self.first_needed_position(seq, group)
                assert self.manager.num_released_blocks(seq, group) <= first // BLOCK_SIZE
                read = [slots.get(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
                        for pos in range(first, len(tokens))]
                assert read == tokens[first:], f"sequence {seq} group {group} reads {read}, expected {tokens[first:]}"

    def teardown(self):
        for seq in list(self.tokens):
            self.manager.free(seq)
        assert self.manager.num_free_device_blocks == self.manager.num_device_blocks
        assert self.manager.num_free_cpu_blocks == self.manager.num_cpu_blocks


class WindowedBlockManagerMachine(BlockManagerMachine):
    windows = (6,)  # a window and a half of blocks of 4: whether a block goes depends on alignment


class HybridBlockManagerMachine(BlockManagerMachine):
    windows = (0, 6)  # a full group and a windowed one (Gemma 3, GPT-OSS): one table each


STEPS_RUN = [0]


@pytest.mark.parametrize("machine", [BlockManagerMachine, WindowedBlockManagerMachine, HybridBlockManagerMachine],
                         ids=["full", "windowed", "hybrid"])
def test_block_manager_state_machine_runs_at_least_10000_steps(machine):
    STEPS_RUN[0] = 0
    run_state_machine_as_test(machine, settings=settings(max_examples=300, stateful_step_count=80, deadline=None))
    assert STEPS_RUN[0] >= 10_000, f"only {STEPS_RUN[0]} steps ran"

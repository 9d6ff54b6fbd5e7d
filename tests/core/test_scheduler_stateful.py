"""Stateful property tests of the scheduler through its Python API, with everything on at once:
the priority policy, prefix caching and its CPU tier, swap preemption in a small pool, forks,
speculative drafts partly accepted, and aborts.

The machine plays the model runner: it executes each step's copies (swap-outs, swap-ins,
copy-on-write, in that order) on a simulated KV cache, writes every scheduled token into its
slot, and then every scheduled sequence must read its own tokens back through its block table.
A second machine adds a sliding window: blocks behind each window are released, and a sequence
must read back the tokens its new ones attend to.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from pagedkv_core import Scheduler, SchedulerConfig

BLOCK_SIZE = 4
NUM_DEVICE_BLOCKS = 16
NUM_CPU_BLOCKS = 12


class SchedulerMachine(RuleBasedStateMachine):
    windows = (0,)  # each KV-cache group's window (0: full attention)
    preemption_mode = "swap"
    enable_kv_events = False

    def __init__(self):
        super().__init__()
        groups = len(self.windows)
        config = SchedulerConfig(
            block_size=BLOCK_SIZE, num_device_blocks=NUM_DEVICE_BLOCKS * groups, num_cpu_blocks=NUM_CPU_BLOCKS * groups,
            max_num_seqs=6, max_num_batched_tokens=16, max_model_len=40, max_waiting_requests=64,
            enable_prefix_caching=True, enable_cpu_prefix_cache=True, preemption_mode=self.preemption_mode,
            scheduling_policy="priority", watermark=0.0, sliding_window=self.windows[0] if groups == 1 else 0,
            kv_group_windows=list(self.windows) if groups > 1 else [], enable_kv_events=self.enable_kv_events,
        )
        self.scheduler = Scheduler(config)
        self.tokens: dict[int, list[int]] = {}  # each live sequence's tokens, as the engine knows them
        self.drafts: dict[int, int] = {}  # sequence -> drafts awaiting verification
        self.sampled: list[int] = []  # sequences that got sample=True in the last step
        self.request_of: dict[int, str] = {}
        self.device: dict[int, int] = {}  # simulated KV cache: slot -> token
        self.cpu: dict[int, int] = {}
        self.next_request = 0

    def copy(self, source, src, target, dst):
        for offset in range(BLOCK_SIZE):
            value = source.get(src * BLOCK_SIZE + offset)
            if value is None:
                target.pop(dst * BLOCK_SIZE + offset, None)
            else:
                target[dst * BLOCK_SIZE + offset] = value

    @rule(length=st.integers(1, 14), seed=st.integers(0, 2), priority=st.integers(-1, 2))
    def add_request(self, length, seed, priority):
        request_id = f"r{self.next_request}"
        self.next_request += 1
        prompt = [seed * 100 + i % 7 for i in range(length)]  # few distinct prefixes: cache hits
        seq_id = self.scheduler.add_request(request_id, prompt, priority=priority)
        self.tokens[seq_id] = list(prompt)
        self.request_of[seq_id] = request_id

    @precondition(lambda self: self.tokens and not self.sampled)  # (the engine reports before the next step)
    @rule()
    def step(self):
        out = self.scheduler.schedule()
        for request_id in out.aborted:  # (too big for the pool once grown: dropped)
            self.forget(request_id)
        for seq_id in list(self.drafts):  # a recompute drops unverified drafts
            if seq_id in self.tokens and self.scheduler.sequence_len(seq_id) < len(self.tokens[seq_id]):
                del self.tokens[seq_id][self.scheduler.sequence_len(seq_id):]
                del self.drafts[seq_id]
        for device_block, cpu_block in out.blocks_to_swap_out:
            self.copy(self.device, device_block, self.cpu, cpu_block)
        for cpu_block, device_block in out.blocks_to_swap_in:
            self.copy(self.cpu, cpu_block, self.device, device_block)
        for src, dst in out.blocks_to_copy:
            self.copy(self.device, src, self.device, dst)
        assert out.num_kv_groups == len(self.windows)
        slots, starts = out.slot_mapping.reshape(out.num_kv_groups, -1).tolist(), out.query_start_loc.tolist()
        for index, seq in enumerate(out.scheduled):
            assert seq.token_ids == self.tokens[seq.seq_id][seq.start : seq.end]
            for group_slots in slots:  # (each group's layers write their K/V)
                for slot, token in zip(group_slots[starts[index]:starts[index + 1]], seq.token_ids):
                    self.device[slot] = token
        for seq in out.scheduled:
            for group, window in enumerate(self.windows):
                table = self.scheduler.block_table(seq.seq_id, group)
                first = max(0, seq.start + 1 - window) if window else 0
                read = [self.device.get(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
                        for pos in range(first, seq.end)]
                assert read == self.tokens[seq.seq_id][first : seq.end], f"sequence {seq.seq_id} reads wrong KV"
        self.sampled = [seq.seq_id for seq in out.scheduled if seq.sample and seq.seq_id in self.tokens]

    @precondition(lambda self: self.sampled)
    @rule(data=st.data())
    def report_samples(self, data):
        for seq_id in self.sampled:
            pending = self.drafts.pop(seq_id, 0)
            if pending:
                accepted = data.draw(st.integers(0, pending))
                self.scheduler.accept_drafts(seq_id, accepted)
                del self.tokens[seq_id][len(self.tokens[seq_id]) - (pending - accepted):]
            room = 40 - len(self.tokens[seq_id]) - 1
            action = data.draw(st.sampled_from(["append", "draft", "fork", "finish"]))
            if action == "finish" or room < 1:
                self.scheduler.finish_sequence(seq_id)
                del self.tokens[seq_id]
                continue
            token = data.draw(st.integers(0, 3))
            drafts = data.draw(st.lists(st.integers(0, 3), max_size=min(3, room - 1))) if action == "draft" else []
            self.scheduler.append_token(seq_id, token, drafts)
            self.tokens[seq_id] += [token, *drafts]
            if drafts:
                self.drafts[seq_id] = len(drafts)
            elif action == "fork" and self.group_size(seq_id) < 6:  # (a group fits max_num_seqs)
                child = self.scheduler.fork(seq_id)
                self.tokens[child] = list(self.tokens[seq_id])
                self.request_of[child] = self.request_of[seq_id]
        self.sampled = []

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(set(self.request_of[seq] for seq in self.tokens))))
        self.scheduler.abort(request_id)
        self.forget(request_id)

    def group_size(self, seq_id):
        return sum(self.request_of[other] == self.request_of[seq_id] for other in self.tokens)

    def forget(self, request_id):
        for seq_id in [seq for seq, owner in self.request_of.items() if owner == request_id]:
            self.tokens.pop(seq_id, None)
            self.drafts.pop(seq_id, None)
            if seq_id in self.sampled:
                self.sampled.remove(seq_id)

    @invariant()
    def bookkeeping_holds(self):
        self.scheduler.check_invariants()
        assert self.scheduler.has_unfinished_requests() == bool(self.tokens)

    def teardown(self):
        for request_id in sorted(set(self.request_of[seq] for seq in self.tokens)):
            self.scheduler.abort(request_id)
        self.scheduler.schedule()  # releases the CPU blocks pinned for the last step's copies
        stats = self.scheduler.stats()
        assert stats["num_free_device_blocks"] == stats["num_device_blocks"]
        assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]


class WindowedSchedulerMachine(SchedulerMachine):
    windows = (6,)


class HybridSchedulerMachine(SchedulerMachine):
    windows = (6, 0)  # a windowed KV-cache group and a full one over one pool


@pytest.mark.parametrize("machine", [SchedulerMachine, WindowedSchedulerMachine, HybridSchedulerMachine],
                         ids=["full", "windowed", "hybrid"])
def test_scheduler_state_machine(machine):
    run_state_machine_as_test(machine, settings=settings(max_examples=150, stateful_step_count=60, deadline=None))

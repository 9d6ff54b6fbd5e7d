"""Scheduler liveness through the Python API: the issue's three reproductions, and a hypothesis
state machine over random configurations (tiny pools, block sizes 1-16, swap / recompute / auto,
prefix caching on and off) and random requests that fork samples or beams, free siblings and are
aborted at any point. After every step an oracle of the block tables checks refcounts and free
counts, that some token is scheduled within a few steps while anything is unfinished, and that a
request is dropped only when it cannot run alone on the empty pool; in the end every request
finishes or is dropped so."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from pagedkv_core import Scheduler, SchedulerConfig
from pagedkv_core.errors import UnknownSequenceError

MAX_IDLE_STEPS = 2  # a step that preempts admits nothing; the next one must run something


def test_a_swapped_group_comes_back_on_an_empty_pool_and_later_requests_start():
    s = Scheduler(SchedulerConfig(num_device_blocks=100, num_cpu_blocks=200, max_model_len=2048))
    s.add_request("A", [1])
    s.add_request("B", [2] * (98 * 16))
    for _ in range(60):
        for x in s.schedule().scheduled:
            if not x.sample:
                continue
            if (x.request_id == "A" and x.end >= 20) or x.end >= s.max_model_len:
                s.finish_sequence(x.seq_id)
            else:
                s.append_token(x.seq_id, 7)
    assert s.stats()["num_preemptions_swap"] == 1 and s.stats()["num_swapped"] == 0
    s.add_request("C", [3, 3, 3])
    assert [x.request_id for x in s.schedule().scheduled] == ["C"]


def test_sharers_of_a_partial_last_block_need_one_copy_less_than_they_are():
    s = Scheduler(SchedulerConfig(block_size=4, num_device_blocks=8, num_cpu_blocks=0, max_model_len=32,
                                  max_num_batched_tokens=64, enable_prefix_caching=False, watermark=0.0))
    g = s.add_request("g", list(range(25)))  # 7 blocks, 1 free
    s.schedule()
    s.append_token(g, 1)
    s.fork(g)
    out = s.schedule()
    assert out.aborted == [] and len(out.scheduled) == 2 and len(out.blocks_to_copy) == 1


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_a_forked_group_recomputed_fits_as_it_did_and_samples_as_one(enable_prefix_caching):
    s = Scheduler(SchedulerConfig(block_size=4, num_device_blocks=10, num_cpu_blocks=0, max_model_len=64,
                                  max_num_batched_tokens=64, enable_prefix_caching=enable_prefix_caching,
                                  preemption_mode="recompute", watermark=0.0))
    s.add_request("old", list(range(7)))
    pair = s.add_request("pair", list(range(100, 120)))  # 5 blocks, then one more for each sample
    preempted = False
    for step in range(40):
        out = s.schedule()
        assert out.aborted == [], out.abort_reasons
        preempted |= "pair" in out.preempted
        sampled = [x.seq_id for x in out.scheduled if x.sample and x.request_id == "pair"]
        if preempted and sampled:
            assert len(sampled) == 2  # both samples, in the same step, as before the preemption
            break
        for x in out.scheduled:
            if x.sample and x.request_id == "old" and preempted:
                s.finish_sequence(x.seq_id)
            elif x.sample:
                s.append_token(x.seq_id, 1000 + x.seq_id)  # siblings diverge
        if step == 0:
            s.fork(pair)
    else:
        pytest.fail("the pair was not preempted, or did not come back")


class LivenessMachine(RuleBasedStateMachine):
    """Plays the engine over one random configuration; the oracle is this class's own record of
    requests and tokens, and the block tables the scheduler reports."""

    @initialize(block_size=st.sampled_from([1, 2, 4, 8, 16]), num_device_blocks=st.integers(4, 32),
                num_cpu_blocks=st.sampled_from([0, 4, 32]), mode=st.sampled_from(["swap", "recompute", "auto"]),
                caching=st.booleans(), budget=st.sampled_from([4, 16, 64]), watermark=st.sampled_from([0.0, 0.1]))
    def configure(self, block_size, num_device_blocks, num_cpu_blocks, mode, caching, budget, watermark):
        num_device_blocks = max(4, min(num_device_blocks, 96 // block_size))  # at most 96 tokens: pressure
        self.config = SchedulerConfig(
            block_size=block_size, num_device_blocks=num_device_blocks, num_cpu_blocks=num_cpu_blocks,
            max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=96, max_waiting_requests=64,
            enable_prefix_caching=caching, preemption_mode=mode, watermark=watermark,
        )
        self.scheduler = Scheduler(self.config)
        self.tokens: dict[int, list[int]] = {}  # each live sequence's tokens
        self.requests: dict[str, tuple[int, list[int]]] = {}  # request -> (prompt length, live sequences)
        self.sampled: list[int] = []
        self.next_request = 0
        self.idle_steps = 0

    @precondition(lambda self: len(self.requests) < 12)
    @rule(share=st.floats(0.0, 0.8), seed=st.integers(0, 1))
    def add_request(self, share, seed):
        """A prompt of up to 80% of the pool: a few of them put it under pressure."""
        request_id = f"r{self.next_request}"
        self.next_request += 1
        pool_tokens = self.config.num_device_blocks * self.config.block_size
        prompt = [seed * 1000 + i for i in range(max(1, min(80, int(share * pool_tokens))))]
        try:
            seq_id = self.scheduler.add_request(request_id, prompt)
        except ValueError as error:  # longer than the pool: refused at once, naming it
            assert "blocks" in str(error) or "max_model_len" in str(error)
            return
        self.tokens[seq_id] = list(prompt)
        self.requests[request_id] = (len(prompt), [seq_id])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def step_and_report(self, data):
        self.step()
        self.report_samples(data)

    def step(self):
        out = self.last_plan = self.scheduler.schedule()
        for request_id, reason in zip(out.aborted, out.abort_reasons):
            needed = self.blocks_alone(request_id)
            assert needed > self.config.num_device_blocks, f"{request_id} dropped ({reason}) but needs {needed} blocks"
            self.forget(request_id)
        for x in out.scheduled:
            assert x.token_ids == self.tokens[x.seq_id][x.start : x.end]
        self.idle_steps = 0 if out.scheduled or not self.requests else self.idle_steps + 1
        assert self.idle_steps <= MAX_IDLE_STEPS, f"stalled: {self.scheduler.stats()}"
        self.sampled = [x.seq_id for x in out.scheduled if x.sample]

    def report_samples(self, data):
        for seq_id in self.sampled:
            request_id = self.request_of(seq_id)
            prompt_len, seqs = self.requests[request_id]
            action = data.draw(st.sampled_from(["append"] * 6 + ["fork", "finish"]))
            if action == "finish" or len(self.tokens[seq_id]) >= self.scheduler.max_model_len:
                self.scheduler.finish_sequence(seq_id)
                seqs.remove(seq_id)
                del self.tokens[seq_id]
                if not seqs:
                    del self.requests[request_id]
                continue
            token = data.draw(st.integers(0, 2))
            self.scheduler.append_token(seq_id, token)
            self.tokens[seq_id].append(token)
            if action == "fork" and len(seqs) < min(self.config.max_num_seqs, self.config.max_num_batched_tokens):
                child = self.scheduler.fork(seq_id)
                seqs.append(child)
                self.tokens[child] = list(self.tokens[seq_id])
        self.sampled = []

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        if data.draw(st.integers(0, 3)):
            return  # (rarely: most requests run to their end)
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        self.scheduler.abort(request_id)
        self.forget(request_id)

    def request_of(self, seq_id):
        return next(request_id for request_id, (_, seqs) in self.requests.items() if seq_id in seqs)

    def forget(self, request_id):
        for seq_id in self.requests.pop(request_id)[1]:
            del self.tokens[seq_id]

    def blocks_alone(self, request_id):
        """An upper bound of the blocks a request needs to take its next step alone: its sequences
        share their prompt's full blocks (forks come after the prompt is computed), nothing more."""
        prompt_len, seqs = self.requests[request_id]
        shared = prompt_len // self.config.block_size
        return shared + sum(-(-len(self.tokens[seq]) // self.config.block_size) - shared for seq in seqs)

    @invariant()
    def block_tables_agree_with_the_pools(self):
        if not hasattr(self, "scheduler"):
            return
        s = self.scheduler
        s.check_invariants()
        assert s.num_unfinished_requests == len(self.requests)
        holders = {True: {}, False: {}}  # on_device -> block -> tables holding it
        for seq_id in self.tokens:
            try:
                table = s.block_table(seq_id)
            except UnknownSequenceError:
                continue  # waiting, or about to be rebuilt after a recompute
            pool = holders[not s.is_swapped(seq_id)]
            for block in table:
                pool[block] = pool.get(block, 0) + 1
        stats = s.stats()
        for on_device, num_blocks in ((True, self.config.num_device_blocks), (False, self.config.num_cpu_blocks)):
            assert all(s.refcount(block, on_device) == holders[on_device].get(block, 0) for block in range(num_blocks))
        assert stats["num_free_device_blocks"] == self.config.num_device_blocks - len(holders[True])
        assert stats["num_free_cpu_blocks"] == self.config.num_cpu_blocks - len(holders[False])

    def teardown(self):
        """Every request left finishes (each sequence stops after a few more tokens) or is
        dropped as it may be, within a bounded number of steps; then every block is free."""
        if not hasattr(self, "scheduler"):
            return
        budget = {seq_id: len(tokens) + 8 for seq_id, tokens in self.tokens.items()}
        for _ in range(2000):
            if not self.requests:
                break
            self.step()
            for seq_id in self.sampled:
                request_id = self.request_of(seq_id)
                if len(self.tokens[seq_id]) >= min(budget.get(seq_id, 0), self.scheduler.max_model_len):
                    self.scheduler.finish_sequence(seq_id)
                    self.requests[request_id][1].remove(seq_id)
                    del self.tokens[seq_id]
                    if not self.requests[request_id][1]:
                        del self.requests[request_id]
                else:
                    self.scheduler.append_token(seq_id, 0)
                    self.tokens[seq_id].append(0)
            self.sampled = []
            self.block_tables_agree_with_the_pools()
        assert not self.requests, f"unfinished after 2000 steps: {self.scheduler.stats()}"
        self.scheduler.schedule()
        stats = self.scheduler.stats()
        assert stats["num_free_device_blocks"] == self.config.num_device_blocks
        assert stats["num_free_cpu_blocks"] == self.config.num_cpu_blocks


def test_scheduler_liveness_state_machine():
    run_state_machine_as_test(LivenessMachine, settings=settings(max_examples=200, stateful_step_count=80, deadline=None))

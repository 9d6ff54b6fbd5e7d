"""The scheduler through its Python API: the loop another serving stack would drive."""

import threading

import pytest

import pagedkv_core
from pagedkv_core import Scheduler, SchedulerConfig


def small_config(**overrides):
    values = dict(block_size=4, num_device_blocks=8, num_cpu_blocks=8, max_model_len=32, max_num_batched_tokens=32)
    values.update(overrides)
    return SchedulerConfig(**values)


def test_errors_are_pagedkv_exception_classes_naming_the_limit():
    scheduler = Scheduler(small_config(max_waiting_requests=1))
    with pytest.raises(pagedkv_core.PromptTooLongError, match="max_model_len=32"):
        scheduler.add_request("long", list(range(33)))
    scheduler.add_request("a", [1, 2, 3])
    with pytest.raises(pagedkv_core.OverloadedError, match="max_waiting_requests=1"):
        scheduler.add_request("b", [1, 2, 3])
    with pytest.raises(pagedkv_core.DuplicateRequestError):
        scheduler.add_request("a", [1])
    with pytest.raises(pagedkv_core.UnknownRequestError):
        scheduler.abort("nobody")
    with pytest.raises(pagedkv_core.UnknownSequenceError):
        scheduler.append_token(999, 1)
    with pytest.raises(pagedkv_core.InvalidConfigError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="sometimes")
    with pytest.raises(pagedkv_core.InvalidConfigError, match="power of two .*got 24"):
        SchedulerConfig(block_size=24)
    with pytest.raises(OverflowError):
        scheduler.add_request("neg", [-1])  # token ids are unsigned: a clear Python error, no panic
    assert isinstance(pagedkv_core.PromptTooLongError("x"), ValueError)


def test_a_model_loop_drives_requests_to_completion_with_preemption():
    scheduler = Scheduler(small_config(preemption_mode="swap", enable_prefix_caching=False))
    targets = {}
    for i in range(6):
        seq_id = scheduler.add_request(f"r{i}", [i] * (3 + i))
        targets[seq_id] = 3 + i + 8
    swapped_out = swapped_in = 0
    persistent_tables = {}  # what a persistent-batch consumer keeps, updated from block_table_from
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        swapped_out += len(out.blocks_to_swap_out)
        swapped_in += len(out.blocks_to_swap_in)
        for seq in out.scheduled:
            assert len(seq.slot_mapping) == len(seq.token_ids) == seq.end - seq.start
            assert all(slot // 4 in seq.block_table for slot in seq.slot_mapping)
            kept = persistent_tables.get(seq.seq_id, [])[: seq.block_table_from]
            persistent_tables[seq.seq_id] = kept + seq.block_table[seq.block_table_from :]
            assert persistent_tables[seq.seq_id] == seq.block_table == scheduler.block_table(seq.seq_id)
            if seq.sample:
                if scheduler.sequence_len(seq.seq_id) >= targets[seq.seq_id]:
                    scheduler.finish_sequence(seq.seq_id)
                else:
                    scheduler.append_token(seq.seq_id, 7)
        scheduler.check_invariants()
    stats = scheduler.stats()
    assert not scheduler.has_unfinished_requests()
    assert stats["num_preemptions_swap"] > 0 and swapped_out > 0 and swapped_in == swapped_out
    assert stats["num_free_device_blocks"] == 8 and stats["num_free_cpu_blocks"] == 8


def test_schedule_releases_the_gil():
    # Another Python thread keeps running while schedule() works on a large batch.
    scheduler = Scheduler(SchedulerConfig(num_device_blocks=20000, max_num_seqs=1024, max_num_batched_tokens=1 << 20,
                                          max_model_len=4096))
    for i in range(1024):
        scheduler.add_request(str(i), list(range(2000)))
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(1)

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        while not ticks:
            pass
        before = len(ticks)
        out = scheduler.schedule()
        during = len(ticks) - before
    finally:
        stop.set()
        thread.join()
    assert len(out.scheduled) == 1024
    # Holding the GIL, the other thread could not have run for the whole call.
    assert during > 1000, during


def test_priority_policy_lets_an_urgent_request_preempt_and_orders_the_queue():
    # 6 blocks of 4: two 8-token requests run; the urgent 12-token one needs 3 blocks.
    scheduler = Scheduler(small_config(num_device_blocks=6, scheduling_policy="priority", preemption_mode="swap",
                                       watermark=0.0, enable_prefix_caching=False))
    low = scheduler.add_request("low", list(range(8)), priority=1)
    lower = scheduler.add_request("lower", list(range(10, 18)), priority=2)
    scheduler.schedule()
    for seq_id in (low, lower):
        scheduler.append_token(seq_id, 5)
    urgent = scheduler.add_request("urgent", list(range(20, 32)), priority=-3)
    out = scheduler.schedule()
    assert out.preempted == ["lower"]
    assert [seq.request_id for seq in out.scheduled] == ["urgent", "low"]
    assert len(out.blocks_to_swap_out) == 2
    for seq_id in (low, urgent):
        scheduler.finish_sequence(seq_id)
    out = scheduler.schedule()
    assert [(seq.request_id, seq.start) for seq in out.scheduled] == [("lower", 8)]
    scheduler.finish_sequence(lower)
    stats = scheduler.stats()
    assert stats["num_free_device_blocks"] == 6 and stats["num_free_cpu_blocks"] == 8


def test_priorities_need_the_priority_policy():
    assert SchedulerConfig().scheduling_policy == "fcfs"
    scheduler = Scheduler(small_config())
    with pytest.raises(pagedkv_core.InvalidConfigError, match="scheduling_policy='priority'"):
        scheduler.add_request("a", [1, 2], priority=1)
    assert not scheduler.has_unfinished_requests()
    with pytest.raises(pagedkv_core.InvalidConfigError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")


def test_drafts_are_computed_in_one_piece_and_the_rejected_ones_dropped():
    scheduler = Scheduler(small_config(enable_prefix_caching=False))
    seq_id = scheduler.add_request("a", [1, 2, 3, 4, 5])
    scheduler.schedule()
    scheduler.append_token(seq_id, 6, [7, 8, 9])
    with pytest.raises(pagedkv_core.InvalidStateError):
        scheduler.accept_drafts(seq_id, 1)  # not computed yet
    [step] = scheduler.schedule().scheduled
    assert (step.start, step.end, step.token_ids, step.sample) == (5, 9, [6, 7, 8, 9], True)
    with pytest.raises(pagedkv_core.InvalidStateError, match="cannot accept 4 of 3 drafts"):
        scheduler.accept_drafts(seq_id, 4)
    scheduler.accept_drafts(seq_id, 1)  # keeps 6 and 7; 8 and 9 go with their slot
    assert scheduler.sequence_len(seq_id) == 7
    scheduler.append_token(seq_id, 10)
    [step] = scheduler.schedule().scheduled
    assert (step.start, step.end, step.token_ids) == (7, 8, [10])
    assert step.slot_mapping == [step.block_table[1] * 4 + 3]  # position 7 reuses the rejected draft's slot
    with pytest.raises(pagedkv_core.InvalidStateError, match="max_model_len=32"):
        scheduler.append_token(seq_id, 11, list(range(30)))
    with pytest.raises(pagedkv_core.InvalidStateError, match="max_num_batched_tokens=32"):
        scheduler.append_token(seq_id, 11, list(range(40)))
    scheduler.finish_sequence(seq_id)
    assert scheduler.stats()["num_free_device_blocks"] == 8


def test_the_columns_say_what_the_per_sequence_view_says_and_update_closes_the_step():
    """A workload with prefix hits, chunked prefills, forks, swaps and finishes: every step's
    numpy columns equal the per-sequence objects, and a persistent table per sequence patched by
    the reported changes alone equals its whole table; update() appends and finishes in one call."""
    import numpy as np

    scheduler = Scheduler(small_config(num_device_blocks=12, max_num_batched_tokens=8, preemption_mode="swap"))
    for i in range(6):
        scheduler.add_request(f"r{i}", [i % 2] * 4 + list(range(3 + i)))
    tables: dict[int, list[int]] = {}
    forked = False
    for step in range(60):
        out = scheduler.schedule()
        scheduled = out.scheduled
        assert out.num_scheduled == len(scheduled)
        assert out.seq_ids.tolist() == [x.seq_id for x in scheduled]
        assert out.starts.tolist() == [x.start for x in scheduled] and out.ends.tolist() == [x.end for x in scheduled]
        assert out.samples.tolist() == [x.sample for x in scheduled]
        assert out.is_prefill.tolist() == [x.is_prefill for x in scheduled]
        loc, update_loc = out.query_start_loc, out.block_table_update_loc
        lens = np.diff(loc)  # the derived columns, from the others
        assert out.positions.tolist() == [p for x in scheduled for p in range(x.start, x.end)]
        assert out.sample_index.tolist() == (loc[1:][out.samples] - 1).tolist()
        assert out.sample_rows.tolist() == np.flatnonzero(out.samples).tolist()
        multi = np.flatnonzero(lens[::-1] != 1)
        assert out.num_decodes == (int(multi[0]) if multi.size else len(scheduled))
        assert out.max_query_len == int(lens.max(initial=0)) and out.max_context_len == int(out.ends.max(initial=0))
        for i, x in enumerate(scheduled):
            assert out.token_ids[loc[i] : loc[i + 1]].tolist() == x.token_ids
            assert out.slot_mapping[loc[i] : loc[i + 1]].tolist() == x.slot_mapping
            table = tables.setdefault(x.seq_id, [])
            del table[out.block_table_from[i] :]
            table += out.block_table_updates[update_loc[i] : update_loc[i + 1]].tolist()
            assert table == x.block_table
        sampled = out.seq_ids[out.samples]
        finished = sampled[out.ends[out.samples] >= 16]
        appended = sampled[out.ends[out.samples] < 16]
        scheduler.update(appended, np.full(len(appended), 5, dtype=np.int64), finished)
        if len(appended) and not forked:
            scheduler.fork(int(appended[0]))
            forked = True
        if not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests() and forked
    assert scheduler.stats()["num_preemptions_swap"] > 0


def test_block_tables_are_written_and_gathered_only_into_arrays_that_fit():
    """write_block_tables / gather_block_tables (the persistent batch's two calls) take C-contiguous
    int32 numpy arrays of a fitting shape, writable where written, and raise InvalidStateError,
    changing nothing, for anything else."""
    import numpy as np

    scheduler = Scheduler(small_config())
    seq_id = scheduler.add_request("a", list(range(10)))
    plan = scheduler.schedule()
    table = scheduler.block_table(seq_id)
    tables = np.full((4, 8), -1, dtype=np.int32)
    plan.write_block_tables(tables)
    assert tables[int(plan.rows[0]), : len(table)].tolist() == table
    out = np.zeros((1, len(table)), dtype=np.int32)
    plan.gather_block_tables(tables, out)
    assert out[0].tolist() == table
    read_only = tables.copy()
    read_only.flags.writeable = False
    for bad in (np.full((4, 8), -1, dtype=np.int64), np.full((4, 16), -1, dtype=np.int32)[:, ::2],
                np.full((4, 1), -1, dtype=np.int32), np.full((0, 8), -1, dtype=np.int32), read_only, [[0] * 8] * 4):
        before = np.array(bad, copy=True)
        with pytest.raises(pagedkv_core.InvalidStateError):
            plan.write_block_tables(bad)
        assert np.array_equal(np.asarray(bad), before)
    for bad_out in (np.zeros((2, len(table)), dtype=np.int32), np.zeros((1, 9), dtype=np.int32), read_only[:1]):
        with pytest.raises(pagedkv_core.InvalidStateError):
            plan.gather_block_tables(tables, bad_out)
    with pytest.raises(pagedkv_core.InvalidStateError):
        plan.gather_block_tables(tables, tables)


def test_a_pickled_step_has_the_same_columns_and_bad_bytes_are_refused():
    """What rank 0 sends the other tensor-parallel ranks: a SchedulerOutput pickles as its bytes
    and comes back with every column, list and block-table write of the original; bytes it did
    not write raise InvalidStateError (never a panic)."""
    import pickle

    import numpy as np

    scheduler = Scheduler(small_config(num_device_blocks=6, max_num_batched_tokens=8, preemption_mode="swap"))
    for i in range(4):
        scheduler.add_request(f"r{i}", list(range(5 + i)))
    columns = ("seq_ids", "rows", "starts", "ends", "samples", "is_prefill", "block_table_from", "query_start_loc",
               "block_table_update_loc", "positions", "sample_index", "sample_rows", "token_ids", "slot_mapping",
               "block_table_updates")
    values = ("num_scheduled", "num_decodes", "max_query_len", "max_context_len", "blocks_to_swap_in",
              "blocks_to_swap_out", "blocks_to_copy", "preempted", "aborted", "abort_reasons", "num_batched_tokens",
              "num_prefix_hit_tokens")
    swapped = False
    for _ in range(40):
        plan = scheduler.schedule()
        copy = pickle.loads(pickle.dumps(plan))
        assert copy.to_bytes() == plan.to_bytes()
        for name in columns:
            assert np.array_equal(getattr(copy, name), getattr(plan, name)), name
        for name in values:
            assert getattr(copy, name) == getattr(plan, name), name
        tables, copied = (np.full((8, 8), -1, dtype=np.int32) for _ in range(2))
        plan.write_block_tables(tables)
        copy.write_block_tables(copied)
        assert np.array_equal(tables, copied)
        swapped |= bool(plan.blocks_to_swap_out)
        with pytest.raises(pagedkv_core.InvalidStateError, match="per-sequence view"):
            copy.scheduled
        sampled = plan.seq_ids[plan.samples]
        done = plan.ends[plan.samples] >= 12
        scheduler.update(sampled[~done], np.full(int((~done).sum()), 7, dtype=np.int64), sampled[done])
        if not scheduler.has_unfinished_requests():
            break
    assert swapped and not scheduler.has_unfinished_requests()
    data = plan.to_bytes()
    for bad in (b"", data[:-1], data + b"\0", b"\xff" * len(data)):
        with pytest.raises(pagedkv_core.InvalidStateError, match="step bytes"):
            pagedkv_core.SchedulerOutput.from_bytes(bad)


def test_update_rejects_bad_input_and_changes_nothing():
    scheduler = Scheduler(small_config())
    a = scheduler.add_request("a", [1, 2, 3])
    b = scheduler.add_request("b", [4, 5])
    scheduler.schedule()
    before = (scheduler.sequence_len(a), scheduler.sequence_len(b), scheduler.stats())
    with pytest.raises(pagedkv_core.InvalidStateError, match="2 seq_ids but 1 token_ids"):
        scheduler.update([a, b], [7])
    with pytest.raises(pagedkv_core.UnknownSequenceError):
        scheduler.update([a, 99], [7, 8])
    with pytest.raises(pagedkv_core.InvalidStateError, match="not sampled"):
        scheduler.update([a, a], [7, 8])
    with pytest.raises(pagedkv_core.InvalidStateError, match="both appended to and finished"):
        scheduler.update([a], [7], [a])
    with pytest.raises(pagedkv_core.InvalidStateError, match="invalid token id -1"):
        scheduler.update([a], [-1])
    assert (scheduler.sequence_len(a), scheduler.sequence_len(b), scheduler.stats()) == before
    scheduler.update([a], [7], [b])
    assert scheduler.sequence_len(a) == 4 and scheduler.num_unfinished_requests == 1


def test_placeholders_plan_a_step_before_its_input_is_known_and_fills_reject_bad_input():
    from pagedkv_core._core import PLACEHOLDER_TOKEN

    scheduler = Scheduler(small_config())
    a = scheduler.add_request("a", [1, 2, 3])
    b = scheduler.add_request("b", [4, 5])
    scheduler.schedule()
    scheduler.append_placeholders([a, b])
    out = scheduler.schedule()
    assert out.token_ids.tolist() == [PLACEHOLDER_TOKEN, PLACEHOLDER_TOKEN]
    before = (scheduler.sequence_len(a), scheduler.sequence_len(b), scheduler.stats())
    with pytest.raises(pagedkv_core.InvalidStateError, match="2 seq_ids but 1 tokens"):
        scheduler.fill_placeholders([a, b], [7])
    with pytest.raises(pagedkv_core.UnknownSequenceError):
        scheduler.fill_placeholders([a, 99], [7, 8])
    with pytest.raises(pagedkv_core.InvalidStateError, match="filled twice"):
        scheduler.fill_placeholders([a, a], [7, 8])
    with pytest.raises(pagedkv_core.InvalidStateError, match="invalid token id -1"):
        scheduler.fill_placeholders([a], [-1])
    with pytest.raises(pagedkv_core.InvalidStateError, match="is the placeholder"):
        scheduler.fill_placeholders([a], [PLACEHOLDER_TOKEN])
    assert (scheduler.sequence_len(a), scheduler.sequence_len(b), scheduler.stats()) == before
    scheduler.fill_placeholders([a, b], [7, 8])
    with pytest.raises(pagedkv_core.InvalidStateError, match="does not end in a placeholder"):
        scheduler.fill_placeholders([a], [7])
    with pytest.raises(pagedkv_core.InvalidStateError, match="placeholder"):
        scheduler.add_request("c", [1, PLACEHOLDER_TOKEN])


def test_scheduler_config_takes_any_field_by_keyword_and_names_unknown_ones():
    config = SchedulerConfig(block_size=8, preemption_mode="swap", swap_latency=0.5)
    assert (config.block_size, config.preemption_mode, config.swap_latency) == (8, "swap", 0.5)
    assert config.max_num_seqs == SchedulerConfig().max_num_seqs == 256  # (the Rust default)
    with pytest.raises(TypeError, match="no option 'blok_size'.*block_size"):
        SchedulerConfig(blok_size=8)
    with pytest.raises(pagedkv_core.InvalidConfigError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="sometimes")
    with pytest.raises(pagedkv_core.InvalidConfigError, match="block_size"):
        SchedulerConfig(block_size=12)
    config.scheduling_policy = "priority"
    assert Scheduler(config).add_request("a", [1, 2, 3], priority=5) >= 0
    config.block_size = 12  # (attributes are set unchecked; the scheduler checks them)
    with pytest.raises(pagedkv_core.InvalidConfigError, match="block_size"):
        Scheduler(config)

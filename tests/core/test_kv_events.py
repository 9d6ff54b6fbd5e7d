"""KV-cache events: a consumer that applies only the events, in order, holds after every step
exactly the cached blocks of each tier (the scheduler state machine of test_scheduler_stateful,
with swap and recompute preemption, forks, drafts, aborts, the CPU tier and resets); and the wire
format is vLLM's, through the ZMQ publisher and its replay socket."""

import pathlib
import re
import time

import pytest
from hypothesis import settings
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

from pagedkv_core import BlockManager, Scheduler, SchedulerConfig
from test_scheduler_stateful import BLOCK_SIZE, SchedulerMachine


class EventMirror:
    """What a router holds: the cached block names of each tier and KV-cache group, built from the
    events alone."""

    def __init__(self, num_groups: int = 1):
        self.num_groups = num_groups
        self.tiers = {(medium, group): set() for medium in ("GPU", "CPU") for group in range(num_groups)}
        self.tokens = {}  # name -> its block's tokens

    def apply(self, events):
        """Events as the core's objects, or decoded from the wire (classes named as theirs + "Wire")."""
        for event in events:
            kind = type(event).__name__.removesuffix("Wire")
            if kind == "BlockStored":
                tier = self.tiers[event.medium, event.group_idx]
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                for index, name in enumerate(event.block_hashes):
                    assert name not in tier, f"{name:x} stored twice in {event.medium}"
                    tier.add(name)
                    tokens = event.token_ids[index * event.block_size:(index + 1) * event.block_size]
                    assert self.tokens.setdefault(name, tokens) == tokens, "each group's block of a name holds its tokens"
            elif kind == "BlockRemoved":
                for name in event.block_hashes:
                    self.tiers[event.medium, event.group_idx].remove(name)  # (a KeyError: never stored)
            else:
                assert kind == "AllBlocksCleared", event
                for tier in self.tiers.values():
                    tier.clear()

    def check(self, cache):
        for group in range(self.num_groups):
            assert sorted(self.tiers["GPU", group]) == cache.cached_block_hashes(on_device=True, group=group)
            assert sorted(self.tiers["CPU", group]) == cache.cached_block_hashes(on_device=False, group=group)


class EventsMachine(SchedulerMachine):
    enable_kv_events = True

    def __init__(self):
        super().__init__()
        self.mirror = EventMirror(len(self.windows))

    @precondition(lambda self: not self.tokens)
    @rule()
    def reset_prefix_cache(self):
        self.scheduler.schedule()  # (the last step's pinned CPU blocks go)
        assert self.scheduler.reset_prefix_cache()

    @invariant()
    def events_mirror_the_cache(self):
        self.mirror.apply(self.scheduler.take_kv_events())
        self.mirror.check(self.scheduler)


class RecomputeEventsMachine(EventsMachine):
    preemption_mode = "recompute"


class WindowedEventsMachine(EventsMachine):
    windows = (6,)


class HybridEventsMachine(EventsMachine):
    windows = (0, 6)


@pytest.mark.parametrize("machine", [EventsMachine, RecomputeEventsMachine, WindowedEventsMachine, HybridEventsMachine],
                         ids=["swap", "recompute", "windowed", "hybrid"])
def test_a_consumer_of_the_events_holds_every_tier_s_cached_blocks(machine):
    run_state_machine_as_test(machine, settings=settings(max_examples=100, stateful_step_count=60, deadline=None))


def test_stored_events_chain_a_prompt_s_blocks_with_their_tokens():
    manager = BlockManager(8, 4, block_size=4, enable_prefix_caching=True, enable_kv_events=True)
    manager.allocate(1, list(range(10)))
    [stored] = manager.take_kv_events()
    assert stored.medium == "GPU" and stored.parent_block_hash is None and stored.block_size == 4
    assert stored.token_ids == list(range(8)) and len(stored.block_hashes) == 2
    manager.append_slots(1, [10, 11])  # fills the third block: a child of the second
    [child] = manager.take_kv_events()
    assert child.parent_block_hash == stored.block_hashes[-1] and child.token_ids == [8, 9, 10, 11]
    assert manager.take_kv_events() == []


def test_events_are_off_unless_asked_and_only_start_on_an_empty_cache():
    scheduler = Scheduler(SchedulerConfig(block_size=BLOCK_SIZE, num_device_blocks=8))
    scheduler.add_request("r", list(range(9)))
    scheduler.schedule()
    assert scheduler.take_kv_events() == [] and scheduler.cached_block_hashes()
    manager = BlockManager(8, 0, block_size=4, enable_prefix_caching=True)
    assert manager.take_kv_events() == []


def test_the_wire_format_is_vllm_s_and_replay_returns_missed_batches(tmp_path):
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    from pagedkv_core.kv_events import ZmqEventPublisher

    publisher = ZmqEventPublisher(f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay", topic="kv")
    context = zmq.Context.instance()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
    subscriber.connect(publisher.endpoint)
    time.sleep(0.3)  # (a PUB socket drops what it sends before the subscription reaches it)
    manager = BlockManager(8, 4, block_size=4, enable_prefix_caching=True, enable_kv_events=True)
    manager.allocate(1, list(range(9)))
    publisher.publish(manager.take_kv_events())
    publisher.publish([])  # (an empty step sends nothing)
    manager.free(1)
    assert manager.reset_prefix_cache()
    publisher.publish(manager.take_kv_events())
    received = []
    for _ in range(2):
        assert subscriber.poll(5000)
        received.append(subscriber.recv_multipart())
    assert [frames[0] for frames in received] == [b"kv", b"kv"]
    assert [int.from_bytes(frames[1], "big") for frames in received] == [0, 1]
    timestamp, events, rank = msgspec.msgpack.decode(received[0][2])
    assert isinstance(timestamp, float) and rank == 0
    [[tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name]] = events
    assert (tag, parent, tokens, block_size, lora_id, medium, lora_name) == (
        "BlockStored", None, list(range(8)), 4, None, "GPU", None)
    assert len(hashes) == 2
    assert msgspec.msgpack.decode(received[1][2])[1] == [["AllBlocksCleared"]]

    replay = context.socket(zmq.DEALER)
    replay.connect(publisher.replay_endpoint)
    for start, expected in ((1, [received[1]]), (0, received)):
        replay.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while True:
            assert replay.poll(5000)
            _, sequence_number, payload = replay.recv_multipart()
            if int.from_bytes(sequence_number, "big", signed=True) == -1:
                break
            replayed.append([sequence_number, payload])
        assert replayed == [frames[1:] for frames in expected]
    publisher.shutdown()
    publisher.shutdown()  # (idempotent)
    subscriber.close(0)
    replay.close(0)


def test_a_hybrid_engine_s_events_carry_vllm_s_group_fields():
    """With several KV-cache groups, stores and removals name their group, and stores its kind and
    window, as vLLM's hybrid engines send them (fields past lora_name); one group sends none."""
    from pagedkv_core.kv_events import event_as_array

    manager = BlockManager(16, 0, block_size=4, enable_prefix_caching=True, enable_kv_events=True,
                           kv_group_windows=[0, 8])
    manager.allocate(1, list(range(9)))
    stored = manager.take_kv_events()
    assert [event.group_idx for event in stored] == [0, 1]
    assert stored[0].block_hashes == stored[1].block_hashes, "one external name per prefix block"
    full, windowed = (BlockStoredWire(*event_as_array(event, [0, 8])[1:]) for event in stored)
    assert (full.group_idx, full.kind, full.window) == (0, "full_attention", None)
    assert (windowed.group_idx, windowed.kind, windowed.window) == (1, "sliding_window", 8)
    assert len(event_as_array(stored[0])) == 8, "one group: vLLM's fields up to lora_name only"
    manager.free(1)
    assert manager.reset_prefix_cache()
    mirror = EventMirror(2)
    mirror.apply(stored)
    assert mirror.tiers["GPU", 1] == set(stored[1].block_hashes)


def test_a_late_subscriber_catches_up_through_replay_and_holds_the_same_index(tmp_path):
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    from pagedkv_core.kv_events import ZmqEventPublisher

    publisher = ZmqEventPublisher(f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay")
    scheduler = Scheduler(SchedulerConfig(block_size=4, num_device_blocks=12, num_cpu_blocks=8, enable_kv_events=True,
                                          enable_cpu_prefix_cache=True, watermark=0.0))
    for index in range(12):  # prompts sharing prefixes, more than the pool holds: stores, evictions, offloads
        scheduler.add_request(f"r{index}", [index % 3] * 6 + [100 + index] * 5)
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            for seq in out.scheduled:
                if seq.sample:
                    scheduler.finish_sequence(seq.seq_id)
            publisher.publish(scheduler.take_kv_events())
    assert publisher.flush()
    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.connect(publisher.replay_endpoint)
    replay.send_multipart([b"", (0).to_bytes(8, "big")])
    mirror = EventMirror()
    decoders = {"BlockStored": BlockStoredWire, "BlockRemoved": BlockRemovedWire, "AllBlocksCleared": AllBlocksClearedWire}
    sequence_numbers = []
    while True:
        assert replay.poll(5000)
        _, sequence_number, payload = replay.recv_multipart()
        number = int.from_bytes(sequence_number, "big", signed=True)
        if number == -1:
            break
        sequence_numbers.append(number)
        _, events, _ = msgspec.msgpack.decode(payload)
        mirror.apply([decoders[event[0]](*event[1:]) for event in events])
    assert sequence_numbers == list(range(len(sequence_numbers))) and sequence_numbers
    assert scheduler.cached_block_hashes(on_device=False), "the trace never reached the CPU tier"
    mirror.check(scheduler)
    publisher.shutdown()
    replay.close(0)


class BlockStoredWire:
    def __init__(self, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name=None,
                 extra_keys=None, group_idx=0, kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None):
        self.block_hashes, self.token_ids, self.block_size, self.medium = block_hashes, token_ids, block_size, medium
        self.group_idx, self.kind, self.window = group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window


class BlockRemovedWire:
    def __init__(self, block_hashes, medium, group_idx=0):
        self.block_hashes, self.medium, self.group_idx = block_hashes, medium, group_idx


class AllBlocksClearedWire:
    pass


def test_the_events_example_of_docs_scheduler_md_runs(capsys):
    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "scheduler.md"
    example = next(block for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
                   if "take_kv_events" in block)
    exec(compile(example, str(page), "exec"), {})
    [stored] = capsys.readouterr().out.splitlines()
    assert stored.endswith(" None 32 16")  # two full blocks of a 40-token prompt, the first a root

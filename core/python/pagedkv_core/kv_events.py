"""KV-cache events on the wire, as vLLM publishes them, so KV-aware routers written for vLLM
(Dynamo's indexer and KV router, llm-d, the vLLM router) index a pagedkv engine unchanged.

The core records the events (`Scheduler.take_kv_events`); the engine takes them once per step and
hands them to a `ZmqEventPublisher`, which sends each step's batch from its own thread:

- a ZMQ PUB socket sends multipart messages (topic, 8-byte big-endian sequence number, payload);
- the payload is msgpack of `[timestamp, [event, ...], data_parallel_rank]`, each event an array
  led by its tag: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`
  (vLLM's msgspec structs with array_like=True); an engine with several KV-cache groups adds
  vLLM's group fields: `extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window`
  to a store, `group_idx` to a removal;
- a ZMQ ROUTER replay socket answers a request frame holding an 8-byte big-endian sequence
  number with every buffered batch from it on, `(seq, payload)` each, then `(-1, b"")`.

pyzmq and msgspec are needed only here: `pip install 'pagedkv[kv-events]'`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Optional, Sequence

from pagedkv_core._core import AllBlocksCleared, BlockRemoved, BlockStored

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def event_as_array(event, kv_group_windows: Optional[Sequence[int]] = None) -> list:
    """One event as vLLM's array_like msgspec struct writes it (tag first, fields in order). With
    `kv_group_windows` (each KV-cache group's window, 0: full attention, for an engine with
    several groups) the events name their group and its kind, as vLLM's hybrid engines do."""
    if isinstance(event, BlockStored):
        fields = ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                  event.lora_id, event.medium, None]
        if kv_group_windows:
            window = kv_group_windows[event.group_idx]
            fields += [None, event.group_idx, "sliding_window" if window else "full_attention", window or None]
        return fields
    if isinstance(event, BlockRemoved):
        fields = ["BlockRemoved", event.block_hashes, event.medium]
        return fields + [event.group_idx] if kv_group_windows else fields
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV-cache event: {event!r}")


def encode_batch(events: Sequence, timestamp: float, data_parallel_rank: Optional[int] = 0,
                 kv_group_windows: Optional[Sequence[int]] = None) -> bytes:
    """A step's events as a `KVEventBatch` payload (`kv_group_windows`: see `event_as_array`)."""
    import msgspec

    encoded = [event_as_array(event, kv_group_windows) for event in events]
    return msgspec.msgpack.encode([timestamp, encoded, data_parallel_rank])


def _binds(endpoint: str) -> bool:
    # vLLM's rule: a wildcard or a local transport binds, anything else connects.
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes event batches on `endpoint` (PUB) in order, each with the next sequence number, and
    keeps the last `buffer_steps` for subscribers that ask `replay_endpoint` (ROUTER) for what they
    missed. `publish` never blocks the engine: a thread owns the sockets."""

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, data_parallel_rank: int = 0,
                 kv_group_windows: Optional[Sequence[int]] = None):
        try:
            import msgspec  # noqa: F401
            import zmq
        except ImportError as error:
            raise ImportError("KV events need pyzmq and msgspec: pip install 'pagedkv[kv-events]'") from error
        self._zmq = zmq
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(hwm)
            (self._pub.bind if _binds(endpoint) else self._pub.connect)(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except Exception:
            self._close_sockets(linger=0)
            raise
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode()
        self._data_parallel_rank = data_parallel_rank
        self._kv_group_windows = tuple(kv_group_windows or ())
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._sequence_numbers = count()
        self._num_queued = self._num_sent = 0  # (batches: `flush` waits for the two to meet)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (replay: %s, topic %r)", endpoint, replay_endpoint, topic)

    def publish(self, events: Sequence) -> None:
        """Queues one step's events (nothing is sent for an empty step)."""
        if self._closed:
            raise RuntimeError("the KV event publisher is shut down")
        if events:
            self._num_queued += 1
            self._queue.put((time.time(), list(events)))

    def flush(self, timeout: float = 5.0) -> bool:
        """Waits until every batch published so far has been sent; False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while self._num_sent < self._num_queued:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def shutdown(self, timeout: float = 2.0) -> None:
        """Sends what is queued (half a second more for the sockets to hand it over), then closes
        the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)  # (the thread closes the sockets it owns when it reaches this)
        if threading.current_thread() is not self._thread:  # (a finalizer may run on it)
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the KV event publisher did not stop within %.1f s", timeout)

    def _close_sockets(self, linger: int) -> None:
        self._pub.close(linger=linger)
        if self._replay is not None:
            self._replay.close(linger=linger)

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._answer_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                self._close_sockets(linger=500)
                return
            timestamp, events = item
            try:
                payload = encode_batch(events, timestamp, self._data_parallel_rank, self._kv_group_windows)
                sequence_number = next(self._sequence_numbers)
                self._pub.send_multipart((self._topic, sequence_number.to_bytes(8, "big"), payload))
                self._buffer.append((sequence_number, payload))
            except Exception:  # (a dead socket must not take the engine down with it)
                logger.exception("could not publish a KV event batch")
            finally:
                self._num_sent += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignored a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence_number, payload in list(self._buffer):
            if sequence_number >= first:
                self._replay.send_multipart((client, b"", sequence_number.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

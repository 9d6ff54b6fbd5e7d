"""pagedkv-core: the KV-cache manager and scheduler of pagedkv, alone (numpy is its one dependency).

`Scheduler` (continuous batching, chunked prefill, preemption by swap or recompute) and
`BlockManager` (block pools, block tables, copy-on-write, prefix cache with a CPU tier) are Rust
types; `take_kv_events()` gives the KV-cache events a KV-aware router mirrors the cache by, and
`pagedkv_core.kv_events` publishes them on ZMQ in vLLM's format (`pip install
'pagedkv-core[kv-events]'`). The engine that drives a torch model through them is `pagedkv`.
"""

from pagedkv_core._core import (
    AllBlocksCleared,
    BlockManager,
    BlockRemoved,
    BlockStored,
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from pagedkv_core.errors import (
    DuplicateRequestError,
    InvalidConfigError,
    InvalidStateError,
    OutOfBlocksError,
    OverloadedError,
    PagedKVError,
    PromptTooLongError,
    UnknownRequestError,
    UnknownSequenceError,
)

__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "BlockManager",
    "BlockRemoved",
    "BlockStored",
    "DuplicateRequestError",
    "InvalidConfigError",
    "InvalidStateError",
    "OutOfBlocksError",
    "OverloadedError",
    "PagedKVError",
    "PromptTooLongError",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "UnknownRequestError",
    "UnknownSequenceError",
]

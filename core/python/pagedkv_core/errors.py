"""Exception classes of the pagedkv core.

They mirror the Rust error enum (`rust/errors.rs`); the PyO3 layer raises these classes, so no
Rust panic or anonymous error crosses into Python. Messages name the limit or field that was
violated and its value. The engine (`pagedkv.errors`) adds its own on the same base class.
"""


class PagedKVError(Exception):
    """Base class of every error raised by pagedkv."""


class PromptTooLongError(PagedKVError, ValueError):
    """The prompt can never be served: longer than `max_model_len`, or needs more KV blocks than
    the whole device pool holds."""


class OverloadedError(PagedKVError):
    """The waiting queue is at its bound (both KV tiers are full and requests are queued).
    Servers answer HTTP 503 with Retry-After; retrying later is safe."""


class OutOfBlocksError(PagedKVError):
    """A block pool has no free block for an operation that needed one."""


class UnknownRequestError(PagedKVError, KeyError):
    """No request (sequence group) with this id is known."""


class UnknownSequenceError(PagedKVError, KeyError):
    """No sequence with this id is known."""


class DuplicateRequestError(PagedKVError, ValueError):
    """A request with this id is already in the engine."""


class InvalidConfigError(PagedKVError, ValueError):
    """A configuration value is out of range; the message names the field."""


class InvalidStateError(PagedKVError):
    """An operation was called in a state that does not allow it (e.g. appending to a swapped sequence)."""

"""Exception classes of pagedkv: the core's (`pagedkv_core.errors`, raised by the scheduler and
block manager) and the engine's own, on the same base class."""

from pagedkv_core.errors import (  # noqa: F401 (re-exported)
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


class EngineStoppedError(PagedKVError):
    """The engine loop ended a request it could not finish: it was shut down, or a step failed
    (Python-side only: AsyncLLM)."""


class TensorParallelError(PagedKVError, RuntimeError):
    """A tensor-parallel rank died, hung past distributed_timeout_seconds, or failed a step: the
    ranks are out of step and the engine cannot go on."""

"""pagedkv: a PagedAttention KV-cache manager and LLM serving engine.

The memory manager and scheduler (`BlockManager`, `Scheduler`) are Rust types from the core
distribution, `pagedkv_core` (installable alone, without torch); the engine (`LLM`, `LLMEngine`)
drives a torch model through them.
"""

from pagedkv_core import (
    AllBlocksCleared,
    BlockManager,
    BlockRemoved,
    BlockStored,
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from pagedkv.errors import (
    DuplicateRequestError,
    EngineStoppedError,
    InvalidConfigError,
    InvalidStateError,
    OutOfBlocksError,
    OverloadedError,
    PagedKVError,
    PromptTooLongError,
    TensorParallelError,
    UnknownRequestError,
    UnknownSequenceError,
)

__version__ = "0.1.0"

# The engine pulls in torch and transformers; import it only when asked for.
_LAZY = {
    "LLM": "pagedkv.entrypoints.llm",
    "AsyncLLM": "pagedkv.entrypoints.async_llm",
    "LLMEngine": "pagedkv.engine.llm_engine",
    "EngineConfig": "pagedkv.config",
    "SamplingParams": "pagedkv.params.sampling",
    "PoolingParams": "pagedkv.params.pooling",
    "StructuredOutputsParams": "pagedkv.params.structured_output",
    "RequestOutput": "pagedkv.outputs",
    "CompletionOutput": "pagedkv.outputs",
    "EmbeddingRequestOutput": "pagedkv.outputs",
    "ClassificationRequestOutput": "pagedkv.outputs",
    "PoolingRequestOutput": "pagedkv.outputs",
    "ScoringRequestOutput": "pagedkv.outputs",
    "LoRARequest": "pagedkv.params.lora_request",
    "BeamSearchParams": "pagedkv.engine.beam_search",
    "BeamSearchOutput": "pagedkv.engine.beam_search",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")


__all__ = [
    "AllBlocksCleared",
    "BlockManager",
    "BlockRemoved",
    "BlockStored",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "PagedKVError",
    "PromptTooLongError",
    "OverloadedError",
    "OutOfBlocksError",
    "UnknownRequestError",
    "UnknownSequenceError",
    "DuplicateRequestError",
    "EngineStoppedError",
    "InvalidConfigError",
    "InvalidStateError",
    "TensorParallelError",
    *_LAZY,
]

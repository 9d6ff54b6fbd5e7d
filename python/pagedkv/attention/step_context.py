"""StepContext: what every layer of one step's forward reads besides its hidden states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from pagedkv.attention.backend import AttentionBackend
from pagedkv.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagedkv.runner.kv_cache import KVCache
    from pagedkv.runner.lora import LoRABatch


@dataclass(frozen=True)
class StepContext:
    """The step's attention metadata, the KV cache, the attention backend and the step's LoRA
    adapters (None without any), built once per step by the runner (`build`) and passed down
    every model and decoder layer as one argument."""

    metadata: AttentionMetadata
    kv_cache: KVCache
    backend: AttentionBackend
    lora: Optional[LoRABatch] = None

    @classmethod
    def build(cls, metadata: AttentionMetadata, kv_cache: KVCache, backend: AttentionBackend,
              lora: Optional[LoRABatch] = None) -> StepContext:
        """The context of one step: lets the backend do its per-step work first (`prepare`)."""
        backend.prepare(metadata)
        return cls(metadata, kv_cache, backend, lora)

    def attend(self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Writes the step's key/value [T, Hkv, D] into layer `layer_index`'s cache, then returns
        the attention of query [T, Hq, D] over it (AttentionBackend.forward's options)."""
        key_cache, value_cache = self.kv_cache.layer(layer_index)
        self.backend.write_kv(key_cache, value_cache, key, value, self.metadata.slot_mapping)
        return self.backend.forward(query, key_cache, value_cache, self.metadata, scale, sliding_window,
                                    logit_softcap, sinks)

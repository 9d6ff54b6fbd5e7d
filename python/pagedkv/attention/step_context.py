"""StepContext: what every layer of one step's forward reads besides its hidden states."""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    every model and decoder layer as one argument. With several KV-cache groups (kv_groups.py)
    each group has its own metadata (its block tables and slots), `metadata` is group 0's."""

    metadata: AttentionMetadata
    kv_cache: KVCache
    backend: AttentionBackend
    lora: Optional[LoRABatch] = None
    group_metadata: tuple[AttentionMetadata, ...] = ()

    @classmethod
    def build(cls, metadata: AttentionMetadata, kv_cache: KVCache, backend: AttentionBackend,
              lora: Optional[LoRABatch] = None) -> StepContext:
        """The context of one step: lets the backend do its per-step work first (`prepare`). With
        G KV-cache groups, `metadata` holds every group's tables ([G * B, width], group after
        group) and slots ([G * T]); each group's metadata is a view of its part."""
        num_groups = kv_cache.num_groups if kv_cache is not None else 1
        if num_groups == 1:
            backend.prepare(metadata)
            return cls(metadata, kv_cache, backend, lora)
        num_seqs, num_tokens = metadata.num_seqs, metadata.slot_mapping.shape[0] // num_groups
        tables_and_slots = [(metadata.block_tables[group * num_seqs:(group + 1) * num_seqs],
                             metadata.slot_mapping[group * num_tokens:(group + 1) * num_tokens])
                            for group in range(num_groups)]
        return cls.build_groups(metadata, tables_and_slots, kv_cache, backend, lora)

    @classmethod
    def build_groups(cls, metadata: AttentionMetadata, tables_and_slots: list[tuple[torch.Tensor, torch.Tensor]],
                     kv_cache: KVCache, backend: AttentionBackend, lora: Optional[LoRABatch] = None) -> StepContext:
        """`build` with each KV-cache group's (block tables, slots) given apart (`metadata`'s own
        are not read)."""
        (first_tables, first_slots), *others = tables_and_slots
        first = replace(metadata, block_tables=first_tables, slot_mapping=first_slots)
        backend.prepare(first)  # (what it derives is the same for every group: made once)
        groups = (first, *(replace(first, block_tables=tables, slot_mapping=slots) for tables, slots in others))
        return cls(first, kv_cache, backend, lora, groups)

    def attend(self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Writes the step's key/value [T, Hkv, D] into layer `layer_index`'s cache, then returns
        the attention of query [T, Hq, D] over it (AttentionBackend.forward's options)."""
        key_cache, value_cache = self.kv_cache.layer(layer_index)
        metadata = self.group_metadata[self.kv_cache.layer_groups[layer_index]] if self.group_metadata else self.metadata
        self.backend.write_kv(key_cache, value_cache, key, value, metadata.slot_mapping)
        return self.backend.forward(query, key_cache, value_cache, metadata, scale, sliding_window, logit_softcap, sinks)

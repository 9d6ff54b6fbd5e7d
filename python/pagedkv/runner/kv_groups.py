"""KV-cache groups: how a model whose layers mix attention kinds shares one block pool.

Gemma 2/3, GPT-OSS, OLMo 3 and Qwen's `layer_types` mix sliding-window layers with full-attention
ones. Their layers are split into groups of equal size, each of one kind (vLLM V1's hybrid
allocator): a pool block holds one group's layers for `block_size` tokens, the scheduler keeps one
block table per group and sequence, and a windowed group's table releases the blocks behind its
window while a full group's keeps them all. So at long contexts a windowed layer holds about its
window, not the whole sequence.

In the cache tensor (kv_cache.py) a block has `slots_per_block` layer slots: layer l keeps its
K/V in slot `layer_slot[l]` of the blocks of its group's table. Layers of different groups share
a slot index, never a block: a block belongs to one group at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class KVCacheGroups:
    """The model's KV-cache groups and where each layer's K/V live."""

    windows: tuple[int, ...]  # each group's attention window, counting the position itself (0: full)
    layer_group: tuple[int, ...]  # each layer's group
    layer_slot: tuple[int, ...]  # each layer's slot in a block of its group

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def slots_per_block(self) -> int:
        return max(self.layer_slot) + 1

    @classmethod
    def single(cls, num_layers: int, window: int = 0) -> KVCacheGroups:
        """Every layer in one group of `window` (0: full attention): a block holds every layer."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def for_layers(cls, layer_windows: Sequence[Optional[int]], hybrid: bool = True) -> KVCacheGroups:
        """The groups of layers with these windows (None: full attention). Layers of one kind make
        one group; with several kinds (and `hybrid`), each kind's layers are split, in order, into
        groups of the smallest kind's layer count (a kind's last group may be shorter: its unused
        slots are the price of one block size for all). Without `hybrid`, one group of the widest
        window when every layer has one, else of full attention (every layer keeps every block)."""
        windows = [window or 0 for window in layer_windows]
        if not windows:
            raise ValueError("a model with no attention layers has no KV cache")
        kinds = list(dict.fromkeys(windows))  # in order of first appearance
        if len(kinds) == 1 or not hybrid:
            return cls.single(len(windows), 0 if 0 in kinds else max(kinds))
        layers_of = {kind: [layer for layer, window in enumerate(windows) if window == kind] for kind in kinds}
        group_size = min(len(layers) for layers in layers_of.values())
        group_windows, layer_group, layer_slot = [], [0] * len(windows), [0] * len(windows)
        for kind in kinds:
            layers = layers_of[kind]
            for start in range(0, len(layers), group_size):
                for slot, layer in enumerate(layers[start:start + group_size]):
                    layer_group[layer], layer_slot[layer] = len(group_windows), slot
                group_windows.append(kind)
        return cls(tuple(group_windows), tuple(layer_group), tuple(layer_slot))

    def describe(self) -> str:
        """For logs: e.g. '6 groups of 4 layers: 1 full, 5 with window 1024'."""
        kinds = list(dict.fromkeys(self.windows))
        parts = [f"{self.windows.count(kind)} " + ("full" if kind == 0 else f"with window {kind}") for kind in kinds]
        return f"{self.num_groups} groups of {self.slots_per_block} layers: {', '.join(parts)}"

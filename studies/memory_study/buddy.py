"""A binary buddy allocator over a contiguous range of KV slots, as contiguous-cache servers use."""

import bisect
from typing import Optional


def next_power_of_two(size: int) -> int:
    """The smallest power of two >= size (1 for size <= 1)."""
    return 1 << max(0, size - 1).bit_length()


class BuddyAllocator:
    """Hands out power-of-two-sized, size-aligned runs of slots; frees merge buddies back.

    Each request is rounded up to a power of two: the rounding is external fragmentation,
    as is free space split into runs too small for the next request. A request takes the
    smallest free run that fits, the lowest-addressed one among equals, so placements are
    deterministic and easy to check by hand.
    """

    def __init__(self, num_slots: int):
        if num_slots <= 0 or num_slots & (num_slots - 1):
            raise ValueError(f"num_slots={num_slots} must be a power of two")
        self.num_slots = num_slots
        self.max_order = num_slots.bit_length() - 1
        # free_offsets[order]: sorted offsets of free runs of 2**order slots.
        self.free_offsets: list[list[int]] = [[] for _ in range(self.max_order + 1)]
        self.free_offsets[self.max_order].append(0)
        self.allocated: dict[int, int] = {}
        """offset -> run size of every live allocation."""

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - sum(self.allocated.values())

    def can_allocate(self, size: int) -> bool:
        """Whether a run for `size` slots is free right now."""
        order = next_power_of_two(size).bit_length() - 1
        return any(self.free_offsets[o] for o in range(order, self.max_order + 1))

    def allocate(self, size: int) -> Optional[int]:
        """Offset of a free run of next_power_of_two(size) slots, or None when none is left."""
        if size > self.num_slots:
            raise ValueError(f"size={size} exceeds num_slots={self.num_slots}: it could never be placed")
        run = next_power_of_two(size)
        order = run.bit_length() - 1
        source = next((o for o in range(order, self.max_order + 1) if self.free_offsets[o]), None)
        if source is None:
            return None
        offset = self.free_offsets[source].pop(0)
        # Split down to the wanted order, keeping the lower half and freeing the upper buddies.
        while source > order:
            source -= 1
            bisect.insort(self.free_offsets[source], offset + (1 << source))
        self.allocated[offset] = run
        return offset

    def free(self, offset: int) -> None:
        """Returns a run and merges it with its buddy while the buddy is free too."""
        run = self.allocated.pop(offset)
        order = run.bit_length() - 1
        while order < self.max_order:
            buddy = offset ^ (1 << order)
            free_list = self.free_offsets[order]
            position = bisect.bisect_left(free_list, buddy)
            if position == len(free_list) or free_list[position] != buddy:
                break
            free_list.pop(position)
            offset = min(offset, buddy)
            order += 1
        bisect.insort(self.free_offsets[order], offset)

"""The KV cache tensors and the copies the scheduler asks for (swap-out, swap-in, copy-on-write).

Layout (docs/architecture.md): one block-major tensor per device,
`[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`, so a block's K and V for every
layer are one contiguous chunk. With KV-cache groups (kv_groups.py) a block holds one group's
layers, `[num_blocks, slots_per_block, 2, ...]`, and layer l lives in slot `layer_slot[l]`. On CUDA
the CPU side is pinned and swaps run on their own stream.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedkv.attention.torch_ref import as_bytes
from pagedkv.runner.kv_groups import KVCacheGroups


class KVCache:
    def __init__(self, num_layers, num_kv_heads, head_dim, block_size, num_device_blocks, num_cpu_blocks, dtype, device,
                 groups: Optional[KVCacheGroups] = None):
        self.block_size = block_size
        self.groups = groups or KVCacheGroups.single(num_layers)
        if len(self.groups.layer_slot) != num_layers:
            raise ValueError(f"KV-cache groups of {len(self.groups.layer_slot)} layers for a model of {num_layers}")
        self.layer_groups = self.groups.layer_group
        shape = (self.groups.slots_per_block, 2, num_kv_heads, block_size, head_dim)
        self.device_cache = torch.zeros((num_device_blocks, *shape), dtype=dtype, device=device)
        self.is_cuda = self.device_cache.is_cuda
        self.cpu_cache = torch.zeros((num_cpu_blocks, *shape), dtype=dtype, pin_memory=self.is_cuda)
        slots = [(self.device_cache[:, i, 0], self.device_cache[:, i, 1]) for i in range(self.groups.slots_per_block)]
        self._layers = [slots[slot] for slot in self.groups.layer_slot]
        self.block_bytes = self.device_cache[0].numel() * self.device_cache.element_size()
        if self.is_cuda:
            self.swap_stream = torch.cuda.Stream(device=self.device_cache.device)
            self._swap_in_done = None
            self._memcpy_async = _runtime_memcpy_async()
            # "kernel": one launch that reads/writes the pinned blocks directly; "memcpy": one
            # cudaMemcpyAsync per run of blocks; "torch": a copy_ per run (without CuPy).
            self.swap_method = "kernel" if self._memcpy_async is not None else "torch"

    @staticmethod
    def bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype) -> int:
        """Bytes of a block of `num_layers` layer slots (a KV-cache group's `slots_per_block`)."""
        return num_layers * 2 * num_kv_heads * block_size * head_dim * torch.finfo(dtype).bits // 8

    @property
    def num_groups(self) -> int:
        return self.groups.num_groups

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) views of one layer: [num_blocks, Hkv, block_size, D] (its slot
        of every block; only its KV-cache group's blocks are its own)."""
        return self._layers[index]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, cpu block) copies. On CUDA they wait for the compute issued so far and
        finish before the compute stream touches the device blocks again (they may be reused)."""
        if not pairs:
            return
        src, dst = _indices(pairs)
        if not self.is_cuda:
            as_bytes(self.cpu_cache)[dst] = as_bytes(self.device_cache)[src]
            return
        compute = torch.cuda.current_stream()
        self.swap_stream.wait_stream(compute)
        with torch.cuda.stream(self.swap_stream):
            self._copy(self.cpu_cache, self.device_cache, pairs)
        # The freed device blocks may be written by this step's forward: order it after the copies.
        compute.wait_stream(self.swap_stream)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, device block) copies; on CUDA asynchronous until `wait_for_swap_in` (which
        `copy_blocks` and the forward call first). They wait for the compute issued so far: the
        device blocks may have been freed by a request whose last kernels are still running."""
        if not pairs:
            return
        src, dst = _indices(pairs)
        if not self.is_cuda:
            as_bytes(self.device_cache)[dst] = as_bytes(self.cpu_cache)[src]
            return
        self.swap_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.swap_stream):
            self._copy(self.device_cache, self.cpu_cache, pairs)
            self._swap_in_done = torch.cuda.Event()
            self._swap_in_done.record(self.swap_stream)

    def _copy(self, target: torch.Tensor, source: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """(source block, target block) copies, asynchronous on the current stream. A copy_
        per block costs the host ~15 us, longer than the DMA of a block, so with CuPy one kernel
        moves them all (or one cudaMemcpyAsync per run of consecutive blocks: swap_method)."""
        if self.swap_method == "kernel":
            from pagedkv.kernels import swap_blocks

            staged = torch.tensor(pairs, dtype=torch.int64).pin_memory()
            swap_blocks(target, source, staged.to(self.device_cache.device, non_blocking=True))
        elif self.swap_method == "memcpy":
            stream, size = torch.cuda.current_stream().cuda_stream, self.block_bytes
            target_base, source_base = target.data_ptr(), source.data_ptr()
            for source_block, target_block, count in block_runs(pairs):
                self._memcpy_async(target_base + target_block * size, source_base + source_block * size,
                                   count * size, _MEMCPY_DEFAULT, stream)
        else:
            for source_block, target_block, count in block_runs(pairs):
                target[target_block : target_block + count].copy_(source[source_block : source_block + count],
                                                                  non_blocking=True)

    def wait_for_swap_in(self) -> None:
        """Makes the compute stream wait for pending swap-ins (call before the forward)."""
        if self.is_cuda and self._swap_in_done is not None:
            torch.cuda.current_stream().wait_event(self._swap_in_done)
            self._swap_in_done = None

    def copy_blocks(self, pairs: list[tuple[int, int]], backend=None) -> None:
        """Copy-on-write copies (src, dst) of every layer. A source may be a block swapped in
        this very step (a group swapped back in whose samples share a partly filled last block),
        so pending swap-ins finish first."""
        if not pairs:
            return
        self.wait_for_swap_in()
        pairs_tensor = torch.tensor(pairs, dtype=torch.int64, device=self.device_cache.device)
        if backend is not None:
            backend.copy_blocks(self.device_cache, pairs_tensor)
        else:
            as_bytes(self.device_cache)[pairs_tensor[:, 1]] = as_bytes(self.device_cache)[pairs_tensor[:, 0]]


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst, count) runs of pairs whose source and destination both advance by one, so
    each run is one copy (one DMA transfer) instead of `count`."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(run) for run in runs]


_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the (unified) addresses


def _runtime_memcpy_async():
    """cudaMemcpyAsync through CuPy's runtime bindings, or None without CuPy."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy.cuda.runtime.memcpyAsync


def _indices(pairs):
    tensor = torch.tensor(pairs, dtype=torch.int64)
    return tensor[:, 0], tensor[:, 1]

"""CUDA graphs for decode steps: one graph per padded batch size, captured at start-up and
replayed instead of launching every kernel from Python.

A small model's decode step is hundreds of short kernels (SmolLM2: 30 layers of about a dozen
each), so launching them from Python, not the GPU, bounds eager decode. A graph replays the
whole forward with one launch. Its inputs must live at fixed addresses: the static buffers
below, sized for the largest batch. A step of B sequences fills their first B rows and replays
the graph of the smallest captured size >= B; the padding rows write no K/V (slot -1) and read
one token of whatever block their stale table row names, and their outputs are dropped. With
several KV-cache groups, slots and tables are static per group.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Callable

import torch

from pagedkv.attention import AttentionBackend, AttentionMetadata, StepContext

logger = logging.getLogger("pagedkv.runner.cuda_graphs")


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 below `max_batch_size`, then `max_batch_size`."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch_size]
    return sizes + list(range(16, max_batch_size, 16)) + [max_batch_size]


class CudaGraphCapture:
    """Captures a forward with `torch.cuda.graph`; every graph shares one memory pool (they are
    captured largest first, so the smaller ones fit in the memory of the first)."""

    def __init__(self):
        self.pool = None

    def __call__(self, forward: Callable[[], None]) -> Callable[[], None]:
        forward()  # warm-up outside the capture: compiles the kernels, settles the allocator
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            forward()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay


def replay_eagerly(forward: Callable[[], None]) -> Callable[[], None]:
    """A stand-in for `CudaGraphCapture` without a GPU: a 'replay' runs the forward again on
    the static buffers, which checks everything but the capture itself."""
    return forward


class DecodeGraphs:
    """Captured forwards of decode-only steps (one new token per sequence) at fixed batch sizes.

    The backend must run its decode path on device tensors alone (`supports_cuda_graphs`):
    the host lists of AttentionMetadata are None inside a graph, and `max_context_len` is the
    longest context the static block tables can hold.
    """

    def __init__(self, model, kv_cache, backend: AttentionBackend, *, max_batch_size: int, max_model_len: int,
                 block_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device, capture=None):
        if not backend.supports_cuda_graphs:
            raise ValueError(f"the {backend.name!r} attention backend cannot run inside CUDA graphs; use 'cuda'")
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.num_groups = kv_cache.num_groups
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        max_blocks = math.ceil(max_model_len / block_size)
        self.max_context_len = max_blocks * block_size
        int32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((self.num_groups, max_batch_size), -1, dtype=torch.long, device=device)
        self.context_lens = torch.ones(max_batch_size, **int32)
        self.block_tables = torch.zeros((self.num_groups, max_batch_size, max_blocks), **int32)
        self.query_start_loc = torch.arange(max_batch_size + 1, **int32)
        self.seq_index = torch.arange(max_batch_size, **int32)
        self.hidden = torch.zeros((max_batch_size, hidden_size), dtype=dtype, device=device)
        self.num_replays = {size: 0 for size in self.batch_sizes}
        capture = capture or CudaGraphCapture()
        self.replays = {}
        for size in reversed(self.batch_sizes):
            self.replays[size] = capture(functools.partial(self._forward, size))
        logger.info("captured decode graphs for batch sizes %s", self.batch_sizes)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _forward(self, size: int) -> None:
        metadata = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[0, :size],
            slot_mapping=self.slot_mapping[0, :size],
            max_query_len=1,
            max_context_len=self.max_context_len,
            num_decode_tokens=size,
            query_start_loc_host=None,
            context_lens_host=None,
            seq_index=self.seq_index[:size],
        )
        tables_and_slots = [(self.block_tables[group, :size], self.slot_mapping[group, :size])
                            for group in range(self.num_groups)]
        context = StepContext.build_groups(metadata, tables_and_slots, self.kv_cache, self.backend)
        self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size], context)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor) -> torch.Tensor:
        """One decode step of len(input_ids) sequences (int64 ids, positions and slots, int32
        tables [G * B, width], on any device; slots and tables of the G KV-cache groups one after
        another); returns their hidden states [B, H] (a view of the static output, valid until the
        next run)."""
        size = len(input_ids)
        graph_size = next(s for s in self.batch_sizes if s >= size)
        width = block_tables.shape[1]
        self.input_ids[:size].copy_(input_ids, non_blocking=True)
        self.positions[:size].copy_(positions, non_blocking=True)
        self.slot_mapping[:, :size].copy_(slot_mapping.view(self.num_groups, size), non_blocking=True)
        self.context_lens[:size].copy_(self.positions[:size] + 1)
        self.block_tables[:, :size, :width].copy_(block_tables.view(self.num_groups, size, width), non_blocking=True)
        self.slot_mapping[:, size:graph_size].fill_(-1)
        self.context_lens[size:graph_size].fill_(1)
        self.replays[graph_size]()
        self.num_replays[graph_size] += 1
        return self.hidden[:size]

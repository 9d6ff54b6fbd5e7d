"""The kernels' Python API (FlashInfer-style functions over torch tensors).

Each function checks shapes, dtypes, strides and alignment, then passes data pointers to a
launcher (CUDA through CuPy by default; the CPU emulator in tests). Unsupported dtypes or
head dims raise `UnsupportedKernelError` naming the value and what is supported.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pagedkv.errors import PagedKVError
from pagedkv.kernels import sources
from pagedkv.kernels.launchers import CupyLauncher, pointer

# Largest first. On an H100 (GQA 32q/8kv, d=128, bf16, batch >= 64) partitions of 2048 tokens ran
# 4-6% faster than 512: fewer CTAs each pay the query load, the final reductions and the
# partial outputs.
PARTITION_SIZES = (2048, 1024, 512, 256, 128, 64)
MAX_SHARED_BYTES = 48 * 1024  # what a launch gets without opting in to more
# Split-K keeps a float32 partial output per (token, head, partition). A long prefill chunk
# over a long context would need gigabytes at once, so such a launch is cut into token slices
# that reuse one workspace of at most this size.
MAX_SPLIT_K_WORKSPACE_BYTES = 64 * 1024 * 1024


class UnsupportedKernelError(PagedKVError, ValueError):
    """The kernels have no instantiation for this dtype, head dim or block size."""


_default_launchers: dict[torch.device, CupyLauncher] = {}


def default_launcher(device: torch.device):
    if device.type != "cuda":
        raise ValueError(
            f"pagedkv's CUDA kernels need CUDA tensors, got {device}; use the torch backend on CPU "
            "(or pass launcher=EmulatorLauncher() to emulate the kernels)"
        )
    if device not in _default_launchers:
        _default_launchers[device] = CupyLauncher(device)
    return _default_launchers[device]


def _dtype_code(tensor: torch.Tensor, what: str) -> int:
    if tensor.dtype not in sources.DTYPE_CODES:
        supported = ", ".join(str(dtype) for dtype in sources.DTYPE_CODES)
        raise UnsupportedKernelError(f"{what} has dtype {tensor.dtype}; the kernels support {supported}")
    return sources.DTYPE_CODES[tensor.dtype]


def _cache_code(cache: torch.Tensor, dtype_code: int, what: str) -> int:
    """The kernels' code for the cache dtype that goes with queries (or new K/V) of dtype_code."""
    code = sources.DTYPE_CODES.get(cache.dtype, sources.FP8_CODES.get(cache.dtype))
    if code not in sources.cache_codes(dtype_code):
        names = {code: dtype for dtype, code in {**sources.DTYPE_CODES, **sources.FP8_CODES}.items()}
        supported = ", ".join(str(names[code]) for code in sources.cache_codes(dtype_code))
        raise UnsupportedKernelError(f"{what} has dtype {cache.dtype}; with {names[dtype_code]} inputs the kernels "
                                     f"support {supported}")
    return code


def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int]:
    """(num_kv_heads, block_size, head_dim) of a same-shaped, same-strided K/V cache pair."""
    shape = _check_cache(key_cache, "key_cache")
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError("value_cache must have key_cache's shape and strides")
    if value_cache.dtype != key_cache.dtype or value_cache.device != key_cache.device:
        raise ValueError(f"value_cache must be {key_cache.dtype} on {key_cache.device} like key_cache")
    return shape


def _check_cache(cache: torch.Tensor, what: str) -> tuple[int, int, int]:
    if cache.dim() != 4:
        raise ValueError(f"{what} must be [num_blocks, num_kv_heads, block_size, head_dim], got {tuple(cache.shape)}")
    _, num_kv_heads, block_size, head_dim = cache.shape
    if cache.stride()[1:] != (block_size * head_dim, head_dim, 1):
        raise ValueError(f"{what} must be contiguous within a block, got strides {cache.stride()}")
    if cache.data_ptr() % 16 or (cache.stride(0) * cache.element_size()) % 16:
        raise ValueError(f"{what} blocks must be 16-byte aligned")
    return num_kv_heads, block_size, head_dim


def _check_rows(tensor: torch.Tensor, what: str, heads: int, head_dim: int) -> None:
    """[T, heads, head_dim] with contiguous heads, any 16-byte-aligned token stride."""
    if tensor.dim() != 3 or tensor.shape[1:] != (heads, head_dim):
        raise ValueError(f"{what} must be [num_tokens, {heads}, {head_dim}], got {tuple(tensor.shape)}")
    if tensor.stride(2) != 1 or tensor.stride(1) != head_dim:
        raise ValueError(f"{what} must have contiguous heads, got strides {tensor.stride()}")
    if tensor.data_ptr() % 16 or (tensor.stride(0) * tensor.element_size()) % 16:
        raise ValueError(f"{what} rows must be 16-byte aligned")


def _check_int(tensor: torch.Tensor, what: str, dtype: torch.dtype, device: torch.device) -> None:
    if tensor.dtype != dtype or tensor.device != device:
        raise ValueError(f"{what} must be {dtype} on {device}, got {tensor.dtype} on {tensor.device}")


def choose_partition_size(num_ctas: int, max_context_len: int, num_sms: int, largest: int = PARTITION_SIZES[0]) -> int:
    """The largest partition (up to `largest`) that still gives >= 2 CTAs per SM (split-K only
    where it pays)."""
    sizes = [size for size in PARTITION_SIZES if size <= largest]
    for size in sizes:
        if num_ctas * math.ceil(max_context_len / size) >= 2 * num_sms:
            return size
    return sizes[-1]


def shared_floats(tile: int, partition_size: int, head_dim: int, block_size: int) -> int:
    """Dynamic shared memory of one attention CTA, in floats (see paged_attention.cu)."""
    logits_or_reduction = max(tile * partition_size, sources.NUM_WARPS * tile * head_dim)
    return logits_or_reduction + 2 * tile + partition_size // block_size + 2  # + max/sum, block numbers


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_index: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    partition_size: int | None = None,
    max_workspace_bytes: int = MAX_SPLIT_K_WORKSPACE_BYTES,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    launcher=None,
) -> torch.Tensor:
    """Attention of each query token over its sequence's cached K/V.

    query [T, Hq, D]; key_cache/value_cache [num_blocks, Hkv, block_size, D] (any block
    stride); block_tables int32 [B, max_blocks]; seq_index int32 [T]: each token's row of
    block_tables; context_lens int32 [T]: cached tokens each query token sees (its own position
    + 1, which makes prefill chunks causal); max_context_len >= every context_lens entry;
    sliding_window: each token sees only the last this many of its cached tokens (None: all);
    logit_softcap: scaled logits become logit_softcap * tanh(logit / logit_softcap) (None: as
    they are); sinks: float32 [Hq] on the device, one attention-sink logit per query head
    (GPT-OSS: a key of value zero in each head's softmax), or None.
    Returns out [T, Hq, D]. partition_size forces the split-K partition (a multiple of 16,
    or max_context_len or more for a single pass); None chooses one. Split-K launches cover as
    many tokens at a time as fit in max_workspace_bytes of float32 scratch.
    """
    dtype_code = _dtype_code(query, "query")
    num_kv_heads, block_size, head_dim = _check_caches(key_cache, value_cache)
    cache_code = _cache_code(key_cache, dtype_code, "key_cache")
    if key_cache.device != query.device:
        raise ValueError(f"key_cache must be on {query.device} like the query")
    if head_dim not in sources.HEAD_DIMS:
        raise UnsupportedKernelError(f"head_dim={head_dim} is not supported (supported: {sources.HEAD_DIMS})")
    if block_size not in sources.BLOCK_SIZES:
        raise UnsupportedKernelError(f"block_size={block_size} is not supported (supported: {sources.BLOCK_SIZES})")
    num_heads = query.shape[1] if query.dim() == 3 else -1
    if num_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of the kv heads ({num_kv_heads})")
    _check_rows(query, "query", num_heads, head_dim)
    num_tokens = query.shape[0]
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    _check_rows(out, "out", num_heads, head_dim)
    if out.shape[0] != num_tokens or out.dtype != query.dtype:
        raise ValueError("out must be like the query")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be [num_seqs, max_blocks] with contiguous rows")
    _check_int(block_tables, "block_tables", torch.int32, query.device)
    for tensor, what in ((seq_index, "seq_index"), (context_lens, "context_lens")):
        _check_int(tensor, what, torch.int32, query.device)
        if tensor.shape != (num_tokens,) or not tensor.is_contiguous():
            raise ValueError(f"{what} must be contiguous [{num_tokens}], got {tuple(tensor.shape)}")
    if max_context_len > block_tables.shape[1] * block_size:
        raise ValueError(f"max_context_len={max_context_len} exceeds the block tables' {block_tables.shape[1]} blocks")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be > 0 or None, got {logit_softcap}")
    if sinks is not None:
        if sinks.shape != (num_heads,) or sinks.device != query.device:
            raise ValueError(f"sinks must be [{num_heads}] on {query.device}, got {tuple(sinks.shape)} on {sinks.device}")
        sinks = sinks.float().contiguous()
    sinks_pointer = np.uint64(0) if sinks is None else pointer(sinks)
    if num_tokens == 0:
        return out

    launcher = launcher or default_launcher(query.device)
    window = sliding_window or 0
    visible_len = min(max_context_len, sliding_window or max_context_len)  # what one token reads at most
    group = num_heads // num_kv_heads
    tile = sources.head_tile(group)
    num_ctas = num_tokens * num_kv_heads * (group // tile)
    if partition_size is None:
        fitting = [size for size in PARTITION_SIZES if shared_floats(tile, size, head_dim, block_size) * 4 <= MAX_SHARED_BYTES]
        partition_size = choose_partition_size(num_ctas, visible_len, launcher.num_sms, max(fitting))
    num_partitions = max(1, math.ceil(visible_len / partition_size))
    if num_partitions == 1:  # one pass: shared memory for the visible tokens only
        partition_size = visible_len
    shared = shared_floats(tile, partition_size, head_dim, block_size) * 4
    if shared > MAX_SHARED_BYTES:
        raise ValueError(f"partition_size={partition_size} needs more than 48 KiB of shared memory")

    if num_partitions == 1:
        tokens_per_launch, workspace = num_tokens, (np.uint64(0),) * 3
    else:
        bytes_per_token = num_heads * num_partitions * (head_dim + 2) * 4
        tokens_per_launch = max(1, min(num_tokens, max_workspace_bytes // bytes_per_token))
        scratch_shape = (tokens_per_launch, num_heads, num_partitions)
        partial_out = torch.empty((*scratch_shape, head_dim), dtype=torch.float32, device=query.device)
        stats = torch.empty((2, *scratch_shape), dtype=torch.float32, device=query.device)
        workspace = (pointer(partial_out), pointer(stats[0]), pointer(stats[1]))
    attention = sources.attention_kernel(dtype_code, cache_code, head_dim, block_size, tile)
    for first in range(0, num_tokens, tokens_per_launch):
        tokens = slice(first, first + tokens_per_launch)
        slice_len = min(tokens_per_launch, num_tokens - first)
        launcher.launch(
            sources.ATTENTION_SOURCE,
            attention,
            (slice_len, num_kv_heads * (group // tile), num_partitions),
            (sources.NUM_THREADS, 1, 1),
            shared,
            (
                pointer(out[tokens]), *workspace, pointer(query[tokens]), pointer(key_cache), pointer(value_cache),
                pointer(block_tables), pointer(seq_index[tokens]), pointer(context_lens[tokens]),
                np.int64(query.stride(0)), np.int64(out.stride(0)), np.int64(key_cache.stride(0)),
                np.int32(block_tables.stride(0)), np.int32(num_heads), np.int32(num_kv_heads),
                np.int32(partition_size), np.int32(num_partitions), np.float32(scale), np.int32(window),
                np.float32(logit_softcap or 0.0), sinks_pointer,
            ),
        )
        if num_partitions > 1:
            launcher.launch(
                sources.ATTENTION_SOURCE,
                sources.reduce_kernel(dtype_code, head_dim),
                (slice_len, num_heads, 1),
                (sources.NUM_THREADS, 1, 1),
                0,
                (
                    pointer(out[tokens]), *workspace, pointer(context_lens[tokens]), np.int64(out.stride(0)),
                    np.int32(num_heads), np.int32(partition_size), np.int32(num_partitions), np.int32(window),
                    sinks_pointer,
                ),
            )
    return out


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, launcher=None) -> None:
    """Writes key/value [T, Hkv, D] into slots slot_mapping (int64 [T]; -1 skips a token) of the
    per-layer caches [num_blocks, Hkv, block_size, D]: of the same dtype, or float8 (rounded to
    nearest even, saturating at the format's largest value)."""
    dtype_code = _dtype_code(key, "key")
    num_kv_heads, block_size, head_dim = _check_caches(key_cache, value_cache)
    cache_code = _cache_code(key_cache, dtype_code, "key_cache")
    for tensor, what in ((key, "key"), (value, "value")):
        if tensor.dtype != key.dtype or tensor.device != key_cache.device:
            raise ValueError(f"{what} must be {key.dtype} on {key_cache.device}")
    _check_rows(key, "key", num_kv_heads, head_dim)
    _check_rows(value, "value", num_kv_heads, head_dim)
    _check_int(slot_mapping, "slot_mapping", torch.int64, key_cache.device)
    if slot_mapping.shape != (key.shape[0],) or value.shape[0] != key.shape[0] or not slot_mapping.is_contiguous():
        raise ValueError("key, value and slot_mapping must have one entry per token")
    if key.shape[0] == 0:
        return
    launcher = launcher or default_launcher(key_cache.device)
    launcher.launch(
        sources.CACHE_OPS_SOURCE,
        sources.cache_kernel(dtype_code, cache_code),
        (key.shape[0], 1, 1),
        (128, 1, 1),
        0,
        (
            pointer(key_cache), pointer(value_cache), pointer(key), pointer(value), pointer(slot_mapping),
            np.int64(key.stride(0)), np.int64(value.stride(0)), np.int64(key_cache.stride(0)),
            np.int32(num_kv_heads), np.int32(block_size), np.int32(head_dim),
        ),
    )


def copy_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor, *, launcher=None) -> None:
    """Copy-on-write in one launch: whole blocks (every layer, K and V) of the contiguous
    block-major cache [num_blocks, ...], pairs int64 [P, 2] of (source, destination)."""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    _check_int(pairs, "pairs", torch.int64, kv_cache.device)
    if pairs.dim() != 2 or pairs.shape[1] != 2 or not pairs.is_contiguous():
        raise ValueError(f"pairs must be contiguous [num_pairs, 2], got {tuple(pairs.shape)}")
    block_bytes = kv_cache[0].numel() * kv_cache.element_size()
    if block_bytes % 16 or kv_cache.data_ptr() % 16:
        raise ValueError("kv_cache blocks must be whole 16-byte words")
    if pairs.shape[0] == 0:
        return
    launcher = launcher or default_launcher(kv_cache.device)
    launcher.launch(
        sources.CACHE_OPS_SOURCE,
        sources.COPY_BLOCKS_KERNEL,
        (pairs.shape[0], 1, 1),
        (256, 1, 1),
        0,
        (pointer(kv_cache), pointer(pairs), np.int64(block_bytes // 16)),
    )


def swap_blocks(target: torch.Tensor, source: torch.Tensor, pairs: torch.Tensor, *, launcher=None) -> None:
    """Swap in one launch on the current stream: whole blocks source[pairs[p, 0]] ->
    target[pairs[p, 1]] of two contiguous block-major caches of one shape and dtype, a CUDA one
    and a pinned CPU one (the GPU reads or writes the pinned memory directly), or two CUDA ones.
    pairs: int64 [P, 2] on the GPU."""
    if target.shape[1:] != source.shape[1:] or target.dtype != source.dtype:
        raise ValueError("target and source must be caches of one block shape and dtype")
    if not (target.is_contiguous() and source.is_contiguous()):
        raise ValueError("target and source must be contiguous")
    cuda = [tensor for tensor in (target, source) if tensor.is_cuda]
    if launcher is None:
        if not cuda:
            raise ValueError("swap_blocks needs a CUDA cache (or launcher=EmulatorLauncher())")
        host = [tensor for tensor in (target, source) if not tensor.is_cuda]
        if host and not host[0].is_pinned():
            raise ValueError("the CPU cache must be pinned: the GPU reads and writes it directly")
    device = cuda[0].device if cuda else pairs.device
    _check_int(pairs, "pairs", torch.int64, device)
    if pairs.dim() != 2 or pairs.shape[1] != 2 or not pairs.is_contiguous():
        raise ValueError(f"pairs must be contiguous [num_pairs, 2], got {tuple(pairs.shape)}")
    block_bytes = target[0].numel() * target.element_size()
    if block_bytes % 16 or target.data_ptr() % 16 or source.data_ptr() % 16:
        raise ValueError("cache blocks must be whole, aligned 16-byte words")
    if pairs.shape[0] == 0:
        return
    launcher = launcher or default_launcher(device)
    launcher.launch(
        sources.CACHE_OPS_SOURCE,
        sources.SWAP_BLOCKS_KERNEL,
        (pairs.shape[0], 1, 1),
        (256, 1, 1),
        0,
        (pointer(target), pointer(source), pointer(pairs), np.int64(block_bytes // 16)),
    )

"""The CPU backend: the torch reference, with decode attention (`rust/cpu_kernels/decode_attention.rs`) and
prefill/extend attention (`rust/cpu_kernels/prefill_attention.rs`) in Rust.

Both read K/V in place through the block table (the torch reference gathers them into new
tensors first) and split their work over torch's CPU threads. Caches of float32, bfloat16
(the fast CPU dtype where the CPU has AVX512-BF16: half the bytes to read, float32 math) or
float8 (`kv_cache_dtype="fp8"`: a quarter of float32's bytes, read with float32 queries);
float16 caches, head dims other than 64/128/256 in prefill, and CPUs without AVX2 go through
the torch reference (its public functions: `paged_attention_ref`, `decode_batch`, `write_kv`,
`copy_blocks`).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from pagedkv_core import _core
from pagedkv.attention import torch_ref
from pagedkv.attention.metadata import AttentionMetadata


logger = logging.getLogger("pagedkv.attention")

CACHE_DTYPES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}
PREFILL_HEAD_DIMS = (64, 128, 256)
# False sends prefill chunks through the torch reference (gather + SDPA; benchmarks compare).
prefill_kernel_enabled = True


def _kernel_query_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    """The query/output type the kernels pair with a cache type: its own, float32 for float8."""
    return cache_dtype if cache_dtype in (torch.float32, torch.bfloat16) else torch.float32


def _check_caches(query, key_cache, value_cache) -> None:
    """CPU caches [num_blocks, Hkv, block_size, D] of one of CACHE_DTYPES, contiguous within a
    block, sharing strides; a [T, Hq, D] query that fits them."""
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    if key_cache.dtype not in CACHE_DTYPES or value_cache.dtype != key_cache.dtype:
        names = ", ".join(str(dtype) for dtype in CACHE_DTYPES)
        raise ValueError(f"caches must both be one of {names}; got {key_cache.dtype} and {value_cache.dtype}")
    for tensor, what in ((query, "query"), (key_cache, "key_cache"), (value_cache, "value_cache")):
        if not tensor.dtype.is_floating_point or tensor.device.type != "cpu":
            raise ValueError(f"{what} must be a floating-point CPU tensor, got {tensor.dtype} on {tensor.device}")
    if query.dim() != 3 or query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit caches of {num_kv_heads} heads x {head_dim}")
    inner = (block_size * head_dim, head_dim, 1)
    if key_cache.stride()[1:] != inner or value_cache.stride() != key_cache.stride():
        raise ValueError("caches must be contiguous within a block and share strides")


def paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale: float,
                           sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """query [B, Hq, D] -> [B, Hq, D] of query's dtype: one query token per sequence over its
    first context_lens[b] cached tokens (the last `sliding_window` of them, where given), scaled
    logits soft-capped to `logit_softcap * tanh(logit / logit_softcap)` where given, `sinks` ([Hq]
    attention-sink logits, GPT-OSS's) in each head's softmax where given. Caches
    [num_blocks, Hkv, block_size, D] (any block stride), float32, bfloat16 or float8; the math is
    float32 whatever the dtypes."""
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    batch, num_heads, _ = query.shape
    _check_caches(query, key_cache, value_cache)
    result_dtype = query.dtype
    query = query.to(_kernel_query_dtype(key_cache.dtype)).contiguous()  # math in float32 either way
    tables = block_tables.to(torch.int32).contiguous()
    contexts = context_lens.to(torch.int32).contiguous()
    if tables.dim() != 2 or tables.shape[0] != batch or contexts.shape != (batch,):
        raise ValueError("block_tables must be [batch, width] and context_lens [batch]")
    out = torch.empty_like(query)
    sinks = _sinks(sinks, num_heads)
    shape = (batch, num_heads, num_kv_heads, head_dim, block_size, num_blocks, key_cache.stride(0), tables.shape[1])
    _core.paged_decode_attention_cpu(
        out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        tables.data_ptr(), contexts.data_ptr(), shape, scale, torch.get_num_threads(), CACHE_DTYPES[key_cache.dtype],
        _window(sliding_window), _softcap(logit_softcap), 0 if sinks is None else sinks.data_ptr(),
    )
    return out.to(result_dtype)


def paged_prefill_attention(
    query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale: float,
    sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D] of query's dtype: sequence b's new tokens are rows
    query_start_loc[b]:query_start_loc[b + 1], the last of its context_lens[b] cached tokens
    (their K/V already written), and attend causally to everything cached before them (to the
    last `sliding_window` positions, where given; logits soft-capped and sinks as in
    `paged_decode_attention`). Caches as for `paged_decode_attention`; head
    dims 64, 128 and 256 (`PREFILL_HEAD_DIMS`)."""
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    num_tokens, num_heads, _ = query.shape
    _check_caches(query, key_cache, value_cache)
    if head_dim not in PREFILL_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} has no CPU prefill kernel (supported: {PREFILL_HEAD_DIMS})")
    result_dtype = query.dtype
    query = query.to(_kernel_query_dtype(key_cache.dtype)).contiguous()  # math in float32 either way
    tables = block_tables.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    contexts = context_lens.to(torch.int32).contiguous()
    num_seqs = contexts.shape[0]
    if tables.dim() != 2 or tables.shape[0] != num_seqs or starts.shape != (num_seqs + 1,):
        raise ValueError("block_tables must be [num_seqs, width] and query_start_loc [num_seqs + 1]")
    out = torch.empty_like(query)
    sinks = _sinks(sinks, num_heads)
    shape = (num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, key_cache.stride(0), tables.shape[1])
    _core.paged_prefill_attention_cpu(
        out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
        starts.data_ptr(), contexts.data_ptr(), shape, num_tokens, scale, torch.get_num_threads(),
        CACHE_DTYPES[key_cache.dtype], _window(sliding_window), _softcap(logit_softcap),
        0 if sinks is None else sinks.data_ptr(),
    )
    return out.to(result_dtype)


def _window(sliding_window: Optional[int]) -> int:
    """The kernels' encoding: 0 for no window."""
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    return sliding_window


def _softcap(logit_softcap: Optional[float]) -> float:
    """The kernels' encoding: 0 for no soft cap."""
    if logit_softcap is None:
        return 0.0
    if not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be > 0 or None, got {logit_softcap}")
    return float(logit_softcap)


def _sinks(sinks: Optional[torch.Tensor], num_heads: int) -> Optional[torch.Tensor]:
    """The kernels' sinks: float32, contiguous, one per query head, on the CPU (or None)."""
    if sinks is None:
        return None
    if sinks.shape != (num_heads,) or sinks.device.type != "cpu":
        raise ValueError(f"sinks must be a CPU tensor of {num_heads} logits, got {tuple(sinks.shape)} on {sinks.device}")
    return sinks.float().contiguous()


def _decode(query, key_cache, value_cache, block_tables, context_lens, max_context_len: int, scale: float,
            sliding_window: Optional[int], logit_softcap: Optional[float], sinks: Optional[torch.Tensor]):
    if key_cache.dtype not in CACHE_DTYPES:
        return torch_ref.decode_batch(query, key_cache, value_cache, block_tables, context_lens, max_context_len, scale,
                             sliding_window, logit_softcap, sinks)
    return paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window,
                                  logit_softcap, sinks)


def _prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale: float,
             sliding_window: Optional[int], logit_softcap: Optional[float], sinks: Optional[torch.Tensor]):
    if not prefill_kernel_enabled or key_cache.dtype not in CACHE_DTYPES or key_cache.shape[3] not in PREFILL_HEAD_DIMS:
        return None
    return paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
                                   sliding_window, logit_softcap, sinks)


def write_kv(key_cache, value_cache, key, value, slot_mapping) -> None:
    """torch_ref.write_kv's scatter in one Rust call per cache (torch's index_put costs ~50 us a
    layer at one token); keys and values already in the caches' element type, as the engine's
    views lay them out (a layer's blocks strided in the block-major cache, rows strided in the qkv
    projection). Others through the reference, which converts them."""
    num_tokens = key.shape[0]
    if not (slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.shape == (num_tokens,)
            and _scatters(key_cache, key) and _scatters(value_cache, value)):
        torch_ref.write_kv(key_cache, value_cache, key, value, slot_mapping)
        return
    for cache, rows in ((key_cache, key), (value_cache, value)):
        _core.write_kv_cpu(cache.data_ptr(), rows.data_ptr(), slot_mapping.data_ptr(), num_tokens, tuple(cache.shape),
                           (cache.stride(0), rows.stride(0), rows.stride(1)), cache.element_size())


def _scatters(cache: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether the Rust write takes rows [T, H, D] into cache [blocks, H, block_size, D]."""
    _, heads, block_size, head_size = cache.shape
    return (rows.dtype == cache.dtype and rows.dim() == 3 and tuple(rows.shape[1:]) == (heads, head_size)
            and rows.stride(2) == 1 and rows.stride(1) >= head_size and rows.stride(0) >= 0
            and cache.stride()[1:] == (block_size * head_size, head_size, 1)
            and cache.stride(0) >= heads * block_size * head_size)


class CpuAttentionBackend:
    """The torch reference's attention with decode and prefill in Rust (AttentionBackend); writes
    and copies blocks as the reference does."""

    name = "cpu"
    supports_cuda_graphs = False

    @classmethod
    def check_supported(cls, device: str, head_dim: Optional[int]) -> None:
        """CPU tensors only."""
        if device.startswith("cuda"):
            raise ValueError("attention_backend='cpu' runs on the CPU; use 'cuda' or 'torch' on a GPU")

    def __init__(self):
        isa, on_openmp_team = _core.cpu_attention_build()
        threads = "torch's OpenMP team" if on_openmp_team else "threads of its own"
        logger.info("CPU attention kernels: %s build, %d threads on %s", isa, torch.get_num_threads(), threads)
        # Without SIMD (the portable build) torch's SDPA is the faster prefill.
        self._prefill = _prefill if isa != "Portable" else None

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Nothing to do once per step."""

    def write_kv(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        write_kv(key_cache, value_cache, key, value, slot_mapping)

    def forward(self, query, key_cache, value_cache, metadata: AttentionMetadata, scale: float,
                sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As TorchRefBackend.forward, the decode rows and prefill chunks through the Rust kernels."""
        return torch_ref.paged_attention_ref(query, key_cache, value_cache, metadata, scale, decode=_decode,
                                             prefill=self._prefill, sliding_window=sliding_window,
                                             logit_softcap=logit_softcap, sinks=sinks)

    def copy_blocks(self, kv_cache, pairs) -> None:
        torch_ref.copy_blocks(kv_cache, pairs)

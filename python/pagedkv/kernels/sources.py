"""Where the kernel sources are and which template instantiations exist.

A kernel is named by its source file and a C++ name expression, e.g.
`pagedkv::paged_attention_kernel<2, 128, 16, 4>`; CuPy compiles exactly the expressions a
process uses, CI compiles all of them.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # queries, outputs, new K/V
FP8_CODES = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}  # float8 KV caches (kv_cache_dtype="fp8")
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32)
MAX_HEAD_TILE = 8  # query heads per CTA; a larger GQA group is split into tiles
NUM_THREADS = 128  # paged_attention.cu's NUM_THREADS
NUM_WARPS = NUM_THREADS // 32

ATTENTION_SOURCE = "paged_attention.cu"
CACHE_OPS_SOURCE = "cache_ops.cu"
# Nothing beyond the include path: NVRTC's default dialect (C++17) and precise math, with fast
# exponentials written out as __expf; CuPy adds its own -arch and -ftz.
COMPILE_OPTIONS: tuple[str, ...] = ()


def cuda_source_dir() -> Path:
    """$PAGEDKV_CUDA_DIR, the copy inside an installed wheel, or the repository's cuda/."""
    override = os.environ.get("PAGEDKV_CUDA_DIR")
    candidates = [Path(override)] if override else []
    here = Path(__file__).resolve().parent
    candidates += [here / "cuda", here.parents[2] / "cuda"]
    for candidate in candidates:
        if (candidate / ATTENTION_SOURCE).is_file():
            return candidate
    raise FileNotFoundError(f"pagedkv CUDA sources not found in any of {[str(c) for c in candidates]}")


@functools.lru_cache(maxsize=None)
def digest() -> str:
    """sha256 (16 hex digits) of every source and header under cuda_source_dir()."""
    hasher = hashlib.sha256()
    for path in sorted(cuda_source_dir().rglob("*")):
        if path.suffix in (".cu", ".cuh", ".h"):
            hasher.update(path.relative_to(cuda_source_dir()).as_posix().encode() + b"\0" + path.read_bytes())
    return hasher.hexdigest()[:16]


def read_source(name: str) -> str:
    return (cuda_source_dir() / name).read_text()


def head_tile(group: int) -> int:
    """Query heads per CTA: the largest divisor of the GQA group that is <= MAX_HEAD_TILE."""
    return max(tile for tile in range(1, MAX_HEAD_TILE + 1) if group % tile == 0)


def cache_codes(dtype_code: int) -> list[int]:
    """The cache element types the kernels pair with queries of dtype_code: the same, or float8."""
    return [dtype_code, *FP8_CODES.values()]


def attention_kernel(dtype_code: int, cache_code: int, head_dim: int, block_size: int, tile: int) -> str:
    return f"pagedkv::paged_attention_kernel<{dtype_code}, {cache_code}, {head_dim}, {block_size}, {tile}>"


def reduce_kernel(dtype_code: int, head_dim: int) -> str:
    return f"pagedkv::reduce_partitions_kernel<{dtype_code}, {head_dim}>"


def cache_kernel(dtype_code: int, cache_code: int) -> str:
    return f"pagedkv::reshape_and_cache_kernel<{dtype_code}, {cache_code}>"


COPY_BLOCKS_KERNEL = "copy_blocks_kernel"
SWAP_BLOCKS_KERNEL = "swap_blocks_kernel"


def all_instantiations() -> dict[str, list[str]]:
    """Every kernel the Python side can launch, by source file (what CI compiles)."""
    attention = [
        attention_kernel(code, cache_code, head_dim, block_size, tile)
        for code in DTYPE_CODES.values()
        for cache_code in cache_codes(code)
        for head_dim in HEAD_DIMS
        for block_size in BLOCK_SIZES
        for tile in range(1, MAX_HEAD_TILE + 1)
    ]
    attention += [reduce_kernel(code, head_dim) for code in DTYPE_CODES.values() for head_dim in HEAD_DIMS]
    cache = [cache_kernel(code, cache_code) for code in DTYPE_CODES.values() for cache_code in cache_codes(code)]
    cache += [COPY_BLOCKS_KERNEL, SWAP_BLOCKS_KERNEL]
    return {ATTENTION_SOURCE: attention, CACHE_OPS_SOURCE: cache}

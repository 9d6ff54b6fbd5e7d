"""The CUDA kernels against a float64 torch reference, on the GPU when there is one and through
the CPU emulator (cuda/emu) everywhere, so CI checks the kernels' results without a GPU.

Random data, random non-contiguous block tables, context lengths including 1 and
non-multiples of the block size, outputs poisoned with NaN before every run.
"""

import math
import shutil

import pytest
import torch

from pagedkv.kernels import (
    EmulatorLauncher,
    UnsupportedKernelError,
    copy_blocks,
    paged_attention,
    reshape_and_cache,
    swap_blocks,
)
from pagedkv.kernels import sources

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# float8 caches (kv_cache_dtype="fp8"): (query dtype, cache dtype) pairs the emulator builds.
FP8_PAIRS = [(torch.bfloat16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2), (torch.float32, torch.float8_e4m3fn),
             (torch.float16, torch.float8_e5m2)]
# (head_dim, block_size, num_heads, num_kv_heads): SmolLM2's GQA 9/3, a Llama-like 8/2 with
# 32-token blocks, plain multi-head attention, and a GQA group of 16 (two head tiles).
SHAPES = [(64, 16, 9, 3), (128, 32, 8, 2), (64, 8, 4, 4), (256, 16, 16, 1)]


def _has_cuda() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.fixture(scope="module", params=["emulator", "cuda"])
def target(request, tmp_path_factory):
    """(launcher, device): the CPU emulator, or CuPy on the GPU."""
    if request.param == "cuda":
        if not _has_cuda():
            pytest.skip("needs a CUDA GPU and CuPy")
        from pagedkv.kernels import CupyLauncher

        return CupyLauncher(torch.device("cuda")), torch.device("cuda")
    if shutil.which("g++") is None:
        pytest.fail("the kernel emulator needs g++ (C++20)")
    launcher = EmulatorLauncher(tmp_path_factory.mktemp("emulator"))
    kernels = []
    for code in sources.DTYPE_CODES.values():
        for head_dim, block_size, num_heads, num_kv_heads in SHAPES:
            tile = sources.head_tile(num_heads // num_kv_heads)
            kernels.append((sources.ATTENTION_SOURCE, sources.attention_kernel(code, code, head_dim, block_size, tile)))
        kernels += [(sources.ATTENTION_SOURCE, sources.reduce_kernel(code, d)) for d in sources.HEAD_DIMS]
        kernels.append((sources.CACHE_OPS_SOURCE, sources.cache_kernel(code, code)))
    for query_dtype, cache_dtype in FP8_PAIRS:
        code, cache_code = sources.DTYPE_CODES[query_dtype], sources.FP8_CODES[cache_dtype]
        for head_dim, block_size, num_heads, num_kv_heads in SHAPES[:2]:
            tile = sources.head_tile(num_heads // num_kv_heads)
            kernels.append((sources.ATTENTION_SOURCE,
                            sources.attention_kernel(code, cache_code, head_dim, block_size, tile)))
        kernels.append((sources.CACHE_OPS_SOURCE, sources.cache_kernel(code, cache_code)))
    kernels += [(sources.CACHE_OPS_SOURCE, sources.COPY_BLOCKS_KERNEL), (sources.CACHE_OPS_SOURCE, sources.SWAP_BLOCKS_KERNEL)]
    launcher.prepare(kernels)  # one build for the whole module
    return launcher, torch.device("cpu")


def block_major_cache(num_blocks, num_layers, num_kv_heads, block_size, head_dim, dtype, device, generator):
    """The engine's cache layout [N, L, 2, Hkv, bs, D] with random content; returns it and the
    (key, value) views of layer 1, whose block stride is not their block size."""
    cache = torch.randn((num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim), generator=generator)
    cache = cache.to(dtype).to(device)
    return cache, cache[:, 1, 0], cache[:, 1, 1]


def reference_attention(query, key_cache, value_cache, block_tables, seq_index, context_lens, scale,
                        sliding_window=None, logit_softcap=None, sinks=None):
    """float64, one query token at a time (over its last sliding_window cached tokens, if given;
    logits soft-capped to logit_softcap * tanh(logit / logit_softcap), if given; a key of logit
    sinks[h] and value zero in head h's softmax, if given)."""
    num_heads, num_kv_heads, block_size = query.shape[1], key_cache.shape[1], key_cache.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    for t in range(query.shape[0]):
        context = int(context_lens[t])
        blocks = block_tables[int(seq_index[t])][: math.ceil(context / block_size)].long().cpu()
        keys = key_cache.cpu()[blocks].double().transpose(0, 1).reshape(num_kv_heads, -1, query.shape[2])[:, :context]
        values = value_cache.cpu()[blocks].double().transpose(0, 1).reshape(num_kv_heads, -1, query.shape[2])[:, :context]
        group = num_heads // num_kv_heads
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        if sliding_window is not None:
            keys, values = keys[:, -sliding_window:], values[:, -sliding_window:]
        scores = torch.einsum("hd,hcd->hc", query[t].cpu().double(), keys) * scale
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        weights = scores.softmax(-1)
        if sinks is not None:
            weights = torch.cat([scores, sinks.cpu().double()[:, None]], dim=1).softmax(-1)[:, :-1]
        out[t] = torch.einsum("hc,hcd->hd", weights, values)
    return out


def relative_error(actual, expected):
    return ((actual.cpu().double() - expected).norm() / expected.norm()).item()


def make_batch(shape, dtype, device, generator, context_lens_per_seq, prefill_chunks=(), cache_dtype=None):
    """Sequences with random non-contiguous block tables; one decode token per sequence, plus
    for each (seq, chunk_len) in prefill_chunks the last chunk_len tokens of that sequence as
    causal queries. Returns the kernel arguments (query is a strided view of a qkv tensor);
    the cache is of cache_dtype (default: dtype)."""
    head_dim, block_size, num_heads, num_kv_heads = shape
    max_blocks = max(math.ceil(c / block_size) for c in context_lens_per_seq) + 1
    num_blocks = max_blocks * len(context_lens_per_seq) + 3
    cache, key_cache, value_cache = block_major_cache(
        num_blocks, 2, num_kv_heads, block_size, head_dim, cache_dtype or dtype, device, generator
    )
    permutation = torch.randperm(num_blocks, generator=generator)
    block_tables = permutation[: len(context_lens_per_seq) * max_blocks].view(-1, max_blocks).int()
    seq_index, token_contexts = [], []
    for seq, chunk in prefill_chunks:
        context = context_lens_per_seq[seq]
        seq_index += [seq] * chunk
        token_contexts += list(range(context - chunk + 1, context + 1))
    for seq, context in enumerate(context_lens_per_seq):
        seq_index.append(seq)
        token_contexts.append(context)
    num_tokens = len(seq_index)
    qkv = torch.randn((num_tokens, num_heads + 2 * num_kv_heads, head_dim), generator=generator).to(dtype).to(device)
    query = qkv[:, :num_heads]
    as_int = dict(dtype=torch.int32, device=device)
    return dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device),
        seq_index=torch.tensor(seq_index, **as_int),
        context_lens=torch.tensor(token_contexts, **as_int),
        max_context_len=max(token_contexts),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}-bs{}-h{}-kv{}".format(*s))
@pytest.mark.parametrize("partition_size", [None, 64], ids=["auto", "splitk64"])
def test_paged_decode_matches_reference(target, dtype, shape, partition_size):
    launcher, device = target
    generator = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    contexts = [1, 17, 200, shape[1] * 3, 129]
    batch = make_batch(shape, dtype, device, generator, contexts)
    out = torch.full(batch["query"].shape, float("nan"), dtype=dtype, device=device)
    scale = shape[0] ** -0.5
    paged_attention(**batch, scale=scale, out=out, partition_size=partition_size, launcher=launcher)
    expected = reference_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_index"], batch["context_lens"], scale,
    )
    assert not torch.isnan(out).any()
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("partition_size", [1024, 2048])
def test_long_partitions_match_reference(target, partition_size):
    """The largest split-K partitions (chosen at large batch x long context) over contexts that
    span one, two and three of them."""
    launcher, device = target
    shape = SHAPES[0]
    generator = torch.Generator().manual_seed(partition_size)
    batch = make_batch(shape, torch.bfloat16, device, generator, [1, 1500, partition_size * 2 + 5])
    out = torch.full(batch["query"].shape, float("nan"), dtype=torch.bfloat16, device=device)
    paged_attention(**batch, scale=0.125, out=out, partition_size=partition_size, launcher=launcher)
    expected = reference_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_index"], batch["context_lens"], 0.125,
    )
    assert not torch.isnan(out).any()
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


def test_automatic_partitions_fit_shared_memory_and_fill_the_gpu():
    from pagedkv.kernels.ops import MAX_SHARED_BYTES, PARTITION_SIZES, choose_partition_size, shared_floats

    # Batch 256 x 8192 tokens, 8 kv heads, 132 SMs: the largest partition; batch 1: small ones.
    assert choose_partition_size(256 * 8, 8192, 132) == PARTITION_SIZES[0]
    assert choose_partition_size(8, 8192, 132) == 128
    assert choose_partition_size(256 * 8, 8192, 132, largest=1024) == 1024
    for tile in range(1, sources.MAX_HEAD_TILE + 1):
        for head_dim in sources.HEAD_DIMS:
            fitting = [size for size in PARTITION_SIZES if shared_floats(tile, size, head_dim, 8) * 4 <= MAX_SHARED_BYTES]
            assert PARTITION_SIZES[-1] in fitting


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("partition_size", [None, 64], ids=["auto", "splitk64"])
def test_paged_prefill_and_extend_are_causal(target, dtype, partition_size):
    """A whole prompt (seq 0) and a chunk after a cached prefix (seq 1), next to decodes."""
    launcher, device = target
    shape = SHAPES[0]
    generator = torch.Generator().manual_seed(7)
    batch = make_batch(shape, dtype, device, generator, [45, 150, 9], prefill_chunks=[(0, 44), (1, 37)])
    scale = shape[0] ** -0.5
    out = paged_attention(**batch, scale=scale, partition_size=partition_size, launcher=launcher)
    expected = reference_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_index"], batch["context_lens"], scale,
    )
    assert relative_error(out, expected) < TOLERANCE[dtype]
    # Causality really matters here: attending to the whole context gives other outputs.
    full = batch["context_lens"].clone()
    full[:44] = 45
    leaky = reference_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_index"], full, scale,
    )
    assert relative_error(out[:43], leaky[:43]) > 10 * TOLERANCE[dtype]


@pytest.mark.parametrize("sliding_window", [1, 20, 100, 1000])
@pytest.mark.parametrize("partition_size", [None, 32], ids=["auto", "splitk32"])
def test_sliding_window_attention_sees_the_last_window_tokens(target, sliding_window, partition_size):
    """Prefill chunks and decodes, each token over the last `sliding_window` cached tokens only,
    in one pass and split-K (a window spanning several partitions, one starting mid-partition)."""
    launcher, device = target
    shape, dtype = SHAPES[0], torch.float32
    generator = torch.Generator().manual_seed(sliding_window)
    batch = make_batch(shape, dtype, device, generator, [45, 150, 9, 230], prefill_chunks=[(0, 44), (1, 37)])
    scale = shape[0] ** -0.5
    out = paged_attention(**batch, scale=scale, partition_size=partition_size, sliding_window=sliding_window,
                          launcher=launcher)
    arguments = [batch[name] for name in ("query", "key_cache", "value_cache", "block_tables", "seq_index",
                                          "context_lens")]
    expected = reference_attention(*arguments, scale, sliding_window)
    assert relative_error(out, expected) < TOLERANCE[dtype]
    if sliding_window < 100:  # shorter than most contexts: the window changes the result
        assert relative_error(out, reference_attention(*arguments, scale)) > 10 * TOLERANCE[dtype]


@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("partition_size", [None, 32], ids=["auto", "splitk32"])
def test_soft_capped_logits(target, sliding_window, partition_size):
    """Gemma 2's attention soft cap: logits squashed to cap * tanh(logit / cap) before the
    softmax, in one pass and split-K (whose reduction rescales by the capped maxima)."""
    launcher, device = target
    shape, dtype, cap = SHAPES[0], torch.float32, 1.5
    generator = torch.Generator().manual_seed(5)
    batch = make_batch(shape, dtype, device, generator, [45, 150, 9, 230], prefill_chunks=[(0, 44), (1, 37)])
    batch["query"] = batch["query"] * 4  # logits of several units, where the cap bends them
    scale = shape[0] ** -0.5
    out = paged_attention(**batch, scale=scale, partition_size=partition_size, sliding_window=sliding_window,
                          logit_softcap=cap, launcher=launcher)
    arguments = [batch[name] for name in ("query", "key_cache", "value_cache", "block_tables", "seq_index",
                                          "context_lens")]
    expected = reference_attention(*arguments, scale, sliding_window, cap)
    assert relative_error(out, expected) < TOLERANCE[dtype]
    assert relative_error(out, reference_attention(*arguments, scale, sliding_window)) > 10 * TOLERANCE[dtype]
    with pytest.raises(ValueError, match="logit_softcap"):
        paged_attention(**batch, scale=scale, logit_softcap=0.0, launcher=launcher)


@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("partition_size", [None, 32], ids=["auto", "splitk32"])
def test_attention_sinks(target, sliding_window, partition_size):
    """GPT-OSS's attention sinks, a zero-valued key of logit sinks[h] in head h's softmax: in one
    pass (in the partition's softmax) and split-K (added once, when reducing the partitions)."""
    launcher, device = target
    shape, dtype = SHAPES[0], torch.float32
    generator = torch.Generator().manual_seed(6)
    batch = make_batch(shape, dtype, device, generator, [45, 150, 9, 230], prefill_chunks=[(0, 44), (1, 37)])
    scale = shape[0] ** -0.5
    sinks = torch.linspace(-2.0, 4.0, shape[2]).to(device)
    out = paged_attention(**batch, scale=scale, partition_size=partition_size, sliding_window=sliding_window,
                          sinks=sinks, launcher=launcher)
    arguments = [batch[name] for name in ("query", "key_cache", "value_cache", "block_tables", "seq_index",
                                          "context_lens")]
    expected = reference_attention(*arguments, scale, sliding_window, sinks=sinks)
    assert relative_error(out, expected) < TOLERANCE[dtype]
    assert relative_error(out, reference_attention(*arguments, scale, sliding_window)) > 10 * TOLERANCE[dtype]
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(**batch, scale=scale, sinks=sinks[:1], launcher=launcher)


class CountingLauncher:
    """Passes launches through and counts them by kernel name."""

    def __init__(self, launcher):
        self.launcher, self.num_sms, self.counts = launcher, launcher.num_sms, {}

    def launch(self, source, expression, *args):
        name = expression.split("<")[0]
        self.counts[name] = self.counts.get(name, 0) + 1
        self.launcher.launch(source, expression, *args)


def test_split_k_workspace_is_bounded_by_launching_token_slices(target):
    """A long prefill chunk whose split-K scratch would exceed the budget runs in token slices
    that reuse one workspace, with the same results."""
    launcher, device = target
    shape, dtype = SHAPES[0], torch.float32
    generator = torch.Generator().manual_seed(11)
    batch = make_batch(shape, dtype, device, generator, [45, 150, 9], prefill_chunks=[(0, 44), (1, 37)])
    num_tokens, num_heads, head_dim = batch["query"].shape
    num_partitions = math.ceil(batch["max_context_len"] / 64)
    bytes_per_token = num_heads * num_partitions * (head_dim + 2) * 4
    counting = CountingLauncher(launcher)
    out = paged_attention(
        **batch, scale=0.125, partition_size=64, max_workspace_bytes=7 * bytes_per_token + 5, launcher=counting
    )
    expected = reference_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_index"], batch["context_lens"], 0.125,
    )
    assert relative_error(out, expected) < TOLERANCE[dtype]
    slices = math.ceil(num_tokens / 7)
    assert counting.counts == {"pagedkv::paged_attention_kernel": slices, "pagedkv::reduce_partitions_kernel": slices}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_writes_exactly_the_mapped_slots(target, dtype):
    launcher, device = target
    head_dim, block_size, _, num_kv_heads = SHAPES[0]
    generator = torch.Generator().manual_seed(3)
    cache, key_cache, value_cache = block_major_cache(12, 2, num_kv_heads, block_size, head_dim, dtype, device, generator)
    before = cache.clone()
    num_tokens = 30
    slots = torch.randperm(12 * block_size, generator=generator)[:num_tokens]
    slots[[4, 11]] = -1  # padding tokens are not stored
    kv = torch.randn((num_tokens, 2 * num_kv_heads + 1, head_dim), generator=generator).to(dtype).to(device)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads + 1 :]  # strided views
    reshape_and_cache(key, value, key_cache, value_cache, slots.to(device), launcher=launcher)

    expected = before.clone()
    keep = slots >= 0
    blocks, offsets = (slots[keep] // block_size).to(device), (slots[keep] % block_size).to(device)
    expected[:, 1, 0][blocks, :, offsets] = key[keep.to(device)]
    expected[:, 1, 1][blocks, :, offsets] = value[keep.to(device)]
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_copies_every_layer_of_each_pair(target, dtype):
    launcher, device = target
    generator = torch.Generator().manual_seed(5)
    cache, _, _ = block_major_cache(10, 3, 2, 16, 64, dtype, device, generator)
    before = cache.clone()
    pairs = torch.tensor([[0, 7], [2, 3], [9, 1]], dtype=torch.int64, device=device)
    copy_blocks(cache, pairs, launcher=launcher)
    expected = before.clone()
    expected[pairs[:, 1]] = before[pairs[:, 0]]
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("direction", ["out", "in"])
def test_swap_blocks_moves_scattered_blocks_between_the_gpu_and_pinned_memory(target, direction):
    """Swap in one launch: the GPU writes (swap-out) or reads (swap-in) the pinned CPU cache
    directly; the blocks named land bit-exactly, every other block keeps its bytes."""
    launcher, device = target
    generator = torch.Generator().manual_seed(6)
    gpu_cache, _, _ = block_major_cache(12, 3, 2, 16, 64, torch.bfloat16, device, generator)
    cpu_cache = torch.randn(gpu_cache.shape, generator=generator).to(torch.bfloat16)
    if device.type == "cuda":
        cpu_cache = cpu_cache.pin_memory()
    source, target_cache = (gpu_cache, cpu_cache) if direction == "out" else (cpu_cache, gpu_cache)
    expected = target_cache.clone()
    pairs = torch.tensor([[11, 0], [3, 7], [4, 2], [0, 11]], dtype=torch.int64)
    expected[pairs[:, 1]] = source.cpu()[pairs[:, 0]].to(expected.device)
    swap_blocks(target_cache, source, pairs.to(device), launcher=launcher)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(target_cache, expected)


def test_unsupported_dtype_and_head_dim_are_named(target):
    launcher, device = target
    generator = torch.Generator().manual_seed(0)
    batch = make_batch(SHAPES[0], torch.float32, device, generator, [5])
    as_double = {**batch, "query": batch["query"].double()}
    with pytest.raises(UnsupportedKernelError, match="float64"):
        paged_attention(**as_double, scale=1.0, launcher=launcher)
    odd = make_batch((96, 16, 4, 2), torch.float32, device, generator, [5])
    with pytest.raises(UnsupportedKernelError, match="head_dim=96"):
        paged_attention(**odd, scale=1.0, launcher=launcher)


def test_cpu_tensors_without_a_launcher_are_refused():
    generator = torch.Generator().manual_seed(0)
    batch = make_batch(SHAPES[0], torch.float32, torch.device("cpu"), generator, [5])
    with pytest.raises(ValueError, match="CUDA tensors"):
        paged_attention(**batch, scale=1.0)


def test_cuda_backend_matches_the_torch_reference_on_a_mixed_step(target):
    """The engine's view: a prefill chunk after a cached prefix, a whole prompt and decodes,
    described by AttentionMetadata, through CudaAttentionBackend and TorchRefBackend."""
    from pagedkv.attention import AttentionMetadata, TorchRefBackend
    from pagedkv.attention.cuda import CudaAttentionBackend

    launcher, device = target
    head_dim, block_size, num_heads, num_kv_heads = SHAPES[0]
    generator = torch.Generator().manual_seed(11)
    cache, key_cache, value_cache = block_major_cache(24, 2, num_kv_heads, block_size, head_dim, torch.float32, device, generator)
    reference_cache = cache.clone()
    new_tokens, contexts = [20, 9, 1, 1], [52, 9, 33, 70]  # (chunk after 32 cached, prompt, decodes)
    tables = torch.randperm(24, generator=generator)[:20].view(4, 5).int()
    starts = [0]
    slots = []
    for seq, (count, context) in enumerate(zip(new_tokens, contexts)):
        starts.append(starts[-1] + count)
        for position in range(context - count, context):
            slots.append(int(tables[seq, position // block_size]) * block_size + position % block_size)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(new_tokens),
        max_context_len=max(contexts),
        num_decode_tokens=2,
        query_start_loc_host=starts,
        context_lens_host=contexts,
    )
    num_tokens = starts[-1]
    query = torch.randn((num_tokens, num_heads, head_dim), generator=generator).to(device)
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=generator).to(device)
    value = torch.randn((num_tokens, num_kv_heads, head_dim), generator=generator).to(device)

    outputs = []
    for backend, kv in ((CudaAttentionBackend(launcher), cache), (TorchRefBackend(), reference_cache)):
        backend.write_kv(kv[:, 1, 0], kv[:, 1, 1], key, value, metadata.slot_mapping)
        outputs.append(backend.forward(query, kv[:, 1, 0], kv[:, 1, 1], metadata, head_dim**-0.5))
        backend.copy_blocks(kv, torch.tensor([[tables[0, 0], 23]], dtype=torch.int64, device=device))
    assert torch.equal(cache, reference_cache)
    assert relative_error(outputs[0], outputs[1].cpu().double()) < 1e-5


@pytest.mark.parametrize("dtypes", FP8_PAIRS, ids=lambda pair: f"{pair[0]}-{pair[1]}".replace("torch.", ""))
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "d{}-bs{}-h{}-kv{}".format(*s))
def test_float8_caches_match_the_reference_on_their_values(target, dtypes, shape):
    """Queries of the model's dtype over a float8 cache: against float64 math on the codes'
    exact values, for decodes, a causal chunk after a cached prefix, and split-K."""
    launcher, device = target
    dtype, cache_dtype = dtypes
    generator = torch.Generator().manual_seed(hash((str(dtypes), shape)) % 2**31)
    batch = make_batch(shape, dtype, device, generator, [1, 17, 200, 129], prefill_chunks=[(2, 30)],
                       cache_dtype=cache_dtype)
    scale = shape[0] ** -0.5
    expected = reference_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_index"], batch["context_lens"], scale,
    )
    for partition_size in (None, 64):
        out = torch.full(batch["query"].shape, float("nan"), dtype=dtype, device=device)
        paged_attention(**batch, scale=scale, out=out, partition_size=partition_size, launcher=launcher)
        assert out.dtype == dtype and not torch.isnan(out).any()
        assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtypes", FP8_PAIRS, ids=lambda pair: f"{pair[0]}-{pair[1]}".replace("torch.", ""))
def test_reshape_and_cache_narrows_to_float8_as_torch_does(target, dtypes):
    """Every written code equals torch's own conversion of the value clamped to the format's
    range (what the torch reference backend stores): ties, subnormals, saturation, signs."""
    from pagedkv.attention.torch_ref import to_cache_dtype

    launcher, device = target
    dtype, cache_dtype = dtypes
    head_dim, block_size, _, num_kv_heads = SHAPES[0]
    generator = torch.Generator().manual_seed(13)
    cache = torch.zeros((8, 2, 2, num_kv_heads, block_size, head_dim), dtype=cache_dtype, device=device)
    key_cache, value_cache = cache[:, 1, 0], cache[:, 1, 1]
    num_tokens = 24
    # Magnitudes from far below the smallest subnormal to far above the largest value, and
    # every code's exact value and the midpoints between neighbouring codes (ties).
    codes = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
    codes = codes[torch.isfinite(codes)]
    midpoints = (codes.sort().values[1:] + codes.sort().values[:-1]) / 2
    size = 2 * num_tokens * num_kv_heads * head_dim
    spread = torch.randn(size, generator=generator) * 10.0 ** torch.randint(-12, 7, (size,), generator=generator).float()
    values = torch.cat([codes, midpoints, spread])[:size]
    kv = values.view(num_tokens, 2 * num_kv_heads, head_dim).to(dtype).to(device)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.randperm(8 * block_size, generator=generator)[:num_tokens].to(device)
    reshape_and_cache(key, value, key_cache, value_cache, slots, launcher=launcher)
    blocks, offsets = slots // block_size, slots % block_size
    for written, source in ((key_cache, key), (value_cache, value)):
        got = written[blocks, :, offsets].view(torch.uint8)
        want = to_cache_dtype(source.float(), cache_dtype).view(torch.uint8)
        assert torch.equal(got, want)


def test_float8_cuda_backend_matches_the_torch_reference(target):
    """The engine's float8 step through CudaAttentionBackend and TorchRefBackend: same cache
    bytes after the write and a block copy, attention outputs within float32 rounding."""
    from pagedkv.attention import AttentionMetadata, TorchRefBackend
    from pagedkv.attention.cuda import CudaAttentionBackend

    launcher, device = target
    head_dim, block_size, num_heads, num_kv_heads = SHAPES[0]
    generator = torch.Generator().manual_seed(17)
    cache = (torch.randn((24, 2, 2, num_kv_heads, block_size, head_dim), generator=generator) * 4).to(torch.float8_e4m3fn)
    cache = cache.to(device)
    reference_cache = cache.clone()
    new_tokens, contexts = [20, 9, 1, 1], [52, 9, 33, 70]
    tables = torch.randperm(24, generator=generator)[:20].view(4, 5).int()
    starts, slots = [0], []
    for seq, (count, context) in enumerate(zip(new_tokens, contexts)):
        starts.append(starts[-1] + count)
        slots += [int(tables[seq, p // block_size]) * block_size + p % block_size for p in range(context - count, context)]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(new_tokens), max_context_len=max(contexts), num_decode_tokens=2,
        query_start_loc_host=starts, context_lens_host=contexts,
    )
    num_tokens = starts[-1]
    query, key, value = (torch.randn((num_tokens, heads, head_dim), generator=generator).to(device) * 3
                         for heads in (num_heads, num_kv_heads, num_kv_heads))
    outputs = []
    for backend, kv in ((CudaAttentionBackend(launcher), cache), (TorchRefBackend(), reference_cache)):
        backend.write_kv(kv[:, 1, 0], kv[:, 1, 1], key, value, metadata.slot_mapping)
        outputs.append(backend.forward(query, kv[:, 1, 0], kv[:, 1, 1], metadata, head_dim**-0.5))
        backend.copy_blocks(kv, torch.tensor([[tables[0, 0], 23]], dtype=torch.int64, device=device))
    assert torch.equal(cache.view(torch.uint8), reference_cache.view(torch.uint8))
    assert relative_error(outputs[0], outputs[1].cpu().double()) < 1e-5

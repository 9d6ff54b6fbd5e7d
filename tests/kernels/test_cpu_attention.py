"""The CPU backend's Rust decode and prefill attention against the torch reference and a float64 one."""

import pytest
import torch

from pagedkv.attention import AttentionMetadata, get_backend
from pagedkv.attention.cpu import CpuAttentionBackend, paged_decode_attention, paged_prefill_attention
from pagedkv.attention.torch_ref import TorchRefBackend, decode_batch, prefill_one
from pagedkv.attention.torch_ref import write_kv as torch_ref_write_kv


def block_major(num_blocks, num_kv_heads, block_size, head_dim, generator, dtype=torch.float32):
    cache = torch.randn((num_blocks, 3, 2, num_kv_heads, block_size, head_dim), generator=generator).to(dtype)
    return cache[:, 1, 0], cache[:, 1, 1]  # layer views: block stride != block size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (4, 4, 128, 8), (8, 1, 32, 32), (4, 1, 256, 16)])
def test_rust_decode_matches_the_reference(num_heads, num_kv_heads, head_dim, block_size, dtype):
    """Against float64 attention over the same (already rounded) values: the kernel's float32
    math adds ~1e-6 whatever the cache dtype; a bfloat16 output adds its own rounding."""
    generator = torch.Generator().manual_seed(num_heads * 1000 + head_dim)
    key_cache, value_cache = block_major(40, num_kv_heads, block_size, head_dim, generator, dtype)
    contexts = torch.tensor([1, block_size + 1, 3 * block_size, 77, 150], dtype=torch.int32)
    width = 150 // block_size + 2
    tables = torch.stack([torch.randperm(40, generator=generator)[:width] for _ in contexts]).int()
    query = torch.randn((len(contexts), num_heads, head_dim), generator=generator).to(dtype)
    got = paged_decode_attention(query, key_cache, value_cache, tables, contexts, head_dim**-0.5)
    want = decode_batch(query.double(), key_cache.double(), value_cache.double(), tables, contexts, 150, head_dim**-0.5)
    assert got.dtype == dtype
    tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    assert torch.allclose(got.double(), want, **tolerance)
    if dtype == torch.bfloat16:  # exactly the float32 kernel's result, rounded once
        widened = key_cache.float(), value_cache.float()
        exact = paged_decode_attention(query.float(), *widened, tables, contexts, head_dim**-0.5)
        assert torch.equal(got, exact.to(torch.bfloat16))


def test_bad_tables_raise_instead_of_reading_out_of_bounds():
    generator = torch.Generator().manual_seed(0)
    key_cache, value_cache = block_major(4, 2, 16, 64, generator)
    query = torch.randn((1, 2, 64))
    with pytest.raises(ValueError, match="block 9"):
        paged_decode_attention(query, key_cache, value_cache, torch.tensor([[0, 9]]), torch.tensor([20]), 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(query, key_cache, value_cache, torch.tensor([[0, 1]]), torch.tensor([33]), 1.0)
    with pytest.raises(ValueError, match="caches must both be one of .*float16"):
        half = key_cache.half()
        paged_decode_attention(query, half, half, torch.tensor([[0, 1]]), torch.tensor([3]), 1.0)


def test_auto_backend_on_cpu_is_the_rust_decode_backend():
    assert isinstance(get_backend("auto", "cpu"), CpuAttentionBackend)
    assert get_backend("torch", "cpu").name == "torch"


def test_decode_runs_on_torchs_openmp_team_where_torch_uses_libgomp():
    """Linux torch wheels bring libgomp: the kernel must find that team (threads of its own
    would share the cores with torch's spinning workers, at half speed)."""
    import pathlib
    import sys

    from pagedkv_core import _core

    isa, on_openmp_team = _core.cpu_attention_build()
    assert isa in ("Avx512", "Avx2Fma", "Portable")
    torch_has_libgomp = any(pathlib.Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*"))
    if sys.platform == "linux" and torch_has_libgomp:
        assert on_openmp_team


def prefill_batch(new_tokens, contexts, num_heads, num_kv_heads, head_dim, block_size, generator, dtype):
    """Caches, scattered block tables and queries for sequences whose last new_tokens[b] of
    contexts[b] tokens are this step's queries."""
    width = max(contexts) // block_size + 2
    num_blocks = width * len(contexts) + 3
    key_cache, value_cache = block_major(num_blocks, num_kv_heads, block_size, head_dim, generator, dtype)
    tables = torch.randperm(num_blocks, generator=generator)[: width * len(contexts)].view(len(contexts), width).int()
    starts = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn((int(starts[-1]), num_heads, head_dim), generator=generator).to(dtype)
    return query, key_cache, value_cache, tables, starts, torch.tensor(contexts, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (4, 4, 128, 8), (8, 2, 64, 32), (4, 1, 256, 16)])
def test_rust_prefill_matches_the_reference(num_heads, num_kv_heads, head_dim, block_size, dtype):
    """A whole prompt longer than a query tile, a chunk after a cached prefix (prefix caching,
    chunked prefill), one-token and empty chunks, against float64 SDPA over the gathered K/V."""
    generator = torch.Generator().manual_seed(num_heads * 100 + block_size)
    new_tokens, contexts = [70, 37, 1, 0, 5], [70, 150, 9, 4, 5]
    query, key_cache, value_cache, tables, starts, context_lens = prefill_batch(
        new_tokens, contexts, num_heads, num_kv_heads, head_dim, block_size, generator, dtype
    )
    scale = head_dim**-0.5
    got = paged_prefill_attention(query, key_cache, value_cache, tables, starts, context_lens, scale)
    assert got.dtype == dtype
    for b, context in enumerate(contexts):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        want = prefill_one(query[rows].double(), key_cache.double(), value_cache.double(), tables[b], context, scale)
        tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
        assert torch.allclose(got[rows].double(), want, **tolerance), f"sequence {b}"


def test_bad_prefill_inputs_raise_instead_of_reading_out_of_bounds():
    generator = torch.Generator().manual_seed(0)
    key_cache, value_cache = block_major(4, 2, 16, 64, generator)
    query = torch.randn((3, 2, 64))
    starts = torch.tensor([0, 3])
    with pytest.raises(ValueError, match="block 9"):
        paged_prefill_attention(query, key_cache, value_cache, torch.tensor([[0, 9]]), starts, torch.tensor([20]), 1.0)
    with pytest.raises(ValueError, match="new tokens"):
        paged_prefill_attention(query, key_cache, value_cache, torch.tensor([[0, 1]]), starts, torch.tensor([2]), 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(query, key_cache, value_cache, torch.tensor([[0, 1]]), torch.tensor([0, 2]), torch.tensor([5]), 1.0)
    with pytest.raises(ValueError, match="head_dim=32"):
        small_k, small_v = block_major(4, 2, 16, 32, generator)
        paged_prefill_attention(torch.randn((3, 2, 32)), small_k, small_v, torch.tensor([[0, 1]]), starts, torch.tensor([5]), 1.0)


def mixed_step(new_tokens, contexts, seed):
    """A step of prefill chunks then two decodes (the last two sequences): its query, caches and
    metadata, through `prefill_batch`."""
    generator = torch.Generator().manual_seed(seed)
    query, key_cache, value_cache, tables, starts, context_lens = prefill_batch(
        new_tokens, contexts, 9, 3, 64, 16, generator, torch.float32
    )
    metadata = AttentionMetadata(
        query_start_loc=starts, context_lens=context_lens, block_tables=tables,
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64), max_query_len=max(new_tokens),
        max_context_len=max(contexts), num_decode_tokens=2, query_start_loc_host=starts.tolist(),
        context_lens_host=contexts,
    )
    return query, key_cache, value_cache, tables, starts, metadata


def test_cpu_backend_mixed_step_equals_the_torch_reference():
    """Prefill chunks and decodes in one step, through the backends' interface."""
    query, key_cache, value_cache, _, _, metadata = mixed_step([40, 20, 1, 1], [40, 90, 33, 7], seed=3)
    got = CpuAttentionBackend().forward(query, key_cache, value_cache, metadata, 0.125)
    want = TorchRefBackend().forward(query, key_cache, value_cache, metadata, 0.125)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def dense_windowed_attention(query, key_cache, value_cache, tables, starts, contexts, scale, window,
                             logit_softcap=None, sinks=None):
    """float64, token by token: each new token over the last `window` positions up to its own,
    logits soft-capped where `logit_softcap` is given, a zero-valued key of logit sinks[h] in
    head h's softmax where `sinks` are."""
    from pagedkv.attention.torch_ref import gather_context

    out = torch.empty_like(query, dtype=torch.float64)
    group = query.shape[1] // key_cache.shape[1]
    for b, context in enumerate(contexts):
        keys = gather_context(key_cache, tables[b], context).double().repeat_interleave(group, 0)
        values = gather_context(value_cache, tables[b], context).double().repeat_interleave(group, 0)
        begin, end = int(starts[b]), int(starts[b + 1])
        for row in range(begin, end):
            position = context - (end - row)
            first = max(0, position + 1 - window)
            scores = torch.einsum("hd,hkd->hk", query[row].double(), keys[:, first : position + 1]) * scale
            if logit_softcap is not None:
                scores = logit_softcap * torch.tanh(scores / logit_softcap)
            if sinks is not None:
                scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
            weights = scores.softmax(-1)[:, : position + 1 - first]
            out[row] = torch.einsum("hk,hkd->hd", weights, values[:, first : position + 1])
    return out


@pytest.mark.parametrize("backend", [TorchRefBackend, CpuAttentionBackend])
@pytest.mark.parametrize("window", [1, 13, 40, 500])
def test_sliding_window_attention_matches_a_dense_computation(backend, window):
    """Prefill chunks (a whole prompt, a chunk after a prefix) and decodes in one step, each token
    over the last `window` positions only (Mistral's and Gemma's local layers)."""
    contexts = [70, 90, 33, 120]
    query, key_cache, value_cache, tables, starts, metadata = mixed_step([70, 20, 1, 1], contexts, seed=window)
    got = backend().forward(query, key_cache, value_cache, metadata, 0.125, sliding_window=window)
    want = dense_windowed_attention(query, key_cache, value_cache, tables, starts, contexts, 0.125, window)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-4)
    if window < 70:  # a window shorter than the contexts changes the result
        full = backend().forward(query, key_cache, value_cache, metadata, 0.125)
        assert not torch.allclose(full, got, atol=1e-3)


@pytest.mark.parametrize("backend", [TorchRefBackend, CpuAttentionBackend])
@pytest.mark.parametrize("window", [None, 13])
def test_soft_capped_attention_matches_a_dense_computation(backend, window):
    """Gemma 2's soft cap, cap * tanh(logit / cap), in prefill chunks and decodes, with and
    without a window."""
    contexts = [70, 90, 33, 120]
    query, key_cache, value_cache, tables, starts, metadata = mixed_step([70, 20, 1, 1], contexts, seed=3)
    query = query * 8  # logits of several units, where a cap of 2 bends them
    got = backend().forward(query, key_cache, value_cache, metadata, 0.125, sliding_window=window, logit_softcap=2.0)
    want = dense_windowed_attention(query, key_cache, value_cache, tables, starts, contexts, 0.125, window or 10**6,
                                    logit_softcap=2.0)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-4)
    uncapped = backend().forward(query, key_cache, value_cache, metadata, 0.125, sliding_window=window)
    assert not torch.allclose(uncapped, got, atol=1e-2)


@pytest.mark.parametrize("backend", [TorchRefBackend, CpuAttentionBackend])
@pytest.mark.parametrize("window", [None, 13])
def test_attention_sinks_match_a_dense_computation(backend, window):
    """GPT-OSS's attention sinks, one logit per query head that joins its softmax as a key of
    zero value, in prefill chunks and decodes, with and without a window."""
    contexts = [70, 90, 33, 120]
    query, key_cache, value_cache, tables, starts, metadata = mixed_step([70, 20, 1, 1], contexts, seed=4)
    sinks = torch.linspace(-2.0, 3.0, query.shape[1])
    got = backend().forward(query, key_cache, value_cache, metadata, 0.125, sliding_window=window, sinks=sinks)
    want = dense_windowed_attention(query, key_cache, value_cache, tables, starts, contexts, 0.125, window or 10**6,
                                    sinks=sinks)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-4)
    without = backend().forward(query, key_cache, value_cache, metadata, 0.125, sliding_window=window)
    assert not torch.allclose(without, got, atol=1e-2)


@pytest.mark.parametrize("key_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.bfloat16, torch.float8_e4m3fn)])
def test_cpu_write_kv_writes_what_the_reference_writes(key_dtype, cache_dtype):
    """The Rust scatter (same element type) and the reference's conversion path (float8) alike."""
    generator = torch.Generator().manual_seed(0)
    num_blocks, heads, block_size, head = 6, 3, 16, 64
    ours = [torch.zeros(num_blocks, heads, block_size, head, dtype=cache_dtype) for _ in range(2)]
    reference = [cache.clone() for cache in ours]
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:21].to(torch.int64)
    key, value = (torch.randn(21, heads, head, generator=generator).to(key_dtype) for _ in range(2))
    CpuAttentionBackend().write_kv(*ours, key, value, slots)
    torch_ref_write_kv(*reference, key, value, slots)
    for mine, theirs in zip(ours, reference):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    assert ours[0].view(torch.uint8).any()


def test_cpu_write_kv_skips_padding_slots_and_refuses_slots_past_the_cache():
    key_cache, value_cache = torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8)
    rows = torch.ones(2, 1, 8)
    backend = CpuAttentionBackend()
    backend.write_kv(key_cache, value_cache, rows, rows, torch.tensor([-1, 5]))
    assert key_cache[1, 0, 1].eq(1).all() and key_cache.sum() == 8 and value_cache.sum() == 8
    with pytest.raises(Exception, match="slot 8 is past the cache's 8 slots"):
        backend.write_kv(key_cache, value_cache, rows * 2, rows * 2, torch.tensor([0, 8]))
    assert key_cache.sum() == 8  # (nothing written)


def test_cpu_write_kv_takes_the_engines_strided_views():
    """A layer's view of the block-major cache and keys/values sliced out of the qkv projection:
    the Rust path writes what the reference writes, and the other layers stay untouched."""
    from pagedkv.runner.kv_cache import KVCache

    generator = torch.Generator().manual_seed(1)
    ours, reference = (KVCache(3, 2, 32, 16, 5, 0, torch.float32, "cpu") for _ in range(2))
    qkv = torch.randn(7, (4 + 2 * 2) * 32, generator=generator)
    key = qkv[:, 4 * 32 : 6 * 32].view(7, 2, 32)
    value = qkv[:, 6 * 32 :].view(7, 2, 32)
    assert not key.is_contiguous() and not ours.layer(1)[0].is_contiguous()
    slots = torch.tensor([3, 17, 18, 40, 79, 0, 64])
    CpuAttentionBackend().write_kv(*ours.layer(1), key, value, slots)
    torch_ref_write_kv(*reference.layer(1), key, value, slots)
    assert torch.equal(ours.device_cache, reference.device_cache)
    assert ours.layer(1)[0].any() and not ours.layer(0)[0].any() and not ours.layer(2)[1].any()

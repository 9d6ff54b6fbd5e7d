"""The reference paged attention against a float64 dense causal attention on random data."""

import zlib

import pytest
import torch

from pagedkv.attention import AttentionMetadata, TorchRefBackend, get_backend
from pagedkv.attention.torch_ref import paged_attention_ref, write_kv


def dense_attention(query, keys, values, scale):
    """float64 causal attention of one sequence: query [q, Hq, D] are the last q positions of
    keys/values [ctx, Hkv, D]."""
    num_queries, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    query, keys, values = query.double(), keys.double(), values.double()
    out = torch.empty_like(query)
    for i in range(num_queries):
        position = context_len - num_queries + i
        for h in range(num_heads):
            k = keys[: position + 1, h // group]
            v = values[: position + 1, h // group]
            weights = torch.softmax((k @ query[i, h]) * scale, dim=0)
            out[i, h] = weights @ v
    return out


def build_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, generator):
    """seqs: list of (context_len, num_new_tokens), prefills first. Writes the cached prefix with
    write_kv, then the new tokens as a real step does; returns everything the test needs."""
    key_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=generator)  # garbage
    value_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=generator)
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    tables, full_keys, full_values, queries, slots, starts = [], [], [], [], [], [0]
    for context_len, num_new in seqs:
        table = [free_blocks.pop() for _ in range(-(-context_len // block_size))]
        keys = torch.randn(context_len, num_kv_heads, head_dim, generator=generator)
        values = torch.randn(context_len, num_kv_heads, head_dim, generator=generator)
        all_slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(context_len)])
        cached = context_len - num_new
        write_kv(key_cache, value_cache, keys[:cached], values[:cached], all_slots[:cached])
        tables.append(table)
        full_keys.append(keys)
        full_values.append(values)
        queries.append(torch.randn(num_new, num_heads, head_dim, generator=generator))
        slots.append(all_slots[cached:])
        starts.append(starts[-1] + num_new)
    width = max(len(t) for t in tables)
    context_lens = [c for c, _ in seqs]
    num_decodes = 0
    for _, num_new in reversed(seqs):
        if num_new != 1:
            break
        num_decodes += 1
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.cat(slots).long(),
        max_query_len=max(n for _, n in seqs),
        max_context_len=max(context_lens),
        num_decode_tokens=num_decodes,
        query_start_loc_host=starts,
        context_lens_host=context_lens,
    )
    new_keys = torch.cat([k[c - n :] for k, (c, n) in zip(full_keys, seqs)])
    new_values = torch.cat([v[c - n :] for v, (c, n) in zip(full_values, seqs)])
    return key_cache, value_cache, torch.cat(queries), new_keys, new_values, metadata, full_keys, full_values


CASES = {
    "decodes_only": [(1, 1), (17, 1), (16, 1), (33, 1), (5, 1)],
    "prefills_only": [(1, 1), (20, 20), (48, 48)],
    "mixed_with_cached_prefix": [(37, 37), (40, 9), (70, 1), (1, 1), (15, 1), (64, 1)],
    "chunk_inside_one_block": [(35, 2), (18, 1)],
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", [(4, 4, 16), (6, 2, 32), (8, 1, 8)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_matches_dense_float64(case, heads, block_size):
    num_heads, num_kv_heads, head_dim = heads
    seqs = CASES[case]
    generator = torch.Generator().manual_seed(zlib.crc32(repr((case, heads, block_size)).encode()))
    key_cache, value_cache, query, keys, values, metadata, full_keys, full_values = build_batch(
        seqs, num_heads, num_kv_heads, head_dim, block_size, 64, generator
    )
    backend = TorchRefBackend()
    backend.write_kv(key_cache, value_cache, keys, values, metadata.slot_mapping)
    scale = head_dim**-0.5
    out = backend.forward(query, key_cache, value_cache, metadata, scale)
    assert out.shape == query.shape and out.dtype == query.dtype
    starts = metadata.query_start_loc_host
    for b, (context_len, num_new) in enumerate(seqs):
        expected = dense_attention(query[starts[b] : starts[b + 1]], full_keys[b], full_values[b], scale)
        torch.testing.assert_close(out[starts[b] : starts[b + 1]].double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_ignores_blocks_past_the_context():
    """Stale (finite) data in the padded block-table entries and past context_len must not leak
    in; the cache is zero-initialized and only ever holds K/V the model wrote, so it is finite."""
    generator = torch.Generator().manual_seed(0)
    key_cache, value_cache, query, keys, values, metadata, _, _ = build_batch(
        [(3, 1), (40, 1)], 4, 2, 16, 16, 8, generator
    )
    write_kv(key_cache, value_cache, keys, values, metadata.slot_mapping)
    before = paged_attention_ref(query, key_cache, value_cache, metadata, 0.25)
    first_block = metadata.block_tables[0, 0].item()
    key_cache[first_block, :, 3:] = 1e4  # past seq 0's 3 tokens
    used = set(metadata.block_tables[1, :3].tolist()) | {first_block}
    for block in set(range(8)) - used:
        key_cache[block] = 1e4
        value_cache[block] = -1e4
    after = paged_attention_ref(query, key_cache, value_cache, metadata, 0.25)
    torch.testing.assert_close(after, before)


def test_write_kv_puts_each_token_in_its_slot():
    key_cache = torch.zeros(4, 2, 8, 3)
    value_cache = torch.zeros(4, 2, 8, 3)
    key = torch.randn(3, 2, 3)
    value = torch.randn(3, 2, 3)
    write_kv(key_cache, value_cache, key, value, torch.tensor([2 * 8 + 5, 0, 3 * 8 + 7]))
    torch.testing.assert_close(key_cache[2, :, 5], key[0])
    torch.testing.assert_close(key_cache[0, :, 0], key[1])
    torch.testing.assert_close(value_cache[3, :, 7], value[2])
    assert key_cache.count_nonzero() == key.count_nonzero()


def test_copy_blocks_copies_every_layer():
    kv_cache = torch.randn(6, 3, 2, 2, 4, 5)
    original = kv_cache.clone()
    TorchRefBackend().copy_blocks(kv_cache, torch.tensor([[1, 4], [2, 0]]))
    assert torch.equal(kv_cache[4], original[1]) and torch.equal(kv_cache[0], original[2])
    assert torch.equal(kv_cache[[1, 2, 3, 5]], original[[1, 2, 3, 5]])


def test_get_backend():
    assert get_backend("torch", "cpu").name == "torch"
    assert get_backend("auto", "cpu").name == "cpu"  # the reference with Rust decode attention
    with pytest.raises(ValueError, match="'cpu' runs on the CPU"):
        get_backend("cpu", "cuda")
    with pytest.raises(ValueError, match="attention_backend"):
        get_backend("flash", "cpu")


def test_cuda_backend_without_the_head_dim_is_refused_up_front():
    """Phi-2's 80, Phi-3's 96 or DeepSeek-V2's latent 576: the CUDA kernels have none of them;
    "auto" then takes the torch reference, an explicit "cuda" fails at start-up, naming it."""
    from pagedkv.kernels import UnsupportedKernelError

    with pytest.raises(UnsupportedKernelError, match="head_dim=96"):
        get_backend("cuda", "cuda", head_dim=96)
    assert get_backend("auto", "cuda", head_dim=576).name == "torch"

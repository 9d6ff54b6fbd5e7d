"""KVCache copies on the CPU: swap round trips and copy-on-write move whole blocks of every
layer, and consecutive pairs become single copies."""

import torch

from pagedkv.runner.kv_cache import KVCache, block_runs


def test_block_runs_merge_only_pairs_advancing_together():
    pairs = [(3, 0), (4, 1), (5, 2), (9, 3), (10, 7), (11, 8), (11, 9)]
    assert block_runs(pairs) == [(3, 0, 3), (9, 3, 1), (10, 7, 2), (11, 9, 1)]
    expanded = [(src + i, dst + i) for src, dst, count in block_runs(pairs) for i in range(count)]
    assert expanded == pairs
    assert block_runs([]) == []


def test_swap_round_trip_and_copy_on_write_on_cpu():
    cache = KVCache(3, 2, 64, 16, num_device_blocks=10, num_cpu_blocks=6, dtype=torch.float32, device="cpu")
    cache.device_cache.copy_(torch.randn_like(cache.device_cache))
    original = cache.device_cache.clone()
    cache.swap_out([(1, 0), (2, 1), (7, 5)])
    cache.device_cache[[1, 2, 7]] = float("nan")
    cache.swap_in([(0, 4), (1, 5), (5, 6)])
    for source, target in ((1, 4), (2, 5), (7, 6)):
        assert torch.equal(cache.device_cache[target], original[source])
    cache.copy_blocks([(4, 9)])
    assert torch.equal(cache.device_cache[9], original[1])

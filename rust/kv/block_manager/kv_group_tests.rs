//! KV-cache groups: full and windowed tables of each sequence over one pool.

use super::*;

const BLOCK_SIZE: usize = 4;

fn hybrid(num_device_blocks: usize, num_cpu_blocks: usize, windows: &[usize]) -> BlockManager {
    let mut bm = BlockManager::new(num_device_blocks, num_cpu_blocks, BLOCK_SIZE, true, 0.0).unwrap();
    bm.set_kv_groups(windows).unwrap();
    bm
}

fn tokens(n: u32, base: u32) -> Vec<u32> {
    (base..base + n).collect()
}

fn live(bm: &BlockManager, seq: SeqId) -> Vec<usize> {
    bm.seq_tables(seq).unwrap().iter().map(|table| table.live_blocks().len()).collect()
}

#[test]
fn a_full_group_holds_the_length_and_a_windowed_group_its_window() {
    let window = 8;
    let mut bm = hybrid(64, 32, &[0, window]);
    let mut length: usize = 5;
    bm.allocate(1, &tokens(5, 100), None).unwrap();
    while length < 61 {
        let (free, needed) = (bm.num_free_device_blocks(), bm.blocks_needed_to_append(1, 1).unwrap());
        bm.append_token(1, 7).unwrap();
        length += 1;
        assert!(free.saturating_sub(bm.num_free_device_blocks()) <= needed, "the count covers the append");
        let [full, windowed] = live(&bm, 1)[..] else { unreachable!() };
        assert_eq!(full, length.div_ceil(BLOCK_SIZE), "the full group keeps every block");
        assert!(windowed <= window.div_ceil(BLOCK_SIZE) + 1, "{windowed} windowed blocks at length {length}");
        bm.check_invariants().unwrap();
    }
    // A fork shares both groups' blocks; a swap moves both out and back.
    bm.fork(1, 2).unwrap();
    assert_eq!(live(&bm, 2), live(&bm, 1));
    let unique = bm.num_unique_blocks(&[1, 2]).unwrap();
    assert_eq!(unique, live(&bm, 1).iter().sum::<usize>());
    assert_eq!(bm.swap_out(&[1, 2]).unwrap().len(), unique);
    assert_eq!(bm.num_free_device_blocks(), 64);
    bm.check_invariants().unwrap();
    let needed = bm.blocks_needed_to_swap_in(&[1, 2]).unwrap();
    bm.swap_in(&[1, 2]).unwrap();
    assert_eq!(bm.num_free_device_blocks(), 64 - needed);
    assert_eq!(live(&bm, 2), live(&bm, 1));
    bm.check_invariants().unwrap();
    // The shared partial last block is copied in both groups on the child's write.
    assert_eq!(bm.append_token(2, 9).unwrap().len(), 2);
    bm.check_invariants().unwrap();
    bm.free(1).unwrap();
    bm.free(2).unwrap();
    assert_eq!((bm.num_free_device_blocks(), bm.num_free_cpu_blocks()), (64, 32));
    bm.check_invariants().unwrap();
}

#[test]
fn an_append_that_does_not_fit_every_group_changes_nothing() {
    let mut bm = hybrid(5, 0, &[0, 4]);
    bm.allocate(1, &tokens(8, 100), None).unwrap(); // two blocks in each group
                                                    // A block more in each group, but the window's next step releases block 0 first.
    assert_eq!(bm.blocks_needed_to_append(1, 4).unwrap(), 1);
    let tables = bm.seq_tables(1).unwrap().to_vec();
    assert!(matches!(bm.append_slots(1, &tokens(8, 200)), Err(Error::OutOfBlocks { .. })));
    let after = bm.seq_tables(1).unwrap();
    assert!(tables.iter().zip(after).all(|(a, b)| a.blocks == b.blocks && a.num_tokens == b.num_tokens));
    bm.check_invariants().unwrap();
}

#[test]
fn a_prefix_hits_only_as_far_as_every_group_serves_it() {
    // Windowed group first: freed first, so its blocks are evicted first.
    let (window, num_blocks) = (4, 11);
    let mut bm = hybrid(num_blocks, 0, &[window, 0]);
    let prompt = tokens(13, 100);
    bm.allocate(1, &prompt, None).unwrap();
    bm.free(1).unwrap();
    let hits = bm.peek_prefix_hits(&prompt, None);
    // The first computed position, 12, reads 9..=12 in the windowed group: its block 2 only.
    assert_eq!((hits.blocks(), hits.released, hits.device), (3, 2, 1 + 3));
    assert_eq!(bm.cached_block_hashes(Device::Gpu, 0), bm.cached_block_hashes(Device::Gpu, 1));
    // Another prompt takes the 5 uncached blocks and evicts the windowed group's block 2.
    bm.allocate(2, &tokens(9, 500), None).unwrap();
    assert_eq!(bm.cached_block_hashes(Device::Gpu, 1).len(), 3 + 2, "the full group still holds all 3 (and 2 new)");
    assert_eq!(bm.cached_block_hashes(Device::Gpu, 0).len(), 2 + 2);
    let hits = bm.peek_prefix_hits(&prompt, None);
    // Position 8 reads 5..=8: block 1, still cached in the windowed group; the full group serves 0 and 1.
    assert_eq!((hits.blocks(), hits.released, hits.device), (2, 1, 1 + 2));
    bm.free(2).unwrap();
    assert_eq!(bm.allocate(3, &prompt, None).unwrap(), 8);
    bm.check_invariants().unwrap();
}

#[test]
fn events_name_each_groups_blocks_by_the_same_external_hash() {
    let mut bm = hybrid(16, 0, &[0, 4]);
    bm.enable_kv_events().unwrap();
    bm.allocate(1, &tokens(9, 100), None).unwrap();
    let events = bm.take_kv_events();
    let stored: Vec<(usize, Vec<u64>)> = events
        .iter()
        .map(|event| match event {
            KvEvent::BlockStored { block_hashes, group, .. } => (*group, block_hashes.clone()),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(stored.len(), 2);
    assert_eq!((stored[0].0, stored[1].0), (0, 1));
    assert_eq!(stored[0].1, stored[1].1);
    let mut sorted = stored[0].1.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, bm.cached_block_hashes(Device::Gpu, 1));
}

#[test]
fn groups_are_set_before_any_sequence_and_number_one_to_256() {
    let mut bm = hybrid(8, 0, &[0]);
    assert!(matches!(bm.set_kv_groups(&[]), Err(Error::InvalidConfig { .. })));
    assert!(matches!(bm.set_kv_groups(&[0; 257]), Err(Error::InvalidConfig { .. })));
    bm.allocate(1, &tokens(3, 100), None).unwrap();
    assert!(matches!(bm.set_kv_groups(&[0, 4]), Err(Error::InvalidState(_))));
    assert_eq!(bm.kv_group_windows(), [0]);
}

/// vLLM's `test_prefill_hybrid_model` (tests/v1/core/test_prefix_caching.py) on our API: a full
/// group and two windowed groups of 2 blocks, block size 16, a prompt of 3 full blocks and 7
/// tokens cached, then blocks of some groups evicted, and the hit length every group can serve.
#[test]
fn vllm_hybrid_prefix_hits_after_evicting_some_groups_blocks() {
    const BLOCK: usize = 16;
    let common: Vec<u32> = (0..3).flat_map(|block| [block; BLOCK]).collect();
    let prompt = |tail: u32, len: usize| [&common[..], &vec![tail; len]].concat();
    let cached = || {
        let mut bm = BlockManager::new(21, 0, BLOCK, true, 0.0).unwrap();
        bm.set_kv_groups(&[0, 2 * BLOCK, 2 * BLOCK]).unwrap();
        bm.allocate(0, &prompt(3, 7), None).unwrap();
        assert_eq!(bm.seq_tables(0).unwrap().iter().map(|table| table.blocks.len()).collect::<Vec<_>>(), [4, 4, 4]);
        // The common prefix hits in every group while the first request holds it; the windowed
        // groups' tables skip block 0, which the first computed token (48) does not read.
        assert_eq!(bm.allocate(1, &prompt(3, 5), None).unwrap(), 3 * BLOCK);
        let tables = bm.seq_tables(1).unwrap();
        assert_eq!(tables.iter().map(|table| table.num_released).collect::<Vec<_>>(), [0, 1, 1]);
        for table in tables {
            assert!(table.live_blocks()[..table.live_blocks().len() - 1]
                .iter()
                .all(|&block| bm.refcount(block, Device::Gpu) == 2));
        }
        bm.free(0).unwrap();
        bm.free(1).unwrap();
        bm
    };
    let hashes = BlockHasher::new(0).block_hashes(&common, BLOCK, None);
    let cases: [(&[(usize, usize)], usize); 7] = [
        (&[(0, 1), (0, 2)], 3), // blocks outside the window: the hit stays whole
        (&[(0, 0)], 0),         // the full group's first block: no hit at all
        (&[(2, 0), (2, 1), (2, 2)], 2),
        (&[(2, 0)], 2),
        (&[(2, 1)], 2),
        (&[(2, 2)], 2),
        (&[(2, 0), (0, 1), (0, 2)], 0), // full serves 2 blocks, the windows then need block 0
    ];
    for (evicted, hit_blocks) in cases {
        let mut bm = cached();
        for &(index, group) in evicted {
            let block = bm.cache.lookup(hashes[index].in_group(group)).unwrap();
            forget_name(&mut bm.gpu, &mut bm.cache, &mut bm.events, block);
        }
        assert_eq!(bm.peek_prefix_hits(&prompt(3, 5), None).blocks(), hit_blocks, "evicted {evicted:?}");
        assert_eq!(bm.allocate(2, &prompt(3, 5), None).unwrap(), hit_blocks * BLOCK);
        bm.check_invariants().unwrap();
    }
}

#[test]
fn a_fork_that_would_read_blocks_the_parent_s_window_released_is_refused() {
    let mut bm = hybrid(32, 0, &[0, 4]);
    let prompt = tokens(20, 100);
    bm.allocate(1, &prompt, None).unwrap();
    bm.append_token(1, 7).unwrap(); // position 20 reads 17..=20: the windowed table releases blocks 0..4
    assert_eq!(bm.seq_tables(1).unwrap()[1].num_released, 4);
    assert!(!bm.can_fork_prefix(1, 8).unwrap(), "position 8 reads 5..=8, in released block 1");
    let free = bm.num_free_device_blocks();
    assert!(matches!(bm.fork_prefix(1, 2, &prompt[..8]), Err(Error::InvalidState(_))));
    assert!(!bm.contains(2) && bm.num_free_device_blocks() == free, "a refused fork changes nothing");
    assert!(bm.can_fork_prefix(1, 20).unwrap());
    bm.fork_prefix(1, 3, &prompt).unwrap();
    bm.check_invariants().unwrap();
}

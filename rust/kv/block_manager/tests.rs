//! The block manager's unit tests.

use super::*;

fn manager(device: usize, cpu: usize, caching: bool) -> BlockManager {
    BlockManager::new(device, cpu, 4, caching, 0.0).unwrap()
}

fn tokens(n: u32) -> Vec<u32> {
    (100..100 + n).collect()
}

#[test]
fn allocate_append_and_free() {
    let mut bm = manager(8, 0, false);
    assert_eq!(bm.allocate(1, &tokens(6), None).unwrap(), 0);
    assert_eq!(bm.table(1).unwrap().blocks.len(), 2);
    assert_eq!(bm.num_free_device_blocks(), 6);
    // Slots 6 and 7 fit in the second block; the 9th token needs a third.
    bm.append_token(1, 1).unwrap();
    bm.append_token(1, 2).unwrap();
    assert_eq!(bm.num_free_device_blocks(), 6);
    bm.append_token(1, 3).unwrap();
    assert_eq!(bm.num_free_device_blocks(), 5);
    bm.free(1).unwrap();
    assert_eq!(bm.num_free_device_blocks(), 8);
    bm.check_invariants().unwrap();
}

#[test]
fn out_of_blocks_changes_nothing() {
    let mut bm = manager(2, 0, false);
    let err = bm.allocate(1, &tokens(9), None).unwrap_err();
    assert_eq!(err, Error::OutOfBlocks { device: Device::Gpu, needed: 3, free: 2 });
    assert!(!bm.contains(1));
    bm.allocate(2, &tokens(8), None).unwrap();
    assert!(matches!(bm.append_token(2, 0), Err(Error::OutOfBlocks { .. })));
    assert_eq!(bm.table(2).unwrap().num_tokens, 8);
    bm.check_invariants().unwrap();
}

#[test]
fn fork_shares_blocks_and_copy_on_write_copies_the_partial_block() {
    let mut bm = manager(8, 0, false);
    bm.allocate(1, &tokens(6), None).unwrap();
    bm.fork(1, 2).unwrap();
    let shared = bm.table(1).unwrap().blocks.clone();
    for &block in &shared {
        assert_eq!(bm.refcount(block, Device::Gpu), 2);
    }
    assert_eq!(bm.blocks_needed_to_append(2, 1).unwrap(), 1);
    let copy = bm.append_token(2, 7).unwrap();
    let child_last = *bm.table(2).unwrap().blocks.last().unwrap();
    assert_eq!(copy.as_slice(), [(shared[1], child_last)]);
    assert_eq!(bm.refcount(shared[1], Device::Gpu), 1);
    assert_eq!(bm.refcount(shared[0], Device::Gpu), 2, "the full block stays shared");
    // The parent now owns its last block alone and writes in place.
    assert!(bm.append_token(1, 8).unwrap().is_empty());
    bm.check_invariants().unwrap();
    bm.free(1).unwrap();
    bm.free(2).unwrap();
    assert_eq!(bm.num_free_device_blocks(), 8);
}

#[test]
fn fork_of_a_full_last_block_needs_no_copy() {
    let mut bm = manager(8, 0, false);
    bm.allocate(1, &tokens(8), None).unwrap();
    bm.fork(1, 2).unwrap();
    assert!(bm.append_token(2, 1).unwrap().is_empty());
    assert_eq!(bm.table(2).unwrap().blocks.len(), 3);
    bm.check_invariants().unwrap();
}

#[test]
fn prefix_cache_reuses_full_blocks_and_keeps_the_last_token() {
    let mut bm = manager(8, 0, true);
    assert_eq!(bm.allocate(1, &tokens(10), None).unwrap(), 0);
    // Same first 8 tokens: two full blocks hit.
    assert_eq!(bm.allocate(2, &tokens(9), None).unwrap(), 8);
    assert_eq!(bm.table(1).unwrap().blocks[..2], bm.table(2).unwrap().blocks[..2]);
    // Exactly 8 tokens: only the first block may hit, the last token is computed again.
    assert_eq!(bm.allocate(3, &tokens(8), None).unwrap(), 4);
    // Another extra key names other blocks.
    assert_eq!(bm.allocate(4, &tokens(9), Some(1)).unwrap(), 0);
    assert_eq!(bm.prefix_cache().hits, 3);
    bm.check_invariants().unwrap();
}

#[test]
fn freed_cached_blocks_are_reused_then_evicted_in_lru_order() {
    let mut bm = manager(4, 0, true);
    bm.allocate(1, &tokens(9), None).unwrap(); // 3 blocks, 2 full and hashed
    bm.free(1).unwrap();
    assert_eq!(bm.num_free_device_blocks(), 4);
    assert_eq!(bm.num_cached_device_blocks(), 2);
    assert_eq!(bm.allocate(2, &tokens(9), None).unwrap(), 8);
    bm.free(2).unwrap();
    // A different prompt needing all 4 blocks evicts both cached blocks.
    let other: Vec<u32> = (0..16).collect();
    bm.allocate(3, &other, None).unwrap();
    assert_eq!(bm.num_cached_device_blocks(), 0);
    bm.free(3).unwrap();
    assert_eq!(bm.allocate(4, &tokens(9), None).unwrap(), 0, "evicted blocks no longer hit");
    bm.check_invariants().unwrap();
}

#[test]
fn cpu_tier_keeps_evicted_prefix_blocks_and_yields_to_swapped_sequences() {
    let mut bm = manager(4, 4, true);
    bm.enable_cpu_prefix_cache().unwrap();
    bm.allocate(1, &tokens(9), None).unwrap(); // blocks 0 and 1 full and hashed, 2 partial
    bm.free(1).unwrap();
    let other: Vec<u32> = (0..16).collect();
    bm.allocate(2, &other, None).unwrap(); // takes the free blocks, then evicts 1 and 0 (tail first)
    let (offloads, reloads) = bm.take_cpu_tier_copies();
    assert_eq!(offloads.iter().map(|copy| copy.0).collect::<Vec<_>>(), [1, 0]);
    assert!(reloads.is_empty());
    assert_eq!(bm.num_free_cpu_blocks(), 2, "offload targets are pinned for the step");
    bm.check_invariants().unwrap();
    bm.begin_step();
    assert_eq!((bm.num_cached_cpu_blocks(), bm.num_free_cpu_blocks()), (2, 4));
    bm.free(2).unwrap();
    // The same prompt again: both blocks come back from the CPU, into fresh device blocks.
    assert_eq!(bm.allocate(3, &tokens(9), None).unwrap(), 8);
    let (_, reloads) = bm.take_cpu_tier_copies();
    let table = bm.table(3).unwrap().blocks.clone();
    assert_eq!(reloads, vec![(offloads[1].1, table[0]), (offloads[0].1, table[1])]);
    assert_eq!(bm.cpu_tier().num_reloaded, 2);
    bm.check_invariants().unwrap();
    // A swap-out may not take blocks this step's copies still use; next step it evicts the tier.
    assert!(matches!(bm.swap_out(&[3]), Err(Error::OutOfBlocks { device: Device::Cpu, .. })));
    bm.begin_step();
    bm.swap_out(&[3]).unwrap();
    assert!(bm.num_cached_cpu_blocks() < 2);
    bm.check_invariants().unwrap();
    assert!(matches!(manager(4, 4, false).enable_cpu_prefix_cache(), Err(Error::InvalidConfig { .. })));
}

#[test]
fn reset_prefix_cache_forgets_both_tiers_only_when_no_sequence_holds_blocks() {
    let mut bm = manager(4, 4, true);
    bm.enable_cpu_prefix_cache().unwrap();
    bm.allocate(1, &tokens(9), None).unwrap();
    bm.free(1).unwrap();
    bm.allocate(2, &(0..16).collect::<Vec<u32>>(), None).unwrap(); // evicts 0 and 1 to the CPU tier
    bm.free(2).unwrap();
    bm.begin_step();
    assert!(bm.num_cached_cpu_blocks() > 0 && bm.num_cached_device_blocks() > 0);
    bm.allocate(3, &[7, 7], None).unwrap();
    assert!(!bm.reset_prefix_cache(), "sequence 3 still holds blocks");
    assert!(bm.num_cached_cpu_blocks() > 0 && bm.num_cached_device_blocks() > 0, "nothing changed");
    bm.free(3).unwrap();
    assert!(bm.reset_prefix_cache());
    assert_eq!((bm.num_cached_device_blocks(), bm.num_cached_cpu_blocks()), (0, 0));
    assert_eq!((bm.num_free_device_blocks(), bm.num_free_cpu_blocks()), (4, 4));
    assert_eq!(bm.peek_prefix_hits(&tokens(9), None).blocks(), 0);
    bm.check_invariants().unwrap();
    // Caching goes on afterwards.
    bm.allocate(4, &tokens(9), None).unwrap();
    bm.free(4).unwrap();
    assert_eq!(bm.peek_prefix_hits(&tokens(9), None).device, 2);
    bm.check_invariants().unwrap();
}

#[test]
fn truncate_drops_rejected_tokens_and_the_names_of_blocks_left_partial() {
    let mut bm = manager(8, 0, true);
    bm.allocate(1, &tokens(10), None).unwrap(); // 4 + 4 (both named) + 2 tokens
    bm.truncate(1, &tokens(6)).unwrap();
    assert_eq!((bm.table(1).unwrap().blocks.len(), bm.table(1).unwrap().hashes.len()), (2, 1));
    assert_eq!(bm.num_free_device_blocks(), 6);
    assert_eq!(bm.peek_prefix_hits(&tokens(9), None).device, 1, "the partial block answers no more");
    bm.check_invariants().unwrap();
    let mut kept = tokens(6);
    kept.extend([7, 7]);
    assert!(bm.append_slots(1, &[7, 7]).unwrap().is_empty(), "written in place");
    assert_eq!(bm.peek_prefix_hits(&[&kept[..], &[1]].concat(), None).device, 2, "named by its new content");
    // A block the truncation leaves partial but another sequence shares keeps its name, and
    // the next append copies it.
    bm.fork(1, 2).unwrap();
    bm.truncate(1, &kept[..6]).unwrap();
    assert_eq!(bm.append_slots(1, &[9]).unwrap().len(), 1);
    assert_eq!(bm.peek_prefix_hits(&[&kept[..], &[1]].concat(), None).device, 2);
    bm.check_invariants().unwrap();
    assert!(matches!(bm.truncate(1, &tokens(12)), Err(Error::InvalidState(_))));
}

#[test]
fn swap_round_trip_keeps_sharing_and_reports_copies() {
    let mut bm = manager(8, 8, false);
    bm.allocate(1, &tokens(6), None).unwrap();
    bm.fork(1, 2).unwrap();
    bm.append_token(2, 1).unwrap(); // child has its own last block
    let out = bm.swap_out(&[1, 2]).unwrap();
    assert_eq!(out.len(), 3, "2 shared + 1 private, the shared first block once");
    assert_eq!(bm.num_free_device_blocks(), 8);
    assert_eq!(bm.num_free_cpu_blocks(), 5);
    let first_cpu = bm.table(1).unwrap().blocks[0];
    assert_eq!(bm.refcount(first_cpu, Device::Cpu), 2);
    assert!(matches!(bm.append_token(1, 0), Err(Error::InvalidState(_))));
    bm.check_invariants().unwrap();
    let back = bm.swap_in(&[1, 2]).unwrap();
    assert_eq!(back.len(), 3);
    assert_eq!(bm.num_free_cpu_blocks(), 8);
    assert_eq!(bm.num_free_device_blocks(), 5);
    let first = bm.table(1).unwrap().blocks[0];
    assert_eq!(bm.table(2).unwrap().blocks[0], first);
    assert_eq!(bm.refcount(first, Device::Gpu), 2);
    // Each copy's source is where the block was, its destination where it is now.
    for (cpu, device) in &back {
        assert!(out.iter().any(|(_, c)| c == cpu));
        assert!(bm.tables().any(|(_, t)| t.blocks.contains(device)));
    }
    bm.check_invariants().unwrap();
}

#[test]
fn swap_in_takes_still_cached_blocks_without_copy() {
    let mut bm = manager(8, 8, true);
    bm.allocate(1, &tokens(9), None).unwrap();
    bm.swap_out(&[1]).unwrap();
    assert_eq!(bm.num_cached_device_blocks(), 2, "swapped-out full blocks stay cached on the device");
    let back = bm.swap_in(&[1]).unwrap();
    assert_eq!(back.len(), 1, "only the partial block is copied back");
    bm.check_invariants().unwrap();
}

#[test]
fn swap_out_fails_cleanly_without_cpu_room() {
    let mut bm = manager(8, 1, false);
    bm.allocate(1, &tokens(8), None).unwrap();
    assert!(matches!(bm.swap_out(&[1]), Err(Error::OutOfBlocks { device: Device::Cpu, .. })));
    assert_eq!(bm.table(1).unwrap().device, Device::Gpu);
    bm.check_invariants().unwrap();
}

#[test]
fn watermark_limits_admission() {
    let bm = BlockManager::new(10, 0, 4, false, 0.2).unwrap();
    assert_eq!(bm.watermark_blocks(), 2);
    assert!(bm.can_admit(8));
    assert!(!bm.can_admit(9));
}

#[test]
fn invalid_config_is_an_error() {
    assert!(matches!(
        BlockManager::new(0, 0, 4, false, 0.0),
        Err(Error::InvalidConfig { field: "num_device_blocks", .. })
    ));
    assert!(matches!(BlockManager::new(1, 0, 4, false, 1.0), Err(Error::InvalidConfig { field: "watermark", .. })));
    for block_size in [0, 3, 24] {
        let error = BlockManager::new(1, 0, block_size, false, 0.0).unwrap_err();
        assert!(error.to_string().contains(&format!("power of two (8, 16, 32, ...), got {block_size}")), "{error}");
    }
}

fn windowed(device: usize, cpu: usize, caching: bool, window: usize) -> BlockManager {
    let mut bm = manager(device, cpu, caching);
    bm.set_sliding_window(window);
    bm
}

fn live(bm: &BlockManager, seq: SeqId) -> Vec<BlockId> {
    bm.table(seq).unwrap().live_blocks().to_vec()
}

#[test]
fn a_sliding_window_releases_blocks_that_slid_out_of_it() {
    // Window 6, blocks of 4: computing position p reads p-5..=p.
    let mut bm = windowed(8, 0, false, 6);
    bm.allocate(1, &tokens(8), None).unwrap();
    assert_eq!(bm.num_free_device_blocks(), 6, "a prompt's blocks are all taken while it is computed");
    let first = bm.table(1).unwrap().blocks[0];
    // Position 8 reads 3..=8: block 0 (positions 0..=3) is still needed.
    bm.append_token(1, 0).unwrap();
    assert_eq!(bm.table(1).unwrap().num_released, 0);
    // Position 9 reads 4..=9: block 0 goes.
    bm.append_token(1, 0).unwrap();
    assert_eq!(bm.table(1).unwrap().num_released, 1);
    assert_eq!(bm.refcount(first, Device::Gpu), 0);
    assert_eq!(bm.table(1).unwrap().blocks.len(), 3, "logical positions keep their index");
    for _ in 0..100 {
        bm.append_token(1, 0).unwrap();
        assert!(live(&bm, 1).len() <= 3, "window 6 + the new token span at most 3 blocks of 4");
        bm.check_invariants().unwrap();
    }
    assert_eq!(bm.table(1).unwrap().num_tokens, 110, "110 tokens in a pool of 32 slots");
    bm.free(1).unwrap();
    assert_eq!(bm.num_free_device_blocks(), 8);
}

#[test]
fn released_full_blocks_stay_cached_but_a_new_sequence_takes_only_hits_in_its_window() {
    let mut bm = windowed(16, 0, true, 6);
    bm.allocate(1, &tokens(16), None).unwrap();
    bm.append_slots(1, &[0]).unwrap(); // position 16 reads 11..=16: blocks 0 and 1 go
    assert_eq!(bm.table(1).unwrap().num_released, 2);
    let released = bm.table(1).unwrap().blocks[..2].to_vec();
    assert!(released.iter().all(|&block| bm.refcount(block, Device::Gpu) == 0));
    assert_eq!(bm.num_cached_device_blocks(), 2, "released full blocks stay in the prefix cache");
    // Same 16-token prompt: blocks 0..3 hit (never the last token); its first computed position
    // is 12, which reads 7..=12, so hit block 0 is not taken and hit block 1 is revived.
    let hits = bm.peek_prefix_hits(&tokens(16), None);
    assert_eq!(hits, PrefixHits { length: 3, released: 1, device: 2, revived: 1, cpu: 0, num_groups: 1 });
    let free_before = bm.num_free_device_blocks();
    assert_eq!(bm.blocks_needed_to_allocate(&tokens(16), None), 2);
    assert_eq!(bm.allocate(2, &tokens(16), None).unwrap(), 12);
    assert_eq!(bm.num_free_device_blocks(), free_before - 2, "revived block 1 and a fresh block 3");
    let table = bm.table(2).unwrap();
    assert_eq!((table.num_released, table.blocks[1]), (1, released[1]));
    assert_eq!(bm.refcount(released[0], Device::Gpu), 0);
    assert_eq!(bm.refcount(released[1], Device::Gpu), 1);
    bm.check_invariants().unwrap();
}

#[test]
fn swap_fork_truncate_and_free_skip_released_blocks() {
    let mut bm = windowed(8, 8, true, 5);
    bm.allocate(1, &tokens(12), None).unwrap();
    bm.append_slots(1, &[1, 2]).unwrap(); // position 12 reads 8..=12: blocks 0 and 1 go
    assert_eq!(bm.table(1).unwrap().num_released, 2);
    bm.fork(1, 2).unwrap();
    bm.check_invariants().unwrap();
    let copies = bm.swap_out(&[1, 2]).unwrap();
    assert_eq!(copies.len(), 2, "only the live blocks move, shared ones once");
    bm.check_invariants().unwrap();
    assert!(matches!(bm.blocks_needed_to_append(1, 4), Err(Error::InvalidState(_))), "a swapped table cannot grow");
    assert_eq!(bm.blocks_needed_to_swap_in(&[1, 2]).unwrap(), 2);
    bm.swap_in(&[1, 2]).unwrap();
    bm.check_invariants().unwrap();
    bm.truncate(2, &tokens(13)).unwrap();
    assert_eq!(bm.table(2).unwrap().num_released, 2);
    bm.check_invariants().unwrap();
    bm.free(1).unwrap();
    bm.free(2).unwrap();
    assert_eq!((bm.num_free_device_blocks(), bm.num_free_cpu_blocks()), (8, 8));
}

#[test]
fn under_a_window_a_prompt_hits_the_cache_without_its_evicted_first_blocks() {
    // Pool of 6 blocks of 4, window 6: a 24-token prompt whose first blocks were evicted still
    // hits, since its first computed token (position 20) reads only positions 15..=20.
    let mut bm = windowed(6, 0, true, 6);
    let prompt = tokens(24);
    bm.allocate(1, &prompt[..8], None).unwrap();
    for &token in &prompt[8..] {
        bm.append_token(1, token).unwrap();
    }
    bm.free(1).unwrap();
    // Another prompt evicts the two least recently freed cached blocks: blocks 0 and 1.
    bm.allocate(2, &tokens(100)[92..], None).unwrap();
    bm.free(2).unwrap();
    let hits = bm.peek_prefix_hits(&prompt, None);
    assert_eq!(hits, PrefixHits { length: 5, released: 3, device: 2, revived: 2, cpu: 0, num_groups: 1 });
    assert_eq!(bm.allocate(3, &prompt, None).unwrap(), 20);
    assert_eq!(bm.table(3).unwrap().live_blocks().len(), 3, "hit blocks 3 and 4, and block 5 for the last token");
    bm.check_invariants().unwrap();
    // Without a window the same cache yields nothing: block 0 is gone.
    bm.free(3).unwrap();
    bm.set_sliding_window(0);
    assert_eq!(bm.peek_prefix_hits(&prompt, None).blocks(), 0);
}

#[test]
fn block_names_chain_from_the_hash_seed_which_is_set_before_anything_is_cached() {
    let names = |seed: u64| {
        let mut bm = manager(8, 0, true);
        bm.set_hash_seed(seed).unwrap();
        bm.allocate(1, &tokens(9), None).unwrap();
        let names = bm.table(1).unwrap().hashes.clone();
        assert_eq!(
            bm.set_hash_seed(seed + 1),
            Err(Error::InvalidState("the prefix cache's hash seed can only be set before any block is cached".into()))
        );
        bm.free(1).unwrap();
        assert!(bm.set_hash_seed(seed + 1).is_err(), "freed blocks stay cached under their names");
        assert_eq!(bm.allocate(2, &tokens(9), None).unwrap(), 8, "the seed did not change");
        names
    };
    assert_eq!(names(7), names(7));
    let (a, b) = (names(7), names(8));
    assert!(a.iter().zip(&b).all(|(x, y)| x != y), "every name depends on the seed: {a:?} {b:?}");
}

#[test]
fn a_freed_prefix_is_evicted_from_its_tail_so_its_head_keeps_hitting() {
    let mut bm = manager(4, 0, true);
    bm.allocate(1, &tokens(13), None).unwrap(); // blocks: 3 full, 1 partial
    bm.free(1).unwrap();
    assert_eq!(bm.num_cached_device_blocks(), 3);
    // 5 other tokens take the uncached partial block and evict one cached block: the last.
    bm.allocate(2, &[7, 7, 7, 7, 7], None).unwrap();
    assert_eq!(bm.num_cached_device_blocks(), 2);
    assert_eq!(bm.peek_prefix_hits(&tokens(13), None).device, 2, "blocks 0 and 1 still hit");
    bm.check_invariants().unwrap();
}

/// Applies `events` to a consumer's view (GPU, CPU) and checks it equals the cache.
fn replay(bm: &mut BlockManager, view: &mut [std::collections::BTreeSet<u64>; 2]) {
    for event in bm.take_kv_events() {
        match event {
            KvEvent::BlockStored { block_hashes, medium, token_ids, block_size, .. } => {
                assert_eq!(token_ids.len(), block_hashes.len() * block_size);
                for hash in block_hashes {
                    assert!(view[(medium == Device::Cpu) as usize].insert(hash), "stored twice: {hash:x}");
                }
            }
            KvEvent::BlockRemoved { block_hashes, medium, .. } => {
                for hash in block_hashes {
                    assert!(view[(medium == Device::Cpu) as usize].remove(&hash), "removed unknown {hash:x}");
                }
            }
            KvEvent::AllBlocksCleared => view.iter_mut().for_each(|tier| tier.clear()),
        }
    }
    for (tier, device) in view.iter().zip([Device::Gpu, Device::Cpu]) {
        assert_eq!(tier.iter().copied().collect::<Vec<_>>(), bm.cached_block_hashes(device, 0), "{device}");
    }
    bm.check_invariants().unwrap();
}

#[test]
fn events_mirror_both_tiers_through_eviction_offload_reload_and_reset() {
    let mut bm = manager(4, 4, true);
    bm.enable_cpu_prefix_cache().unwrap();
    bm.enable_kv_events().unwrap();
    let mut view: [std::collections::BTreeSet<u64>; 2] = Default::default();
    bm.allocate(1, &tokens(9), None).unwrap(); // blocks 0 and 1 full: stored on the device
    let events = bm.take_kv_events();
    assert!(
        matches!(&events[..], [KvEvent::BlockStored { block_hashes, parent_block_hash: None, .. }] if block_hashes.len() == 2)
    );
    if let KvEvent::BlockStored { block_hashes, .. } = &events[0] {
        view[0].extend(block_hashes);
    }
    replay(&mut bm, &mut view);
    bm.free(1).unwrap();
    replay(&mut bm, &mut view);
    let other: Vec<u32> = (500..516).collect();
    bm.allocate(2, &other, None).unwrap(); // takes every device block: the cached ones go to the CPU tier
    replay(&mut bm, &mut view);
    assert_eq!(bm.cached_block_hashes(Device::Cpu, 0).len(), 2);
    bm.free(2).unwrap();
    assert_eq!(bm.allocate(3, &tokens(9), None).unwrap(), 8, "both blocks come back from the tier");
    replay(&mut bm, &mut view);
    let reloaded: Vec<u64> = bm.table(3).unwrap().hashes.iter().map(|hash| hash.external()).collect();
    assert!(reloaded.iter().all(|hash| !view[1].contains(hash)), "a reloaded block leaves the tier");
    assert!(reloaded.iter().all(|hash| view[0].contains(hash)));
    bm.free(3).unwrap();
    assert!(bm.reset_prefix_cache());
    replay(&mut bm, &mut view);
    assert!(view.iter().all(|tier| tier.is_empty()));
}

#[test]
fn kv_events_start_only_on_an_empty_cache() {
    let mut bm = manager(4, 0, true);
    bm.allocate(1, &tokens(5), None).unwrap();
    assert!(bm.enable_kv_events().is_err());
}

/// A simulated KV cache whose every slot holds a fingerprint of the whole prefix up to its
/// position, as real K/V depends on every earlier token: a block served from another context
/// (another prompt, or the same tokens after another prefix) reads back wrong.
#[test]
fn no_sequence_reads_kv_computed_for_another_prefix() {
    let fingerprint = |tokens: &[u32]| {
        tokens.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| (h ^ t as u64).wrapping_mul(0x100_0000_01b3))
    };
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |bound: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % bound
    };
    let mut bm = BlockManager::new(24, 16, 4, true, 0.0).unwrap();
    bm.enable_cpu_prefix_cache().unwrap();
    let (mut device, mut cpu) = (HashMap::<i64, u64>::default(), HashMap::<i64, u64>::default());
    let mut live: Vec<(SeqId, Vec<u32>)> = Vec::new();
    let tier_copies = |bm: &mut BlockManager, device: &mut HashMap<i64, u64>, cpu: &mut HashMap<i64, u64>| {
        let (offloads, reloads) = bm.take_cpu_tier_copies();
        for (from, to, src, dst) in
            offloads.iter().map(|&(d, c)| (0, 1, d, c)).chain(reloads.iter().map(|&(c, d)| (1, 0, c, d)))
        {
            for offset in 0..4i64 {
                let value = [&*device, &*cpu][from].get(&(src as i64 * 4 + offset)).copied();
                let target = if to == 0 { &mut *device } else { &mut *cpu };
                match value {
                    Some(value) => target.insert(dst as i64 * 4 + offset, value),
                    None => target.remove(&(dst as i64 * 4 + offset)),
                };
            }
        }
    };
    for round in 0..3000u64 {
        bm.begin_step();
        match next(8) {
            0 | 1 => {
                // Prompts over two tokens, so that different prompts share blocks at different places.
                let len = 1 + next(14) as usize;
                let prompt: Vec<u32> = (0..len).map(|_| next(2) as u32).collect();
                if bm.blocks_needed_to_allocate(&prompt, None) <= bm.num_free_device_blocks() {
                    let hit = bm.allocate_prefix(round, &prompt, None).unwrap();
                    bm.append_slots(round, &prompt[hit..]).unwrap();
                    tier_copies(&mut bm, &mut device, &mut cpu); // (offloads first, then reloads)
                    let table = bm.table(round).unwrap();
                    for pos in hit..prompt.len() {
                        device.insert(table.slot(pos, 4), fingerprint(&prompt[..=pos]));
                    }
                    live.push((round, prompt));
                }
            }
            2 | 3 if !live.is_empty() => {
                let index = next(live.len() as u64) as usize;
                let (seq, tokens) = &mut live[index];
                let token = next(2) as u32;
                if bm.table(*seq).unwrap().device == Device::Gpu
                    && bm.blocks_needed_to_append(*seq, 1).unwrap() <= bm.num_free_device_blocks()
                {
                    let copy = bm.append_token(*seq, token).unwrap();
                    tier_copies(&mut bm, &mut device, &mut cpu);
                    if let Some(&(src, dst)) = copy.first() {
                        for offset in 0..4i64 {
                            if let Some(value) = device.get(&(src as i64 * 4 + offset)).copied() {
                                device.insert(dst as i64 * 4 + offset, value);
                            }
                        }
                    }
                    tokens.push(token);
                    let slot = bm.table(*seq).unwrap().slot(tokens.len() - 1, 4);
                    device.insert(slot, fingerprint(tokens));
                }
            }
            4 if !live.is_empty() => {
                let (seq, _) = live.swap_remove(next(live.len() as u64) as usize);
                bm.free(seq).unwrap();
            }
            5 if !live.is_empty() => {
                let seq = live[next(live.len() as u64) as usize].0;
                let (source, target, copies) = if bm.table(seq).unwrap().device == Device::Gpu {
                    if bm.num_unique_blocks(&[seq]).unwrap() > bm.num_free_cpu_blocks() {
                        continue;
                    }
                    (0, 1, bm.swap_out(&[seq]).unwrap())
                } else {
                    if bm.blocks_needed_to_swap_in(&[seq]).unwrap() > bm.num_free_device_blocks() {
                        continue;
                    }
                    (1, 0, bm.swap_in(&[seq]).unwrap())
                };
                tier_copies(&mut bm, &mut device, &mut cpu);
                for (src, dst) in copies {
                    for offset in 0..4i64 {
                        let value = [&device, &cpu][source].get(&(src as i64 * 4 + offset)).copied();
                        let pool = if target == 0 { &mut device } else { &mut cpu };
                        match value {
                            Some(value) => pool.insert(dst as i64 * 4 + offset, value),
                            None => pool.remove(&(dst as i64 * 4 + offset)),
                        };
                    }
                }
            }
            6 if !live.is_empty() => {
                // A child sharing a prefix of a sequence (a partial shared block is copied on write).
                let (parent, tokens) = live[next(live.len() as u64) as usize].clone();
                if bm.table(parent).unwrap().device == Device::Gpu {
                    let keep = 1 + next(tokens.len() as u64) as usize;
                    bm.fork_prefix(parent, round, &tokens[..keep]).unwrap();
                    live.push((round, tokens[..keep].to_vec()));
                }
            }
            7 if !live.is_empty() => {
                // Rejected speculative tokens: the sequence keeps a prefix of its tokens.
                let index = next(live.len() as u64) as usize;
                let (seq, tokens) = &mut live[index];
                if bm.table(*seq).unwrap().device == Device::Gpu {
                    let keep = 1 + next(tokens.len() as u64) as usize;
                    tokens.truncate(keep);
                    bm.truncate(*seq, tokens).unwrap();
                }
            }
            _ => {}
        }
        bm.check_invariants().unwrap();
        for (seq, tokens) in &live {
            let table = bm.table(*seq).unwrap();
            let pool = if table.device == Device::Gpu { &device } else { &cpu };
            for pos in 0..tokens.len() {
                assert_eq!(
                    pool.get(&table.slot(pos, 4)).copied(),
                    Some(fingerprint(&tokens[..=pos])),
                    "round {round}: sequence {seq} reads KV of another prefix at position {pos}"
                );
            }
        }
    }
}

#[test]
fn a_partial_block_left_named_by_a_truncate_loses_its_name_before_it_is_written_in_place() {
    let mut bm = manager(8, 0, true);
    bm.enable_kv_events().unwrap();
    bm.allocate(1, &tokens(8), None).unwrap(); // two full, named blocks
    bm.fork(1, 2).unwrap();
    bm.truncate(2, &tokens(6)).unwrap(); // block 1 partial in 2's table, still named (1 shares it)
    bm.free(1).unwrap(); // 2 holds it alone now
    bm.append_slots(2, &[99]).unwrap(); // written in place: its old content is gone
    assert_eq!(bm.peek_prefix_hits(&tokens(9), None).device, 1, "only block 0 still holds tokens(8)'s prefix");
    bm.append_slots(2, &[98]).unwrap(); // fills it: named by its new content
    bm.check_invariants().unwrap();
    let mut view: [std::collections::BTreeSet<u64>; 2] = Default::default();
    replay(&mut bm, &mut view);
}

#[test]
fn a_block_holding_a_placeholder_is_named_once_the_token_is_filled_in() {
    use crate::kv::block_table::PLACEHOLDER_TOKEN;
    let mut bm = manager(4, 0, true);
    bm.enable_kv_events().unwrap();
    let mut tokens = tokens(3);
    bm.allocate(1, &tokens, None).unwrap();
    bm.append_slots(1, &[PLACEHOLDER_TOKEN]).unwrap(); // fills block 0 with a token still being sampled
    assert!(bm.take_kv_events().is_empty() && bm.cached_block_hashes(Device::Gpu, 0).is_empty());
    tokens.push(7);
    bm.fill_token(1, 3, &tokens).unwrap();
    let events = bm.take_kv_events();
    assert!(matches!(&events[..], [KvEvent::BlockStored { token_ids, .. }] if *token_ids == tokens));
    assert_eq!(bm.peek_prefix_hits(&[tokens.clone(), vec![1]].concat(), None).device, 1);
    bm.check_invariants().unwrap();
}

//! Prefix caching: a full block is named by a 128-bit hash chained over (parent block's hash, its
//! token ids, an optional extra key such as an adapter id); the map finds a block by that name.
//!
//! Identity that cannot collide silently: the chain is SipHash-1-3 keyed by the engine's root
//! seed, 128 bits wide, and an entry keeps its tokens, so a hit is checked against both the full
//! name and the tokens of the block before it is served. A secret seed (the engine's default, as
//! vLLM seeds its root from os.urandom) makes names impossible to compute outside the engine, so
//! no one can craft a prompt whose blocks collide with another user's and read their KV. Engines
//! with the same seed agree on names. Outside consumers see a 64-bit part of each name
//! (`BlockHash::external`, the KV events' block hash): a collision there can only confuse a
//! router's index, never what this cache serves.
//!
//! KV-cache groups (`BlockManager::set_kv_groups`) each cache their own blocks for the same
//! prefix: a group's entry is named by the chain's hash with the group in its top byte
//! (`BlockHash::in_group`), so the external name stays the chain's and the group rides along.

use std::hash::Hasher;

use rustc_hash::FxHashMap as HashMap;
use siphasher::sip128::{Hasher128, SipHasher13};

use crate::kv::block_pool::BlockId;

/// A full block's identity: the keyed hash of its whole prefix (see the module's doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// Most KV-cache groups a model can have: a group's index is the top byte of its blocks' names.
pub const MAX_KV_GROUPS: usize = 256;

const GROUP_SHIFT: u32 = 120;

impl BlockHash {
    /// The 64-bit name outside consumers see (vLLM's `ExternalBlockHash` as an integer): the same
    /// for every KV-cache group's block of one prefix.
    #[inline]
    pub fn external(self) -> u64 {
        self.0 as u64
    }

    /// This name as KV-cache group `group`'s: the chain's hash (group 0's) with the group in its
    /// top byte. Hashes in block tables are the chain's; the cache and the pool hold these.
    #[inline]
    pub fn in_group(self, group: usize) -> BlockHash {
        debug_assert!(group < MAX_KV_GROUPS);
        BlockHash(self.0 & !(0xff << GROUP_SHIFT) | (group as u128) << GROUP_SHIFT)
    }

    /// The KV-cache group this name belongs to (see `in_group`).
    #[inline]
    pub fn group(self) -> usize {
        (self.0 >> GROUP_SHIFT) as usize
    }

    /// The map's key. The `colliding-block-hashes` test build keeps 3 bits of it, so that lookups
    /// meet other blocks every few blocks and the full-name and token checks are what keeps a hit
    /// exact (`no_sequence_reads_kv_computed_for_another_prefix` in block_manager.rs, run by `make test`).
    #[inline]
    fn map_key(self) -> u64 {
        // Groups' names of one prefix share their low bits: the group is mixed in (none for group 0).
        let key = self.0 as u64 ^ (self.group() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        if cfg!(feature = "colliding-block-hashes") {
            key & 7
        } else {
            key
        }
    }
}

/// Names full blocks: SipHash-1-3 (128-bit output) keyed by the root seed.
#[derive(Debug, Clone, Copy)]
pub struct BlockHasher {
    keys: (u64, u64),
}

impl BlockHasher {
    pub fn new(seed: u64) -> Self {
        // The second key word is a fixed odd mix of the seed: a 64-bit seed keys both halves.
        BlockHasher { keys: (seed, seed.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15) }
    }

    /// Hash of one full block given its parent's (None for a prompt's first block).
    pub fn block_hash(&self, parent: Option<BlockHash>, tokens: &[u32], extra_key: Option<u64>) -> BlockHash {
        let mut hasher = SipHasher13::new_with_keys(self.keys.0, self.keys.1);
        match parent {
            Some(parent) => {
                hasher.write_u8(1);
                hasher.write_u128(parent.0);
            }
            None => hasher.write_u8(0),
        }
        hasher.write_usize(tokens.len());
        for &token in tokens {
            hasher.write_u32(token);
        }
        match extra_key {
            Some(key) => {
                hasher.write_u8(1);
                hasher.write_u64(key);
            }
            None => hasher.write_u8(0),
        }
        BlockHash(hasher.finish128().as_u128()).in_group(0)
    }

    /// The hash of every full block of `tokens`, in order.
    pub fn block_hashes(&self, tokens: &[u32], block_size: usize, extra_key: Option<u64>) -> Vec<BlockHash> {
        let mut parent = None;
        tokens
            .chunks_exact(block_size)
            .map(|chunk| {
                let hash = self.block_hash(parent, chunk, extra_key);
                parent = Some(hash);
                hash
            })
            .collect()
    }
}

/// One cached block: its full name, its parent's name, where it is, and its tokens.
#[derive(Debug, Clone)]
pub struct CachedBlock {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub block: BlockId,
    pub tokens: Box<[u32]>,
    pub extra_key: Option<u64>,
}

impl CachedBlock {
    /// Block `index` of a prefix whose hash chain is `chain`, cached as KV-cache group `group`'s
    /// block `block`, holding `tokens`.
    pub fn in_chain(
        chain: &[BlockHash],
        index: usize,
        group: usize,
        block: BlockId,
        tokens: &[u32],
        extra_key: Option<u64>,
    ) -> Self {
        CachedBlock {
            hash: chain[index].in_group(group),
            parent: index.checked_sub(1).map(|parent| chain[parent].in_group(group)),
            block,
            tokens: tokens.into(),
            extra_key,
        }
    }
}

/// name -> cached block, with query/hit counters (counted in blocks).
#[derive(Debug, Clone, Default)]
pub struct PrefixCache {
    entries: HashMap<u64, CachedBlock>,
    pub queries: u64,
    pub hits: u64,
}

impl PrefixCache {
    /// The block named `hash` (the full 128-bit name is compared).
    pub fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.get(hash).map(|entry| entry.block)
    }

    /// The block named `hash` if it also holds `tokens`: what a prefix hit serves.
    pub fn lookup_verified(&self, hash: BlockHash, tokens: &[u32]) -> Option<BlockId> {
        self.get(hash).filter(|entry| *entry.tokens == *tokens).map(|entry| entry.block)
    }

    pub fn get(&self, hash: BlockHash) -> Option<&CachedBlock> {
        self.entries.get(&hash.map_key()).filter(|entry| entry.hash == hash)
    }

    /// Names `entry.block` by `entry.hash` unless the map's slot is taken (then the first stays,
    /// and the block is simply not cached). Returns whether it was inserted.
    pub fn insert(&mut self, entry: CachedBlock) -> bool {
        match self.entries.entry(entry.hash.map_key()) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(entry);
                true
            }
        }
    }

    /// Forgets `hash` if it still names `block` (it may name another block by now); returns the
    /// entry it forgot.
    pub fn remove(&mut self, hash: BlockHash, block: BlockId) -> Option<CachedBlock> {
        let key = hash.map_key();
        if self.entries.get(&key).is_some_and(|entry| entry.hash == hash && entry.block == block) {
            self.entries.remove(&key)
        } else {
            None
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Forgets every entry (the counters stay); returns them.
    pub fn take_entries(&mut self) -> Vec<CachedBlock> {
        self.entries.drain().map(|(_, entry)| entry).collect()
    }

    /// Every cached block.
    pub fn entries(&self) -> impl Iterator<Item = &CachedBlock> + '_ {
        self.entries.values()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn hit_rate(&self) -> f64 {
        if self.queries == 0 {
            0.0
        } else {
            self.hits as f64 / self.queries as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(hash: u128, block: BlockId, tokens: &[u32]) -> CachedBlock {
        CachedBlock { hash: BlockHash(hash), parent: None, block, tokens: tokens.into(), extra_key: None }
    }

    #[test]
    fn hash_chain_depends_on_parent_tokens_extra_key_and_seed() {
        let hasher = BlockHasher::new(0);
        let a = hasher.block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, None);
        let b = hasher.block_hashes(&[9, 2, 3, 4, 5, 6, 7, 8], 4, None);
        assert_eq!(a.len(), 2);
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1], "the second block's name depends on the first block");
        assert_ne!(a, hasher.block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, Some(7)));
        assert_eq!(a, hasher.block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, None), "partial blocks are not hashed");
        let seeded = BlockHasher::new(12345).block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, None);
        assert!(seeded[0] != a[0] && seeded[1] != a[1], "every name depends on the root seed");
        assert!(a[0].0 >> 64 != 0 && a[0].0 as u64 != 0, "names use all 128 bits");
    }

    #[test]
    fn a_groups_name_keeps_the_external_name_and_tells_its_group() {
        let hash = BlockHasher::new(3).block_hashes(&[1, 2, 3, 4], 4, None)[0];
        assert_eq!(hash.group(), 0);
        let named = hash.in_group(5);
        assert_eq!((named.group(), named.external()), (5, hash.external()));
        assert_ne!(named, hash);
        assert_eq!(named.in_group(0), hash);
        let mut cache = PrefixCache::default();
        assert!(cache.insert(entry(hash.0, 1, &[1])));
        assert!(cache.insert(entry(named.0, 2, &[1])), "each group caches its own block of a prefix");
        assert_eq!((cache.lookup(hash), cache.lookup(named)), (Some(1), Some(2)));
    }

    #[test]
    fn insert_keeps_first_and_remove_checks_owner() {
        let mut cache = PrefixCache::default();
        assert!(cache.insert(entry(5, 1, &[1])));
        assert!(!cache.insert(entry(5, 2, &[1])));
        assert!(cache.remove(BlockHash(5), 2).is_none());
        assert_eq!(cache.lookup(BlockHash(5)), Some(1));
        assert_eq!(cache.remove(BlockHash(5), 1).unwrap().block, 1);
        assert!(cache.is_empty());
    }

    #[test]
    fn a_lookup_compares_the_full_name_and_a_hit_the_tokens() {
        let mut cache = PrefixCache::default();
        let low = 77u128;
        assert!(cache.insert(entry(low | (1 << 100), 3, &[1, 2])));
        assert_eq!(cache.lookup(BlockHash(low | (2 << 100))), None, "same map key, other name: a miss");
        assert_eq!(cache.lookup_verified(BlockHash(low | (1 << 100)), &[1, 2]), Some(3));
        assert_eq!(cache.lookup_verified(BlockHash(low | (1 << 100)), &[1, 9]), None, "other tokens: a miss");
    }
}

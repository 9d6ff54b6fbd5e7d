//! Prefix caching: a full block is named by a hash chained over (parent block's hash, its token
//! ids, an optional extra key such as an adapter id); the map finds a device block by that name.
//! A prompt's first block chains from a root seed: a secret one (the engine's default, as vLLM
//! seeds its root from os.urandom) makes names impossible to compute outside the engine, so no
//! one can craft a prompt whose blocks collide with another user's and read their KV.

use std::hash::{Hash, Hasher};

use rustc_hash::FxHashMap as HashMap;

use crate::kv::block_pool::BlockId;

/// Hash of one full block given its parent's hash (the root seed for a first block). SipHash
/// with fixed keys: engines with the same root agree on names.
pub fn block_hash(parent: u64, tokens: &[u32], extra_key: Option<u64>) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    parent.hash(&mut hasher);
    tokens.hash(&mut hasher);
    extra_key.hash(&mut hasher);
    hasher.finish()
}

/// The hash of every full block of `tokens`, in order, chained from `root`.
pub fn block_hashes(root: u64, tokens: &[u32], block_size: usize, extra_key: Option<u64>) -> Vec<u64> {
    let mut parent = root;
    tokens
        .chunks_exact(block_size)
        .map(|chunk| {
            parent = block_hash(parent, chunk, extra_key);
            parent
        })
        .collect()
}

/// hash -> device block, with query/hit counters (counted in blocks).
#[derive(Debug, Clone, Default)]
pub struct PrefixCache {
    blocks: HashMap<u64, BlockId>,
    pub queries: u64,
    pub hits: u64,
}

impl PrefixCache {
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.blocks.get(&hash).copied()
    }

    /// Names `block` by `hash` unless another block already has that name (then the first stays).
    pub fn insert(&mut self, hash: u64, block: BlockId) -> bool {
        match self.blocks.entry(hash) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(block);
                true
            }
        }
    }

    /// Forgets `hash` if it still names `block` (it may name another block by now).
    pub fn remove(&mut self, hash: u64, block: BlockId) {
        if self.blocks.get(&hash) == Some(&block) {
            self.blocks.remove(&hash);
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Forgets every entry (the counters stay); returns the blocks they named.
    pub fn take_blocks(&mut self) -> Vec<BlockId> {
        self.blocks.drain().map(|(_, block)| block).collect()
    }

    /// Every (hash, block) entry.
    pub fn entries(&self) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.blocks.iter().map(|(hash, block)| (*hash, *block))
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
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

    #[test]
    fn hash_chain_depends_on_parent_tokens_and_extra_key() {
        let a = block_hashes(0, &[1, 2, 3, 4, 5, 6, 7, 8], 4, None);
        let b = block_hashes(0, &[9, 2, 3, 4, 5, 6, 7, 8], 4, None);
        assert_eq!(a.len(), 2);
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1], "the second block's name depends on the first block");
        assert_ne!(a, block_hashes(0, &[1, 2, 3, 4, 5, 6, 7, 8], 4, Some(7)));
        assert_eq!(a, block_hashes(0, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, None), "partial blocks are not hashed");
        let seeded = block_hashes(12345, &[1, 2, 3, 4, 5, 6, 7, 8], 4, None);
        assert!(seeded[0] != a[0] && seeded[1] != a[1], "every name depends on the root seed");
    }

    #[test]
    fn insert_keeps_first_and_remove_checks_owner() {
        let mut cache = PrefixCache::default();
        assert!(cache.insert(5, 1));
        assert!(!cache.insert(5, 2));
        cache.remove(5, 2);
        assert_eq!(cache.lookup(5), Some(1));
        cache.remove(5, 1);
        assert!(cache.is_empty());
    }
}

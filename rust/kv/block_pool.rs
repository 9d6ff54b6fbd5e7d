//! Physical KV blocks of one device: a free list, per-block refcounts and an LRU of blocks that
//! are free but still hold a cached prefix (reusable until evicted).

use crate::device::Device;
use crate::errors::{Error, Result};
use crate::kv::prefix_cache::BlockHash;

pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// A fixed set of blocks. All operations are O(1).
///
/// A block is in exactly one of three states: referenced (refcount > 0), free and uncached
/// (on `free_stack`), or free and cached (refcount 0, holds a content hash, on the LRU list).
/// Allocation prefers uncached blocks and evicts the least recently used cached block only
/// when none is left.
#[derive(Debug, Clone)]
pub struct BlockPool {
    device: Device,
    refcounts: Vec<u32>,
    hashes: Vec<Option<BlockHash>>,
    free_stack: Vec<BlockId>,
    // Doubly linked LRU of cached free blocks, indexed by block id; head = least recently used.
    lru_prev: Vec<u32>,
    lru_next: Vec<u32>,
    lru_head: u32,
    lru_tail: u32,
    num_cached_free: usize,
}

/// What `allocate` had to do to find a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    pub block: BlockId,
    /// The content hash of a cached block that was evicted to make room.
    pub evicted_hash: Option<BlockHash>,
}

impl BlockPool {
    pub fn new(device: Device, num_blocks: usize) -> Self {
        assert!(num_blocks < NIL as usize, "too many blocks");
        BlockPool {
            device,
            refcounts: vec![0; num_blocks],
            hashes: vec![None; num_blocks],
            // Reversed so that block 0 is handed out first (easier to read in tests and logs).
            free_stack: (0..num_blocks as u32).rev().collect(),
            lru_prev: vec![NIL; num_blocks],
            lru_next: vec![NIL; num_blocks],
            lru_head: NIL,
            lru_tail: NIL,
            num_cached_free: 0,
        }
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn num_blocks(&self) -> usize {
        self.refcounts.len()
    }

    /// Blocks that can be allocated now: uncached free plus cached free (evictable).
    pub fn num_free(&self) -> usize {
        self.free_stack.len() + self.num_cached_free
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    pub fn num_cached_free(&self) -> usize {
        self.num_cached_free
    }

    pub fn refcount(&self, block: BlockId) -> u32 {
        self.refcounts[block as usize]
    }

    pub fn hash(&self, block: BlockId) -> Option<BlockHash> {
        self.hashes[block as usize]
    }

    /// Takes a free block with refcount 1, evicting the least recently used cached block if needed.
    pub fn allocate(&mut self) -> Result<Allocation> {
        if let Some(block) = self.free_stack.pop() {
            self.refcounts[block as usize] = 1;
            return Ok(Allocation { block, evicted_hash: None });
        }
        let block = self.lru_head;
        if block == NIL {
            return Err(Error::OutOfBlocks { device: self.device, needed: 1, free: 0 });
        }
        self.lru_unlink(block);
        self.refcounts[block as usize] = 1;
        let evicted_hash = self.hashes[block as usize].take();
        Ok(Allocation { block, evicted_hash })
    }

    /// One more holder of `block`. A cached free block comes back to life (leaves the LRU).
    pub fn retain(&mut self, block: BlockId) {
        let i = block as usize;
        if self.refcounts[i] == 0 {
            debug_assert!(self.hashes[i].is_some(), "retaining a free uncached block");
            self.lru_unlink(block);
        }
        self.refcounts[i] += 1;
    }

    /// One holder fewer. At zero the block becomes free: cached (LRU tail) if it has a hash.
    /// Returns the new refcount.
    pub fn release(&mut self, block: BlockId) -> u32 {
        let i = block as usize;
        assert!(self.refcounts[i] > 0, "double free of block {block}");
        self.refcounts[i] -= 1;
        if self.refcounts[i] == 0 {
            if self.hashes[i].is_some() {
                self.lru_push_tail(block);
            } else {
                self.free_stack.push(block);
            }
        }
        self.refcounts[i]
    }

    /// Records the content hash of a referenced block (its KV is or will be written this step).
    pub fn set_hash(&mut self, block: BlockId, hash: BlockHash) {
        debug_assert!(self.refcounts[block as usize] > 0);
        self.hashes[block as usize] = Some(hash);
    }

    /// Forgets a block's hash; a cached free block becomes a plain free block.
    pub fn clear_hash(&mut self, block: BlockId) {
        let i = block as usize;
        if self.hashes[i].take().is_some() && self.refcounts[i] == 0 {
            self.lru_unlink(block);
            self.free_stack.push(block);
        }
    }

    fn lru_push_tail(&mut self, block: BlockId) {
        let i = block as usize;
        self.lru_prev[i] = self.lru_tail;
        self.lru_next[i] = NIL;
        if self.lru_tail == NIL {
            self.lru_head = block;
        } else {
            self.lru_next[self.lru_tail as usize] = block;
        }
        self.lru_tail = block;
        self.num_cached_free += 1;
    }

    fn lru_unlink(&mut self, block: BlockId) {
        let i = block as usize;
        let (prev, next) = (self.lru_prev[i], self.lru_next[i]);
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.lru_next[prev as usize] = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.lru_prev[next as usize] = prev;
        }
        self.lru_prev[i] = NIL;
        self.lru_next[i] = NIL;
        self.num_cached_free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_until_empty_then_error() {
        let mut pool = BlockPool::new(Device::Gpu, 3);
        let blocks: Vec<_> = (0..3).map(|_| pool.allocate().unwrap().block).collect();
        assert_eq!(blocks, vec![0, 1, 2]);
        assert_eq!(pool.num_free(), 0);
        assert!(matches!(pool.allocate(), Err(Error::OutOfBlocks { needed: 1, free: 0, .. })));
        pool.release(1);
        assert_eq!(pool.allocate().unwrap().block, 1);
    }

    #[test]
    fn refcounts_and_release() {
        let mut pool = BlockPool::new(Device::Gpu, 2);
        let b = pool.allocate().unwrap().block;
        pool.retain(b);
        assert_eq!(pool.refcount(b), 2);
        assert_eq!(pool.release(b), 1);
        assert_eq!(pool.num_free(), 1);
        assert_eq!(pool.release(b), 0);
        assert_eq!(pool.num_free(), 2);
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics_in_rust() {
        let mut pool = BlockPool::new(Device::Gpu, 1);
        let b = pool.allocate().unwrap().block;
        pool.release(b);
        pool.release(b);
    }

    #[test]
    fn cached_blocks_are_evicted_last_and_in_lru_order() {
        let mut pool = BlockPool::new(Device::Gpu, 3);
        let a = pool.allocate().unwrap().block;
        let b = pool.allocate().unwrap().block;
        pool.set_hash(a, BlockHash(10));
        pool.set_hash(b, BlockHash(20));
        pool.release(b); // b is older in the LRU than a
        pool.release(a);
        assert_eq!(pool.num_free(), 3);
        assert_eq!(pool.num_cached_free(), 2);
        // The uncached block goes first.
        assert_eq!(pool.allocate().unwrap(), Allocation { block: 2, evicted_hash: None });
        assert_eq!(pool.allocate().unwrap(), Allocation { block: b, evicted_hash: Some(BlockHash(20)) });
        // Reviving a cached block takes it off the LRU.
        pool.retain(a);
        assert_eq!(pool.num_free(), 0);
        assert_eq!(pool.hash(a), Some(BlockHash(10)));
    }

    #[test]
    fn clear_hash_turns_cached_into_plain_free() {
        let mut pool = BlockPool::new(Device::Gpu, 1);
        let a = pool.allocate().unwrap().block;
        pool.set_hash(a, BlockHash(1));
        pool.release(a);
        pool.clear_hash(a);
        assert_eq!(pool.num_cached_free(), 0);
        assert_eq!(pool.allocate().unwrap(), Allocation { block: a, evicted_hash: None });
    }
}

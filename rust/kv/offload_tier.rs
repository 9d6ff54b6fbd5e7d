//! The offload tier, the prefix cache's second tier: a cached block evicted from the device keeps its KV in a free
//! CPU swap block (named by the same content hash), and a later prompt with that prefix copies it
//! back instead of recomputing it. Swapped-out sequences always come first: tier blocks are free
//! CPU blocks (refcount 0, on the CPU pool's LRU) that any swap-out may take.
//!
//! The tiers are exclusive: a name is cached on the device or here, never both (the device
//! caching a name makes the tier `forget` it). So a router that mirrors the KV events without
//! reading their medium, as Dynamo's indexer does, still holds exactly what is cached.
//!
//! A step's copies run in one order: every device -> CPU copy (swap-outs and offloads), then every
//! CPU -> device copy (swap-ins and reloads). So that this order is always right, a CPU block this
//! step writes (an offload) or reads (a reload, a swap-in) is pinned until the next step begins:
//! nothing else can take it in between.

use crate::device::Device;
use crate::errors::Result;
use crate::kv::block_pool::{BlockId, BlockPool};
use crate::kv::events::KvEventLog;
use crate::kv::prefix_cache::{BlockHash, CachedBlock, PrefixCache};

/// (source block, destination block), as in `BlockCopy`.
type Copy = (BlockId, BlockId);

#[derive(Debug, Clone, Default)]
pub struct OffloadTier {
    enabled: bool,
    /// Content hash -> CPU block holding that block's KV.
    cache: PrefixCache,
    /// This step's device -> CPU copies of evicted blocks, and CPU -> device copies of hits.
    offloads: Vec<Copy>,
    reloads: Vec<Copy>,
    /// CPU blocks this step writes or reads, each holding one reference until `begin_step`.
    pinned: Vec<BlockId>,
    pub num_offloaded: u64,
    pub num_reloaded: u64,
}

impl OffloadTier {
    pub fn enable(&mut self) {
        self.enabled = true;
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The CPU block holding the KV named `hash` and computed for `tokens`, if the tier has it.
    pub fn lookup_verified(&self, hash: BlockHash, tokens: &[u32]) -> Option<BlockId> {
        if self.enabled {
            self.cache.lookup_verified(hash, tokens)
        } else {
            None
        }
    }

    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// Takes a CPU block for a swap-out, dropping the tier's name of a cached block it evicts.
    pub fn allocate(&mut self, cpu: &mut BlockPool, events: &mut KvEventLog) -> Result<BlockId> {
        let allocation = cpu.allocate()?;
        if let Some(hash) = allocation.evicted_hash {
            if self.cache.remove(hash, allocation.block).is_some() {
                events.removed(hash, Device::Cpu);
            }
        }
        Ok(allocation.block)
    }

    /// A cached device block (`evicted`, just dropped from the device's cache) is being evicted:
    /// copy its KV to a CPU block, if a CPU block is free (else the content is simply lost).
    pub fn offload(
        &mut self,
        cpu: &mut BlockPool,
        device_block: BlockId,
        evicted: CachedBlock,
        events: &mut KvEventLog,
    ) {
        if !self.enabled || self.cache.get(evicted.hash).is_some() || cpu.num_free() == 0 {
            return;
        }
        let cpu_block = self.allocate(cpu, events).expect("a CPU block is free");
        let entry = CachedBlock { block: cpu_block, ..evicted };
        if !self.cache.insert(entry.clone()) {
            cpu.release(cpu_block); // (its name's slot is taken: nothing to keep it for)
            return;
        }
        cpu.set_hash(cpu_block, entry.hash);
        events.stored(entry.hash, entry.parent, &entry.tokens, entry.extra_key, Device::Cpu);
        self.pinned.push(cpu_block); // the allocation's reference, dropped next step
        self.offloads.push((device_block, cpu_block));
        self.num_offloaded += 1;
    }

    /// The device caches `hash` now: the tier stops naming it (the tiers are exclusive). A pinned
    /// block keeps its pin and its pending copy; it is a plain free block once unpinned.
    pub fn forget(&mut self, cpu: &mut BlockPool, hash: BlockHash, events: &mut KvEventLog) {
        let Some(block) = self.cache.lookup(hash) else { return };
        self.cache.remove(hash, block);
        cpu.clear_hash(block);
        events.removed(hash, Device::Cpu);
    }

    /// Holds a prefix hit's CPU block until the next step. Pin every hit of a prompt before
    /// allocating its device blocks: an allocation may offload, which may take any unpinned block.
    pub fn pin(&mut self, cpu: &mut BlockPool, cpu_block: BlockId) {
        cpu.retain(cpu_block);
        self.pinned.push(cpu_block);
    }

    /// A prefix hit on the tier: copy the (pinned) `cpu_block` into the new `device_block`.
    pub fn reload(&mut self, cpu_block: BlockId, device_block: BlockId) {
        self.reloads.push((cpu_block, device_block));
        self.num_reloaded += 1;
    }

    /// A swap-in read `cpu_block`: with the tier on, its reference is dropped next step instead of
    /// now, so no offload of this step can overwrite it before the swap-in copy runs.
    pub fn release_after_swap_in(&mut self, cpu: &mut BlockPool, cpu_block: BlockId) {
        if self.enabled {
            self.pinned.push(cpu_block);
        } else {
            cpu.release(cpu_block);
        }
    }

    /// Unpins the last step's blocks (their copies have run by now).
    pub fn begin_step(&mut self, cpu: &mut BlockPool) {
        for block in self.pinned.drain(..) {
            cpu.release(block);
        }
    }

    /// This step's (offloads, reloads), to run with the swap-outs and swap-ins.
    pub fn take_copies(&mut self) -> (Vec<Copy>, Vec<Copy>) {
        (std::mem::take(&mut self.offloads), std::mem::take(&mut self.reloads))
    }

    /// Forgets every cached block: they become plain free CPU blocks. Call with nothing pinned.
    pub fn reset(&mut self, cpu: &mut BlockPool) {
        debug_assert!(self.pinned.is_empty());
        for entry in self.cache.take_entries() {
            cpu.clear_hash(entry.block);
        }
    }

    /// References held by pins, per CPU block (for the invariant check).
    pub fn pinned(&self) -> &[BlockId] {
        &self.pinned
    }
}

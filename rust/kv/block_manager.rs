//! The device pool, the CPU swap pool and every sequence's block tables (one per KV-cache group):
//! allocation on demand, fork with copy-on-write, prefix-cache reuse (device, and optionally the
//! CPU tier), swap between the pools, and the watermark.
//!
//! KV-cache groups (vLLM V1's hybrid allocator): a model whose layers mix attention kinds (Gemma
//! 3's sliding-window and full layers) splits its layers into groups of equal size, each group of
//! one kind. A pool block holds one group's layers for `block_size` tokens, so every group draws
//! from the same pool; each sequence has one table per group, and a windowed group's table
//! releases the blocks behind its window while a full group's keeps them all.
//!
//! Here: the manager, its settings and reads, fill-in, truncation, fork and free. Appending
//! (`growth`), a new sequence's prefix-cache start (`prefix_hits`), swap (`swap`) and the
//! bookkeeping checks (`invariants`) have files of their own.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use smallvec::SmallVec;

use crate::device::Device;
use crate::errors::{Error, Result};
use crate::kv::block_pool::{BlockId, BlockPool};
use crate::kv::block_table::{block_index, block_offset, BlockTable, SeqTables, PLACEHOLDER_TOKEN};
use crate::kv::events::{KvEvent, KvEventLog};
use crate::kv::offload_tier::OffloadTier;
use crate::kv::prefix_cache::{BlockHash, BlockHasher, CachedBlock, PrefixCache, MAX_KV_GROUPS};

/// `allocate_evicting` and `cache_on_device` on a manager's own pools and caches, where one of its
/// tables is borrowed too (a method would borrow the whole manager).
macro_rules! allocate_evicting {
    ($manager:expr) => {
        allocate_evicting(
            &mut $manager.gpu,
            &mut $manager.cache,
            &mut $manager.cpu,
            &mut $manager.cpu_tier,
            &mut $manager.events,
        )
    };
}

macro_rules! cache_on_device {
    ($manager:expr, $entry:expr) => {
        cache_on_device(
            &mut $manager.gpu,
            &mut $manager.cache,
            &mut $manager.cpu,
            &mut $manager.cpu_tier,
            &mut $manager.events,
            $entry,
        )
    };
}

mod growth;
mod invariants;
#[cfg(test)]
mod kv_group_tests;
mod prefix_hits;
mod swap;
#[cfg(test)]
mod tests;

pub use prefix_hits::PrefixHits;

pub type SeqId = u64;

/// A block copy the KV cache must perform: (source block, destination block).
pub type BlockCopy = (BlockId, BlockId);

/// The copy-on-write copies one append makes: one per KV-cache group whose shared partial last
/// block it wrote (at most one in models with one group).
pub type BlockCopies = SmallVec<[BlockCopy; 1]>;

/// What `append_slots_for_step` did to one sequence's tables.
pub struct StepSlots<'a> {
    /// The copy-on-write copies to perform before the step (a shared last block was written).
    pub copies: &'a [BlockCopy],
    /// The sequence's tables, one per KV-cache group.
    pub tables: &'a [BlockTable],
    /// First logical block not reported to the step consumer before (`blocks[table_from..]` of
    /// every group's table is new or remapped; equal to the tables' length when nothing changed).
    pub table_from: usize,
}

/// Owns both pools and all block tables. Every public method either succeeds or changes
/// nothing, so an error never leaks a block.
#[derive(Debug, Clone)]
pub struct BlockManager {
    block_size: usize,
    gpu: BlockPool,
    cpu: BlockPool,
    cache: PrefixCache,
    cpu_tier: OffloadTier,
    enable_prefix_caching: bool,
    watermark_blocks: usize,
    /// Each KV-cache group's attention window, counting the position itself (0: full attention);
    /// see `set_kv_groups`. One group unless set.
    windows: Vec<usize>,
    /// Names full blocks, keyed by the prefix cache's root seed.
    hasher: BlockHasher,
    /// The cached blocks' changes since the owner last took them (off unless enabled).
    events: KvEventLog,
    tables: HashMap<SeqId, SeqTables>,
    /// The copy-on-write copies of the last append (`grow`), kept to spare the hot path an allocation.
    step_copies: Vec<BlockCopy>,
}

impl BlockManager {
    /// `watermark` is the fraction of device blocks that admissions (`can_admit`) keep free,
    /// so running sequences can grow without immediately preempting each other.
    pub fn new(
        num_device_blocks: usize,
        num_cpu_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        watermark: f64,
    ) -> Result<Self> {
        if !block_size.is_power_of_two() {
            return Err(Error::InvalidConfig {
                field: "block_size",
                message: format!("must be a power of two (8, 16, 32, ...), got {block_size}"),
            });
        }
        if num_device_blocks == 0 {
            return Err(Error::InvalidConfig { field: "num_device_blocks", message: "must be > 0".into() });
        }
        if !(0.0..1.0).contains(&watermark) {
            return Err(Error::InvalidConfig {
                field: "watermark",
                message: format!("must be in [0, 1), got {watermark}"),
            });
        }
        Ok(BlockManager {
            block_size,
            gpu: BlockPool::new(Device::Gpu, num_device_blocks),
            cpu: BlockPool::new(Device::Cpu, num_cpu_blocks),
            cache: PrefixCache::default(),
            cpu_tier: OffloadTier::default(),
            enable_prefix_caching,
            watermark_blocks: (watermark * num_device_blocks as f64).ceil() as usize,
            windows: vec![0],
            hasher: BlockHasher::new(0),
            events: KvEventLog::default(),
            tables: HashMap::default(),
            step_copies: Vec::new(),
        })
    }

    /// Turns on the prefix cache's CPU tier (`cpu_prefix_tier.rs`): cached blocks evicted from the
    /// device move to free CPU swap blocks and are copied back on a hit. Needs prefix caching.
    pub fn enable_cpu_prefix_cache(&mut self) -> Result<()> {
        if !self.enable_prefix_caching {
            return Err(Error::InvalidConfig {
                field: "enable_cpu_prefix_cache",
                message: "needs enable_prefix_caching".into(),
            });
        }
        self.cpu_tier.enable();
        Ok(())
    }

    /// For models whose every layer attends only to the last `window` positions (counting its
    /// own; 0 = no window): one KV-cache group of that window (`set_kv_groups(&[window])`).
    pub fn set_sliding_window(&mut self, window: usize) {
        self.windows = vec![window];
    }

    /// The model's KV-cache groups, by each one's attention window (counting the position itself;
    /// 0: full attention), e.g. `[0, 1024, 1024, 1024, 1024, 1024]` for Gemma 3's one full layer
    /// per five windowed ones. Each sequence then holds one table per group over the shared pool.
    /// In a windowed group, a sequence about to compute position p no longer needs the blocks
    /// wholly before p + 1 - window: they are released as it advances (full ones stay in the
    /// prefix cache), so its live blocks stay within the window plus the step's new tokens.
    /// Only while no sequence holds blocks: an error otherwise, changing nothing.
    pub fn set_kv_groups(&mut self, windows: &[usize]) -> Result<()> {
        if windows.is_empty() || windows.len() > MAX_KV_GROUPS {
            return Err(Error::InvalidConfig {
                field: "kv_group_windows",
                message: format!("needs 1 to {MAX_KV_GROUPS} groups, got {}", windows.len()),
            });
        }
        if !self.tables.is_empty() {
            return Err(Error::InvalidState("KV-cache groups can only be set while no sequence holds blocks".into()));
        }
        self.windows = windows.to_vec();
        Ok(())
    }

    /// Each KV-cache group's attention window (0: full attention), in group order.
    pub fn kv_group_windows(&self) -> &[usize] {
        &self.windows
    }

    pub fn num_kv_groups(&self) -> usize {
        self.windows.len()
    }

    /// Roots the prefix cache's block names at `seed` (0 until set). A secret seed keeps names
    /// from being computed outside this manager (see prefix_cache.rs); engines that must agree
    /// on names share one. Only before any block is named: an error otherwise, changing nothing.
    pub fn set_hash_seed(&mut self, seed: u64) -> Result<()> {
        if !self.tables.is_empty() || !self.cache.is_empty() || !self.cpu_tier.cache().is_empty() {
            return Err(Error::InvalidState(
                "the prefix cache's hash seed can only be set before any block is cached".into(),
            ));
        }
        self.hasher = BlockHasher::new(seed);
        Ok(())
    }

    /// Starts recording KV events (`take_kv_events`). Only before any block is cached, so that a
    /// consumer replaying them from the start holds the whole cache: an error otherwise.
    pub fn enable_kv_events(&mut self) -> Result<()> {
        if !self.cache.is_empty() || !self.cpu_tier.cache().is_empty() {
            return Err(Error::InvalidState("KV events can only be enabled before any block is cached".into()));
        }
        self.events.enable();
        Ok(())
    }

    pub fn kv_events_enabled(&self) -> bool {
        self.events.is_enabled()
    }

    /// The KV events since the last call, oldest first (empty unless `enable_kv_events`).
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.events.take()
    }

    /// The external names (`BlockHash::external`) of one KV-cache group's blocks cached in one
    /// tier, sorted: what a consumer of every KV event holds for that tier and group.
    pub fn cached_block_hashes(&self, device: Device, group: usize) -> Vec<u64> {
        let cache = match device {
            Device::Gpu => &self.cache,
            Device::Cpu => self.cpu_tier.cache(),
        };
        let mut hashes: Vec<u64> =
            cache.entries().filter(|entry| entry.hash.group() == group).map(|entry| entry.hash.external()).collect();
        hashes.sort_unstable();
        hashes
    }

    pub fn cpu_tier(&self) -> &OffloadTier {
        &self.cpu_tier
    }

    /// Call before planning a step: the CPU blocks pinned for the last step's copies are released.
    pub fn begin_step(&mut self) {
        self.cpu_tier.begin_step(&mut self.cpu);
    }

    /// The CPU tier's copies since the last call: (device -> CPU offloads, CPU -> device reloads).
    /// They run with the step's swap-outs and swap-ins respectively.
    pub fn take_cpu_tier_copies(&mut self) -> (Vec<BlockCopy>, Vec<BlockCopy>) {
        self.cpu_tier.take_copies()
    }

    /// Forgets every cached prefix (device and CPU tier), as after a weight update, when cached
    /// K/V no longer match what the model would compute. Only when no sequence holds blocks:
    /// returns false (and changes nothing) otherwise. Hit counters are kept.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.tables.is_empty() {
            return false;
        }
        self.begin_step(); // with no sequence left, the last step's copies have run
        for entry in self.cache.take_entries() {
            self.gpu.clear_hash(entry.block);
        }
        self.cpu_tier.reset(&mut self.cpu);
        self.events.cleared();
        true
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_device_blocks(&self) -> usize {
        self.gpu.num_blocks()
    }
    pub fn num_free_device_blocks(&self) -> usize {
        self.gpu.num_free()
    }
    pub fn num_cpu_blocks(&self) -> usize {
        self.cpu.num_blocks()
    }
    pub fn num_free_cpu_blocks(&self) -> usize {
        self.cpu.num_free()
    }
    pub fn num_cached_device_blocks(&self) -> usize {
        self.gpu.num_cached_free()
    }
    pub fn num_cached_cpu_blocks(&self) -> usize {
        self.cpu.num_cached_free()
    }
    pub fn watermark_blocks(&self) -> usize {
        self.watermark_blocks
    }
    pub fn prefix_cache(&self) -> &PrefixCache {
        &self.cache
    }
    pub fn prefix_caching_enabled(&self) -> bool {
        self.enable_prefix_caching
    }

    pub fn refcount(&self, block: BlockId, device: Device) -> u32 {
        self.pool(device).refcount(block)
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.tables.contains_key(&seq)
    }

    /// The sequence's table of KV-cache group 0 (its only one, in models with one group).
    pub fn table(&self, seq: SeqId) -> Result<&BlockTable> {
        self.seq_tables(seq).map(|tables| &tables[0])
    }

    /// The sequence's tables, one per KV-cache group.
    pub fn seq_tables(&self, seq: SeqId) -> Result<&[BlockTable]> {
        self.tables.get(&seq).map(|tables| tables.as_slice()).ok_or(Error::UnknownSequence(seq))
    }

    /// Every table of every sequence (one per KV-cache group each).
    pub fn tables(&self) -> impl Iterator<Item = (&SeqId, &BlockTable)> {
        self.tables.iter().flat_map(|(seq, tables)| tables.iter().map(move |table| (seq, table)))
    }

    fn pool(&self, device: Device) -> &BlockPool {
        match device {
            Device::Gpu => &self.gpu,
            Device::Cpu => &self.cpu,
        }
    }

    /// Blocks one table needs to hold `num_tokens` tokens.
    pub fn blocks_for_tokens(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Blocks a new sequence takes to compute its first `num_tokens` tokens in one step: a table
    /// of that many in every KV-cache group (a window releases nothing before the next step).
    pub fn blocks_to_start(&self, num_tokens: usize) -> usize {
        self.windows.len() * self.blocks_for_tokens(num_tokens)
    }

    /// Whether `num_blocks` new blocks can be taken for an admission (prefill, swap-in) while
    /// keeping the watermark free.
    pub fn can_admit(&self, num_blocks: usize) -> bool {
        self.gpu.num_free() >= num_blocks + self.watermark_blocks
    }

    /// Device blocks that rebuilding sequences by recompute holds once done, in the KV-cache
    /// groups of full attention (a windowed group's blocks are bounded by its window, not by the
    /// length): for each, its blocks less the full blocks it shares with the sibling it forks from
    /// (`(num_tokens, shared_len)` in sibling order, `shared_len` 0 for a sequence that forks from
    /// none). A partial shared block is counted again: the forking sequence writes into a copy.
    pub fn blocks_to_rebuild(&self, seqs: &[(usize, usize)]) -> usize {
        let num_full_groups = self.windows.iter().filter(|&&window| window == 0).count();
        num_full_groups
            * seqs
                .iter()
                .map(|&(num_tokens, shared_len)| self.blocks_for_tokens(num_tokens) - shared_len / self.block_size)
                .sum::<usize>()
    }

    /// The token at `position` of `seq` became `tokens[position]` (a placeholder filled in, see
    /// `Scheduler::fill_placeholders`): the partial last block's copy of it changes, or, when it
    /// sits in a full block, that block's hash and the ones chained after it do, and the device's
    /// cache entries move to the new hashes (in every KV-cache group). (A swapped-out table's
    /// hashes change with no cache entries moved: its blocks are then only missed by lookups,
    /// never wrongly matched.)
    pub fn fill_token(&mut self, seq: SeqId, position: usize, tokens: &[u32]) -> Result<()> {
        if !self.enable_prefix_caching {
            return Ok(());
        }
        let block_size = self.block_size;
        let tables = self.tables.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
        for (group, table) in tables.iter_mut().enumerate() {
            if position >= table.num_tokens {
                return Ok(()); // (not appended to the table yet: hashed with its real value later)
            }
            table.tokens[position] = tokens[position];
            if position >= table.hashes.len() * block_size {
                continue; // (in the partial last block: hashed once it fills up)
            }
            for index in position / block_size..table.hashes.len() {
                let parent = index.checked_sub(1).map(|parent| table.hashes[parent]);
                let block_tokens = &tokens[index * block_size..(index + 1) * block_size];
                let hash = self.hasher.block_hash(parent, block_tokens, table.extra_key);
                let stale = std::mem::replace(&mut table.hashes[index], hash);
                if table.device != Device::Gpu || index < table.num_released {
                    continue;
                }
                let block = table.blocks[index];
                if self.gpu.hash(block) == Some(stale.in_group(group)) {
                    forget_name(&mut self.gpu, &mut self.cache, &mut self.events, block);
                }
                let entry = CachedBlock::in_chain(&table.hashes, index, group, block, block_tokens, table.extra_key);
                cache_on_device!(self, entry);
            }
        }
        Ok(())
    }

    /// Shortens `seq` to the `tokens` it keeps (rejected speculative tokens go). Blocks past them
    /// are released; full ones stay cached, since their KV is right for the tokens it was computed
    /// from. A last block left partial stops being a cache entry (its free slots will be
    /// rewritten), unless another sequence shares it: then the next append copies it first.
    pub fn truncate(&mut self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        let block_size = self.block_size;
        let tables = self.tables.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
        if tables[0].device != Device::Gpu {
            return Err(Error::InvalidState(format!("sequence {seq} is swapped out; swap it in before truncating")));
        }
        let new_len = tokens.len();
        if new_len > tables[0].num_tokens {
            return Err(Error::InvalidState(format!(
                "cannot truncate sequence {seq} to {new_len} tokens: it has {}",
                tables[0].num_tokens
            )));
        }
        let keep = new_len.div_ceil(block_size);
        for table in tables.iter_mut() {
            let already_released = table.num_released.saturating_sub(keep);
            for block in table.blocks.drain(keep..).skip(already_released) {
                self.gpu.release(block);
            }
            table.num_released = table.num_released.min(keep);
            table.num_reported = table.num_reported.min(keep);
            let full = new_len / block_size;
            if table.hashes.len() > full {
                if keep > full && full >= table.num_released {
                    let block = table.blocks[full];
                    if self.gpu.refcount(block) == 1 {
                        forget_name(&mut self.gpu, &mut self.cache, &mut self.events, block);
                    }
                }
                table.hashes.truncate(full);
            }
            if self.enable_prefix_caching {
                table.tokens.clear();
                table.tokens.extend_from_slice(tokens);
            }
            table.num_tokens = new_len;
        }
        Ok(())
    }

    /// Room for one more token (the standalone form of `append_slots`).
    pub fn append_token(&mut self, seq: SeqId, token: u32) -> Result<BlockCopies> {
        self.append_slots(seq, &[token])
    }

    /// `child` holds `tokens`, a prefix of `parent`'s, sharing the blocks that hold them (a
    /// partial last one is copied on the child's first write). An error, changing nothing, when
    /// a window of the parent released blocks the child's next position reads (`can_fork_prefix`).
    pub fn fork_prefix(&mut self, parent: SeqId, child: SeqId, tokens: &[u32]) -> Result<()> {
        if !self.can_fork_prefix(parent, tokens.len())? {
            return Err(Error::InvalidState(format!(
                "sequence {parent} released blocks that a fork of its first {} tokens reads",
                tokens.len()
            )));
        }
        self.fork(parent, child)?;
        self.truncate(child, tokens)
    }

    /// Whether a fork of `parent`'s first `shared_len` tokens finds every block its next position
    /// reads: in each windowed KV-cache group, the parent has released none of the blocks that
    /// position's window covers (it may have, once it computed past `shared_len` + window).
    pub fn can_fork_prefix(&self, parent: SeqId, shared_len: usize) -> Result<bool> {
        let tables = self.seq_tables(parent)?;
        Ok(tables
            .iter()
            .zip(&self.windows)
            .all(|(table, &window)| table.num_released <= first_needed_block(shared_len, window, self.block_size)))
    }

    /// `child` shares every block of `parent` (refcount + 1 each), in every KV-cache group.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        if self.tables.contains_key(&child) {
            return Err(Error::DuplicateSequence(child));
        }
        let mut tables: SeqTables = self.seq_tables(parent)?.into();
        let pool = match tables[0].device {
            Device::Gpu => &mut self.gpu,
            Device::Cpu => &mut self.cpu,
        };
        for table in tables.iter_mut() {
            table.num_reported = 0; // the consumer has never seen the child
            for &block in table.live_blocks() {
                pool.retain(block);
            }
        }
        self.tables.insert(child, tables);
        Ok(())
    }

    /// Releases every block of `seq`. Full blocks with a hash stay cached until evicted, the last
    /// ones first (released first, as vLLM does): a prefix's head, which every later prompt
    /// sharing any of it needs, stays longest.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        let tables = self.tables.remove(&seq).ok_or(Error::UnknownSequence(seq))?;
        let pool = match tables[0].device {
            Device::Gpu => &mut self.gpu,
            Device::Cpu => &mut self.cpu,
        };
        for table in &tables {
            for &block in table.live_blocks().iter().rev() {
                pool.release(block);
            }
        }
        Ok(())
    }
}

/// The first block that a sequence whose next computed position is `next_position` still reads,
/// in a KV-cache group with a window of `window` positions (0: full attention, so block 0).
#[inline]
fn first_needed_block(next_position: usize, window: usize, block_size: usize) -> usize {
    if window == 0 {
        return 0;
    }
    block_index((next_position + 1).saturating_sub(window), block_size)
}

/// Takes a device block, dropping the prefix-cache name of a cached block it had to evict (whose
/// KV moves to the CPU tier when that is on).
fn allocate_evicting(
    gpu: &mut BlockPool,
    cache: &mut PrefixCache,
    cpu: &mut BlockPool,
    tier: &mut OffloadTier,
    events: &mut KvEventLog,
) -> Result<BlockId> {
    let allocation = gpu.allocate()?;
    if let Some(hash) = allocation.evicted_hash {
        if let Some(evicted) = cache.remove(hash, allocation.block) {
            events.removed(hash, Device::Gpu);
            tier.offload(cpu, allocation.block, evicted, events);
        }
    }
    Ok(allocation.block)
}

/// Device block `block` stops being cached under its name (its content is about to change).
fn forget_name(gpu: &mut BlockPool, cache: &mut PrefixCache, events: &mut KvEventLog, block: BlockId) {
    if let Some(hash) = gpu.hash(block) {
        if cache.remove(hash, block).is_some() {
            events.removed(hash, Device::Gpu);
        }
        gpu.clear_hash(block);
    }
}

/// Names a full device block in the prefix cache (unless its name's slot is taken: then it is
/// just not cached), and the CPU tier stops naming it (the tiers are exclusive).
fn cache_on_device(
    gpu: &mut BlockPool,
    cache: &mut PrefixCache,
    cpu: &mut BlockPool,
    tier: &mut OffloadTier,
    events: &mut KvEventLog,
    entry: CachedBlock,
) {
    let (hash, block, parent) = (entry.hash, entry.block, entry.parent);
    if cache.get(hash).is_some() {
        return; // (the same content is cached already, in another block)
    }
    debug_assert!(gpu.hash(block).is_none(), "block {block} is named already");
    tier.forget(cpu, hash, events);
    let tokens = if events.is_enabled() { Some(entry.tokens.clone()) } else { None };
    let extra_key = entry.extra_key;
    if cache.insert(entry) {
        gpu.set_hash(block, hash);
        if let Some(tokens) = tokens {
            events.stored(hash, parent, &tokens, extra_key, Device::Gpu);
        }
    }
}

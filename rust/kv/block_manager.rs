//! The device pool, the CPU swap pool and every sequence's block table: allocation on demand,
//! fork with copy-on-write, prefix-cache reuse (device, and optionally the CPU tier), swap between
//! the pools, and the watermark.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use smallvec::SmallVec;

use crate::device::Device;
use crate::errors::{Error, Result};
use crate::kv::block_pool::{BlockId, BlockPool};
use crate::kv::block_table::{block_index, block_offset, BlockTable};
use crate::kv::events::{KvEvent, KvEventLog};
use crate::kv::offload_tier::OffloadTier;
use crate::kv::prefix_cache::{BlockHash, BlockHasher, CachedBlock, PrefixCache};

pub type SeqId = u64;

/// A block copy the KV cache must perform: (source block, destination block).
pub type BlockCopy = (BlockId, BlockId);

/// What `append_slots_for_step` did to one sequence's table.
pub struct StepSlots<'a> {
    /// The copy-on-write copy to perform before the step, if the shared last block was written.
    pub copy: Option<BlockCopy>,
    pub table: &'a BlockTable,
    /// First logical block not reported to the step consumer before (`table.blocks[table_from..]`
    /// is new or remapped; equal to the table's length when nothing changed).
    pub table_from: usize,
}

/// Cached full blocks a prompt's prefix would hit, by where they are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixHits {
    /// Leading blocks before the sliding window of the first computed token: their tokens are
    /// skipped, but no block is taken (they need not even be cached).
    pub released: usize,
    /// On the device (shared in place).
    pub device: usize,
    /// Of the device hits, those free right now (taking them takes them off the free list).
    pub revived: usize,
    /// In the CPU tier (each needs a device block and a copy).
    pub cpu: usize,
}

impl PrefixHits {
    /// Blocks of the prompt not computed again.
    pub fn blocks(&self) -> usize {
        self.released + self.device + self.cpu
    }

    /// Device blocks that a table of `num_blocks` blocks starting with these hits takes from the
    /// free pool: fresh ones for all but the device hits, plus the device hits it revives.
    pub fn blocks_taken(&self, num_blocks: usize) -> usize {
        num_blocks - self.released - self.device + self.revived
    }
}

/// Where one block of a prompt's cached prefix is.
#[derive(Debug, Clone, Copy)]
enum CachedAt {
    /// On the device; `free`: no table holds it right now.
    Device { block: BlockId, free: bool },
    /// In the CPU tier.
    Cpu(BlockId),
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
    /// Positions every layer attends back to, counting its own (0: all); see `set_sliding_window`.
    sliding_window: usize,
    /// Names full blocks, keyed by the prefix cache's root seed.
    hasher: BlockHasher,
    /// The cached blocks' changes since the owner last took them (off unless enabled).
    events: KvEventLog,
    tables: HashMap<SeqId, BlockTable>,
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
            sliding_window: 0,
            hasher: BlockHasher::new(0),
            events: KvEventLog::default(),
            tables: HashMap::default(),
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
    /// own; 0 = no window): a sequence about to compute position p no longer needs the blocks
    /// wholly before p + 1 - window, so they are released as it advances (full ones stay in the
    /// prefix cache) and its live blocks stay within its window plus the step's new tokens.
    pub fn set_sliding_window(&mut self, window: usize) {
        self.sliding_window = window;
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

    /// The external names (`BlockHash::external`) of the blocks cached in one tier, sorted: what
    /// a consumer of every KV event holds for that tier.
    pub fn cached_block_hashes(&self, device: Device) -> Vec<u64> {
        let cache = match device {
            Device::Gpu => &self.cache,
            Device::Cpu => self.cpu_tier.cache(),
        };
        let mut hashes: Vec<u64> = cache.entries().map(|entry| entry.hash.external()).collect();
        hashes.sort_unstable();
        hashes
    }

    #[inline]
    fn first_needed_block(&self, next_position: usize) -> usize {
        first_needed_block(next_position, self.sliding_window, self.block_size)
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

    pub fn table(&self, seq: SeqId) -> Result<&BlockTable> {
        self.tables.get(&seq).ok_or(Error::UnknownSequence(seq))
    }

    pub fn tables(&self) -> impl Iterator<Item = (&SeqId, &BlockTable)> {
        self.tables.iter()
    }

    fn pool(&self, device: Device) -> &BlockPool {
        match device {
            Device::Gpu => &self.gpu,
            Device::Cpu => &self.cpu,
        }
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for_tokens(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Whether `num_blocks` new blocks can be taken for an admission (prefill, swap-in) while
    /// keeping the watermark free.
    pub fn can_admit(&self, num_blocks: usize) -> bool {
        self.gpu.num_free() >= num_blocks + self.watermark_blocks
    }

    /// Device blocks that appending `num_tokens` tokens to `seq` takes (see
    /// `blocks_needed_to_append_group`).
    pub fn blocks_needed_to_append(&self, seq: SeqId, num_tokens: usize) -> Result<usize> {
        self.blocks_needed_to_append_group(&[(seq, num_tokens)])
    }

    /// Device blocks that appending `appends` (sequence, tokens) to running sequences of one group
    /// takes from the free pool, in that order: the one exact count used for decode growth,
    /// chunked prefills and preemption. A partially filled last block shared by `r` tables costs a
    /// copy-on-write for each of the first `r - 1` appenders only (the last writes in place); a
    /// partial block with room needs nothing. Blocks the sliding window releases count as soon as
    /// their sequence's turn comes (a block another table shares is not counted as freed), so the
    /// result is the fewest free blocks that let every append succeed in turn.
    pub fn blocks_needed_to_append_group(&self, appends: &[(SeqId, usize)]) -> Result<usize> {
        let mut copies_of: SmallVec<[(BlockId, u32); 4]> = SmallVec::new();
        let (mut balance, mut needed) = (0isize, 0isize);
        for &(seq, num_tokens) in appends {
            let table = self.table(seq)?;
            if table.device != Device::Gpu {
                return Err(Error::InvalidState(format!("sequence {seq} is swapped out; swap it in before appending")));
            }
            if num_tokens == 0 {
                continue;
            }
            let release_to = self.first_needed_block(table.num_tokens).clamp(table.num_released, table.blocks.len());
            balance -= blocks_freed_by_release(table, &self.gpu, release_to) as isize;
            balance += table.new_blocks_for(num_tokens, self.block_size) as isize;
            if table.last_block_partial(self.block_size) {
                let last = *table.blocks.last().unwrap();
                balance += copy_on_write(&mut copies_of, last, self.gpu.refcount(last)) as isize;
            }
            needed = needed.max(balance);
        }
        Ok(needed as usize)
    }

    /// Device blocks that swapping `appends`' sequences (one swapped group) back in and then
    /// appending their tokens takes: one per distinct CPU block (none for a full block whose
    /// content is held on the device by another table, which is shared in place), then the
    /// growth, with copy-on-write counted as in `blocks_needed_to_append_group`.
    pub fn blocks_needed_to_swap_in_group(&self, appends: &[(SeqId, usize)]) -> Result<usize> {
        let mut seen = HashSet::default();
        let mut copies_of: SmallVec<[(BlockId, u32); 4]> = SmallVec::new();
        let mut needed = 0;
        for &(seq, num_tokens) in appends {
            let table = self.table(seq)?;
            if table.device != Device::Cpu {
                return Err(Error::InvalidState(format!("sequence {seq} is not in the cpu pool")));
            }
            for (index, &block) in table.blocks.iter().enumerate().skip(table.num_released) {
                if seen.insert(block) {
                    let cached = table.hashes.get(index).and_then(|&hash| self.cache.lookup(hash));
                    needed += cached.is_none_or(|device_block| self.gpu.refcount(device_block) == 0) as usize;
                }
            }
            if num_tokens == 0 {
                continue;
            }
            needed += table.new_blocks_for(num_tokens, self.block_size);
            if table.last_block_partial(self.block_size) {
                let last = *table.blocks.last().unwrap();
                needed += copy_on_write(&mut copies_of, last, self.cpu.refcount(last)) as usize;
            }
        }
        Ok(needed)
    }

    /// Device blocks that rebuilding sequences by recompute holds once done: for each, its blocks
    /// less the full blocks it shares with the sibling it forks from (`(num_tokens, shared_len)`
    /// in sibling order, `shared_len` 0 for a sequence that forks from none). A partial shared
    /// block is counted again: the forking sequence writes into a copy of it.
    pub fn blocks_to_rebuild(&self, seqs: &[(usize, usize)]) -> usize {
        seqs.iter()
            .map(|&(num_tokens, shared_len)| self.blocks_for_tokens(num_tokens) - shared_len / self.block_size)
            .sum()
    }

    /// Device blocks that a new sequence with these tokens would take from the free pool:
    /// fresh blocks for what misses the prefix cache, plus cached hits that are free right now
    /// (reviving them takes them off the free list too).
    pub fn blocks_needed_to_allocate(&self, tokens: &[u32], extra_key: Option<u64>) -> usize {
        self.peek_prefix_hits(tokens, extra_key).blocks_taken(self.blocks_for_tokens(tokens.len()))
    }

    fn max_hit_blocks(&self, num_tokens: usize) -> usize {
        // At least one token is always computed, so the model produces logits for the prompt.
        num_tokens.saturating_sub(1) / self.block_size
    }

    /// The cached blocks a prefix of `tokens` would hit (what `allocate_prefix` takes).
    pub fn peek_prefix_hits(&self, tokens: &[u32], extra_key: Option<u64>) -> PrefixHits {
        self.plan_prefix(tokens, extra_key).0
    }

    /// The longest prefix of `tokens` (whole blocks, never all of the tokens) a new sequence can
    /// start from: every block its first computed token reads is cached, on the device or in the
    /// CPU tier, and the tier hits fit the free device blocks. Without a sliding window that is
    /// every block from the first; with one, the blocks in the window (vLLM's sliding-window
    /// cache hit), so a long prompt whose early blocks were evicted still hits. Returns the hits,
    /// the prefix's block hashes, and where each block is cached (None: before the window).
    fn plan_prefix(
        &self,
        tokens: &[u32],
        extra_key: Option<u64>,
    ) -> (PrefixHits, Vec<BlockHash>, Vec<Option<CachedAt>>) {
        if !self.enable_prefix_caching {
            return Default::default();
        }
        let block_size = self.block_size;
        let mut hashes =
            self.hasher.block_hashes(&tokens[..self.max_hit_blocks(tokens.len()) * block_size], block_size, extra_key);
        let mut found = Vec::with_capacity(hashes.len());
        for (&hash, block_tokens) in hashes.iter().zip(tokens.chunks_exact(block_size)) {
            // A hit is served only from a block that holds these very tokens under this very name.
            let at = match self.cache.lookup_verified(hash, block_tokens) {
                Some(block) => Some(CachedAt::Device { block, free: self.gpu.refcount(block) == 0 }),
                None => self.cpu_tier.lookup_verified(hash, block_tokens).map(CachedAt::Cpu),
            };
            if at.is_none() && self.sliding_window == 0 {
                break; // without a window no prefix goes past a miss
            }
            found.push(at);
        }
        // Running counts, so that each candidate length is checked in O(1).
        let mut counts = vec![[0usize; 4]; found.len() + 1]; // misses, device, revived, cpu
        for (index, at) in found.iter().enumerate() {
            let mut next = counts[index];
            match at {
                None => next[0] += 1,
                Some(CachedAt::Device { free, .. }) => {
                    next[1] += 1;
                    next[2] += *free as usize;
                }
                Some(CachedAt::Cpu(_)) => next[3] += 1,
            }
            counts[index + 1] = next;
        }
        let within = |from: usize, to: usize, kind: usize| counts[to][kind] - counts[from][kind];
        let num_free = self.gpu.num_free();
        let mut length = found.len();
        let mut first_needed = 0;
        while length > 0 {
            first_needed = self.first_needed_block(length * block_size).min(length);
            // Each tier hit takes a device block besides the free device hits it revives.
            if within(first_needed, length, 0) == 0
                && within(first_needed, length, 2) + within(first_needed, length, 3) <= num_free
            {
                break;
            }
            length -= 1;
        }
        if length == 0 {
            return Default::default();
        }
        hashes.truncate(length);
        found.truncate(length);
        found[..first_needed].fill(None);
        let hits = PrefixHits {
            released: first_needed,
            device: within(first_needed, length, 1),
            revived: within(first_needed, length, 2),
            cpu: within(first_needed, length, 3),
        };
        (hits, hashes, found)
    }

    /// Starts a table for `seq` holding the longest cached prefix of `tokens` (`plan_prefix`):
    /// device hits shared in place, CPU-tier hits copied into fresh device blocks (the copies come
    /// out of `take_cpu_tier_copies`), blocks before the sliding window released from the start.
    /// Returns the number of tokens that hit the cache; the caller appends the rest with
    /// `append_slots`.
    pub fn allocate_prefix(&mut self, seq: SeqId, tokens: &[u32], extra_key: Option<u64>) -> Result<usize> {
        if self.tables.contains_key(&seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        let mut table = BlockTable::new(extra_key);
        if self.enable_prefix_caching {
            let (hits, hashes, found) = self.plan_prefix(tokens, extra_key);
            self.cache.queries += tokens.len() as u64 / self.block_size as u64;
            // Released entries keep block 0: nothing reads them.
            table.blocks = vec![0; found.len()];
            table.num_released = hits.released;
            // Device hits first: once retained, reloading the tier hits cannot evict them.
            let mut reloads = Vec::with_capacity(hits.cpu);
            for (index, at) in found.iter().enumerate() {
                match *at {
                    Some(CachedAt::Device { block, .. }) => {
                        self.gpu.retain(block);
                        table.blocks[index] = block;
                    }
                    Some(CachedAt::Cpu(cpu_block)) => {
                        self.cpu_tier.pin(&mut self.cpu, cpu_block);
                        reloads.push((index, cpu_block));
                    }
                    None => {}
                }
            }
            for (index, cpu_block) in reloads {
                let block = allocate_evicting(
                    &mut self.gpu,
                    &mut self.cache,
                    &mut self.cpu,
                    &mut self.cpu_tier,
                    &mut self.events,
                )?;
                self.cpu_tier.reload(cpu_block, block);
                let entry = CachedBlock {
                    hash: hashes[index],
                    parent: index.checked_sub(1).map(|parent| hashes[parent]),
                    block,
                    tokens: tokens[index * self.block_size..(index + 1) * self.block_size].into(),
                    extra_key,
                };
                cache_on_device(
                    &mut self.gpu,
                    &mut self.cache,
                    &mut self.cpu,
                    &mut self.cpu_tier,
                    &mut self.events,
                    entry,
                );
                table.blocks[index] = block;
            }
            table.tokens = tokens[..hashes.len() * self.block_size].to_vec();
            table.hashes = hashes;
            self.cache.hits += (hits.released + hits.device) as u64;
            table.num_tokens = table.blocks.len() * self.block_size;
        }
        let hit_tokens = table.num_tokens;
        self.tables.insert(seq, table);
        Ok(hit_tokens)
    }

    /// A new sequence holding `tokens`: prefix-cache hits plus fresh blocks for the rest.
    /// Returns the number of tokens that hit the cache.
    pub fn allocate(&mut self, seq: SeqId, tokens: &[u32], extra_key: Option<u64>) -> Result<usize> {
        let needed = self.blocks_needed_to_allocate(tokens, extra_key);
        if needed > self.gpu.num_free() {
            return Err(Error::OutOfBlocks { device: Device::Gpu, needed, free: self.gpu.num_free() });
        }
        let hit_tokens = self.allocate_prefix(seq, tokens, extra_key)?;
        self.append_slots(seq, &tokens[hit_tokens..])?;
        Ok(hit_tokens)
    }

    /// Makes room for `tokens` after the sequence's current tokens. When the partially filled
    /// last block is shared, it is copied first (copy-on-write) and the copy is returned.
    /// Blocks that fill up get their content hash (and enter the prefix cache).
    pub fn append_slots(&mut self, seq: SeqId, tokens: &[u32]) -> Result<Option<BlockCopy>> {
        self.grow(seq, tokens).map(|(copy, _)| copy)
    }

    /// `append_slots` for the scheduler's hot path (one table lookup): also returns the updated
    /// table and takes its unreported blocks (`BlockTable::take_unreported`).
    pub fn append_slots_for_step(&mut self, seq: SeqId, tokens: &[u32]) -> Result<StepSlots<'_>> {
        let (copy, table) = self.grow(seq, tokens)?;
        let table_from = table.take_unreported();
        Ok(StepSlots { copy, table, table_from })
    }

    fn grow(&mut self, seq: SeqId, tokens: &[u32]) -> Result<(Option<BlockCopy>, &mut BlockTable)> {
        let (window, block_size) = (self.sliding_window, self.block_size);
        let table = self.tables.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
        if table.device != Device::Gpu {
            return Err(Error::InvalidState(format!("sequence {seq} is swapped out; swap it in before appending")));
        }
        let release_to = if window == 0 {
            table.num_released
        } else {
            first_needed_block(table.num_tokens, window, block_size).clamp(table.num_released, table.blocks.len())
        };
        // The decode step's usual case, fifteen times in sixteen: one token lands in the unshared,
        // partially filled last block without filling it. Nothing to allocate, copy or hash.
        if let [token] = tokens {
            let offset = block_offset(table.num_tokens, self.block_size);
            if offset != 0 && offset + 1 < self.block_size && self.gpu.refcount(*table.blocks.last().unwrap()) == 1 {
                if release_to > table.num_released {
                    release_blocks_before(table, &mut self.gpu, release_to);
                }
                table.num_tokens += 1;
                if self.enable_prefix_caching {
                    table.tokens.push(*token);
                }
                return Ok((None, table));
            }
        }
        let cow = !tokens.is_empty()
            && table.last_block_partial(self.block_size)
            && self.gpu.refcount(*table.blocks.last().unwrap()) > 1;
        let needed = table.new_blocks_for(tokens.len(), self.block_size) + cow as usize;
        let freed = blocks_freed_by_release(table, &self.gpu, release_to);
        if needed > self.gpu.num_free() + freed {
            let needed = needed - freed;
            return Err(Error::OutOfBlocks { device: Device::Gpu, needed, free: self.gpu.num_free() });
        }
        release_blocks_before(table, &mut self.gpu, release_to);
        let mut copy = None;
        if cow {
            let last = *table.blocks.last().unwrap();
            let fresh =
                allocate_evicting(&mut self.gpu, &mut self.cache, &mut self.cpu, &mut self.cpu_tier, &mut self.events)?;
            self.gpu.release(last);
            *table.blocks.last_mut().unwrap() = fresh;
            table.num_reported = table.num_reported.min(table.blocks.len() - 1);
            copy = Some((last, fresh));
        }
        for &token in tokens {
            if !table.last_block_partial(block_size) {
                let block = allocate_evicting(
                    &mut self.gpu,
                    &mut self.cache,
                    &mut self.cpu,
                    &mut self.cpu_tier,
                    &mut self.events,
                )?;
                table.blocks.push(block);
            }
            table.num_tokens += 1;
            if self.enable_prefix_caching {
                table.tokens.push(token);
                if table.tokens.len() == (table.hashes.len() + 1) * block_size {
                    let parent = table.hashes.last().copied();
                    let block_tokens = &table.tokens[table.tokens.len() - block_size..];
                    let hash = self.hasher.block_hash(parent, block_tokens, table.extra_key);
                    table.hashes.push(hash);
                    let entry = CachedBlock {
                        hash,
                        parent,
                        block: *table.blocks.last().unwrap(),
                        tokens: block_tokens.into(),
                        extra_key: table.extra_key,
                    };
                    cache_on_device(
                        &mut self.gpu,
                        &mut self.cache,
                        &mut self.cpu,
                        &mut self.cpu_tier,
                        &mut self.events,
                        entry,
                    );
                }
            }
        }
        Ok((copy, table))
    }

    /// The token at `position` of `seq` became `tokens[position]` (a placeholder filled in, see
    /// `Scheduler::fill_placeholders`): the partial last block's copy of it changes, or, when it
    /// sits in a full block, that block's hash and the ones chained after it do, and the device's
    /// cache entries move to the new hashes. (A swapped-out table's hashes change with no cache
    /// entries moved: its blocks are then only missed by lookups, never wrongly matched.)
    pub fn fill_token(&mut self, seq: SeqId, position: usize, tokens: &[u32]) -> Result<()> {
        if !self.enable_prefix_caching {
            return Ok(());
        }
        let block_size = self.block_size;
        let table = self.tables.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
        if position >= table.num_tokens {
            return Ok(()); // (not appended to the table yet: hashed with its real value later)
        }
        table.tokens[position] = tokens[position];
        if position >= table.hashes.len() * block_size {
            return Ok(()); // (in the partial last block: hashed once it fills up)
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
            if self.gpu.hash(block) == Some(stale) {
                self.cache.remove(stale, block);
                self.gpu.clear_hash(block);
                self.events.removed(stale.external(), Device::Gpu);
            }
            let entry = CachedBlock { hash, parent, block, tokens: block_tokens.into(), extra_key: table.extra_key };
            cache_on_device(&mut self.gpu, &mut self.cache, &mut self.cpu, &mut self.cpu_tier, &mut self.events, entry);
        }
        Ok(())
    }

    /// Shortens `seq` to the `tokens` it keeps (rejected speculative tokens go). Blocks past them
    /// are released; full ones stay cached, since their KV is right for the tokens it was computed
    /// from. A last block left partial stops being a cache entry (its free slots will be
    /// rewritten), unless another sequence shares it: then the next append copies it first.
    pub fn truncate(&mut self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        let block_size = self.block_size;
        let table = self.tables.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
        if table.device != Device::Gpu {
            return Err(Error::InvalidState(format!("sequence {seq} is swapped out; swap it in before truncating")));
        }
        let new_len = tokens.len();
        if new_len > table.num_tokens {
            return Err(Error::InvalidState(format!(
                "cannot truncate sequence {seq} to {new_len} tokens: it has {}",
                table.num_tokens
            )));
        }
        let keep = new_len.div_ceil(block_size);
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
                if let (1, Some(hash)) = (self.gpu.refcount(block), self.gpu.hash(block)) {
                    self.cache.remove(hash, block);
                    self.gpu.clear_hash(block);
                    self.events.removed(hash.external(), Device::Gpu);
                }
            }
            table.hashes.truncate(full);
        }
        if self.enable_prefix_caching {
            table.tokens.clear();
            table.tokens.extend_from_slice(tokens);
        }
        table.num_tokens = new_len;
        Ok(())
    }

    /// Room for one more token (the standalone form of `append_slots`).
    pub fn append_token(&mut self, seq: SeqId, token: u32) -> Result<Option<BlockCopy>> {
        self.append_slots(seq, &[token])
    }

    /// `child` holds `tokens`, a prefix of `parent`'s, sharing the blocks that hold them (a
    /// partial last one is copied on the child's first write).
    pub fn fork_prefix(&mut self, parent: SeqId, child: SeqId, tokens: &[u32]) -> Result<()> {
        self.fork(parent, child)?;
        self.truncate(child, tokens)
    }

    /// `child` shares every block of `parent` (refcount + 1 each).
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        if self.tables.contains_key(&child) {
            return Err(Error::DuplicateSequence(child));
        }
        let mut table = self.table(parent)?.clone();
        table.num_reported = 0; // the consumer has never seen the child
        let pool = match table.device {
            Device::Gpu => &mut self.gpu,
            Device::Cpu => &mut self.cpu,
        };
        for &block in table.live_blocks() {
            pool.retain(block);
        }
        self.tables.insert(child, table);
        Ok(())
    }

    /// Releases every block of `seq`. Full blocks with a hash stay cached until evicted, the last
    /// ones first (released first, as vLLM does): a prefix's head, which every later prompt
    /// sharing any of it needs, stays longest.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        let table = self.tables.remove(&seq).ok_or(Error::UnknownSequence(seq))?;
        let pool = match table.device {
            Device::Gpu => &mut self.gpu,
            Device::Cpu => &mut self.cpu,
        };
        for &block in table.live_blocks().iter().rev() {
            pool.release(block);
        }
        Ok(())
    }

    fn unique_blocks(&self, seqs: &[SeqId], device: Device) -> Result<Vec<BlockId>> {
        let mut seen = HashSet::default();
        let mut unique = Vec::new();
        for &seq in seqs {
            let table = self.table(seq)?;
            if table.device != device {
                return Err(Error::InvalidState(format!("sequence {seq} is not in the {device} pool")));
            }
            unique.extend(table.live_blocks().iter().copied().filter(|block| seen.insert(*block)));
        }
        Ok(unique)
    }

    /// Device blocks a swap-out of `seqs` frees up to (shared blocks counted once).
    pub fn num_unique_blocks(&self, seqs: &[SeqId]) -> Result<usize> {
        let device = match seqs.first() {
            Some(seq) => self.table(*seq)?.device,
            None => return Ok(0),
        };
        Ok(self.unique_blocks(seqs, device)?.len())
    }

    /// Moves every block of `seqs` (one sequence group) to the CPU pool. Blocks shared inside the
    /// group are moved once and stay shared. Returns the (device, cpu) copies to perform.
    pub fn swap_out(&mut self, seqs: &[SeqId]) -> Result<Vec<BlockCopy>> {
        let unique = self.unique_blocks(seqs, Device::Gpu)?;
        if unique.len() > self.cpu.num_free() {
            return Err(Error::OutOfBlocks { device: Device::Cpu, needed: unique.len(), free: self.cpu.num_free() });
        }
        let mut mapping: HashMap<BlockId, BlockId> =
            HashMap::with_capacity_and_hasher(unique.len(), Default::default());
        let mut copies = Vec::with_capacity(unique.len());
        for &seq in seqs {
            let table = self.tables.get_mut(&seq).unwrap();
            let num_released = table.num_released;
            for block in table.blocks[num_released..].iter_mut() {
                let cpu_block = match mapping.get(block) {
                    Some(&cpu_block) => {
                        self.cpu.retain(cpu_block);
                        cpu_block
                    }
                    None => {
                        let cpu_block = self.cpu_tier.allocate(&mut self.cpu, &mut self.events)?;
                        mapping.insert(*block, cpu_block);
                        copies.push((*block, cpu_block));
                        cpu_block
                    }
                };
                self.gpu.release(*block);
                *block = cpu_block;
            }
            table.device = Device::Cpu;
            table.num_reported = 0;
        }
        Ok(copies)
    }

    /// Device blocks a swap-in of `seqs` takes (see `blocks_needed_to_swap_in_group`).
    pub fn blocks_needed_to_swap_in(&self, seqs: &[SeqId]) -> Result<usize> {
        self.blocks_needed_to_swap_in_group(&seqs.iter().map(|&seq| (seq, 0)).collect::<Vec<_>>())
    }

    /// Moves every block of `seqs` back to the device pool. A full block whose content is still
    /// in the device prefix cache is taken from there without a copy. Returns (cpu, device) copies.
    pub fn swap_in(&mut self, seqs: &[SeqId]) -> Result<Vec<BlockCopy>> {
        let unique = self.unique_blocks(seqs, Device::Cpu)?;
        let needed = self.blocks_needed_to_swap_in(seqs)?;
        if needed > self.gpu.num_free() {
            return Err(Error::OutOfBlocks { device: Device::Gpu, needed, free: self.gpu.num_free() });
        }
        let mut mapping: HashMap<BlockId, BlockId> =
            HashMap::with_capacity_and_hasher(unique.len(), Default::default());
        let mut copies = Vec::with_capacity(unique.len());
        for &seq in seqs {
            let table = self.tables.get_mut(&seq).unwrap();
            let num_released = table.num_released;
            for (index, block) in table.blocks.iter_mut().enumerate().skip(num_released) {
                let device_block = match mapping.get(block) {
                    Some(&device_block) => {
                        self.gpu.retain(device_block);
                        device_block
                    }
                    None => {
                        let hash = table.hashes.get(index).copied();
                        let cached = hash.and_then(|hash| self.cache.lookup(hash));
                        let device_block = match cached {
                            Some(device_block) => {
                                self.gpu.retain(device_block);
                                device_block
                            }
                            None => {
                                let device_block = allocate_evicting(
                                    &mut self.gpu,
                                    &mut self.cache,
                                    &mut self.cpu,
                                    &mut self.cpu_tier,
                                    &mut self.events,
                                )?;
                                copies.push((*block, device_block));
                                if let Some(hash) = hash {
                                    let entry = CachedBlock {
                                        hash,
                                        parent: index.checked_sub(1).map(|parent| table.hashes[parent]),
                                        block: device_block,
                                        tokens: table.tokens[index * self.block_size..(index + 1) * self.block_size]
                                            .into(),
                                        extra_key: table.extra_key,
                                    };
                                    cache_on_device(
                                        &mut self.gpu,
                                        &mut self.cache,
                                        &mut self.cpu,
                                        &mut self.cpu_tier,
                                        &mut self.events,
                                        entry,
                                    );
                                }
                                device_block
                            }
                        };
                        mapping.insert(*block, device_block);
                        device_block
                    }
                };
                self.cpu_tier.release_after_swap_in(&mut self.cpu, *block);
                *block = device_block;
            }
            table.device = Device::Gpu;
            table.num_reported = 0;
        }
        Ok(copies)
    }

    /// Checks the bookkeeping against the tables: every refcount equals the number of tables
    /// holding the block, free blocks are unreferenced, cached blocks are named in the cache.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        for device in [Device::Gpu, Device::Cpu] {
            let pool = self.pool(device);
            let mut holders = vec![0u32; pool.num_blocks()];
            for table in self.tables.values().filter(|table| table.device == device) {
                for &block in table.live_blocks() {
                    holders[block as usize] += 1;
                }
            }
            if device == Device::Cpu {
                for &block in self.cpu_tier.pinned() {
                    holders[block as usize] += 1;
                }
            }
            let mut zero = 0;
            for (block, &count) in holders.iter().enumerate() {
                let refcount = pool.refcount(block as BlockId);
                if refcount != count {
                    return Err(format!(
                        "{device} block {block}: refcount {refcount}, held by {count} tables and pins"
                    ));
                }
                zero += (count == 0) as usize;
            }
            if zero != pool.num_free() {
                return Err(format!("{device} pool: {zero} unreferenced blocks but {} free", pool.num_free()));
            }
        }
        for block in 0..self.gpu.num_blocks() as BlockId {
            if let Some(hash) = self.gpu.hash(block) {
                if self.cache.lookup(hash) != Some(block) {
                    return Err(format!("device block {block} has hash {hash:x?} but the cache does not name it"));
                }
            }
        }
        for entry in self.cache.entries() {
            let (hash, block) = (entry.hash, entry.block);
            if self.gpu.hash(block) != Some(hash) {
                return Err(format!("the cache names device block {block} by {hash:x?}, a hash it does not hold"));
            }
            if self.cpu_tier.cache().get(hash).is_some() {
                return Err(format!("{hash:x?} is cached on the device and in the CPU tier"));
            }
        }
        for block in 0..self.cpu.num_blocks() as BlockId {
            if let Some(hash) = self.cpu.hash(block) {
                if self.cpu_tier.cache().lookup(hash) != Some(block) {
                    return Err(format!("CPU block {block} has hash {hash:x?} but the CPU tier does not name it"));
                }
            }
        }
        if self.cpu_tier.cache().len()
            != (0..self.cpu.num_blocks() as BlockId).filter(|b| self.cpu.hash(*b).is_some()).count()
        {
            return Err("the CPU tier names a block that holds no hash".into());
        }
        Ok(())
    }
}

/// Releases `table`'s live blocks before logical block `release_to` (the sliding window moved past).
#[inline]
fn release_blocks_before(table: &mut BlockTable, gpu: &mut BlockPool, release_to: usize) {
    for &block in &table.blocks[table.num_released..release_to] {
        gpu.release(block);
    }
    table.num_released = release_to;
}

/// The device blocks `release_blocks_before` would free: those no other table shares.
#[inline]
fn blocks_freed_by_release(table: &BlockTable, gpu: &BlockPool, release_to: usize) -> usize {
    table.blocks[table.num_released..release_to].iter().filter(|&&block| gpu.refcount(block) == 1).count()
}

/// Whether the next append into partial block `block`, held by `refcount` tables, copies it: the
/// appenders before it in this count (`copies_of`) each copied it and dropped a reference, and
/// once one reference is left the appender writes in place.
#[inline]
fn copy_on_write(copies_of: &mut SmallVec<[(BlockId, u32); 4]>, block: BlockId, refcount: u32) -> bool {
    if refcount <= 1 {
        return false;
    }
    let copies = match copies_of.iter_mut().find(|(shared, _)| *shared == block) {
        Some((_, copies)) => copies,
        None => {
            copies_of.push((block, 0));
            &mut copies_of.last_mut().unwrap().1
        }
    };
    let copies_now = refcount - *copies > 1;
    *copies += copies_now as u32;
    copies_now
}

/// The first block that a sequence whose next computed position is `next_position` still reads,
/// under a sliding window of `window` positions (0: none, so block 0).
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
            events.removed(hash.external(), Device::Gpu);
            tier.offload(cpu, allocation.block, evicted, events);
        }
    }
    Ok(allocation.block)
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
    tier.forget(cpu, hash, events);
    let tokens = if events.is_enabled() { Some(entry.tokens.clone()) } else { None };
    let extra_key = entry.extra_key;
    if cache.insert(entry) {
        gpu.set_hash(block, hash);
        if let Some(tokens) = tokens {
            events.stored(hash.external(), parent.map(BlockHash::external), &tokens, extra_key, Device::Gpu);
        }
    }
}

#[cfg(test)]
mod tests {
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
        assert_eq!(copy, Some((shared[1], child_last)));
        assert_eq!(bm.refcount(shared[1], Device::Gpu), 1);
        assert_eq!(bm.refcount(shared[0], Device::Gpu), 2, "the full block stays shared");
        // The parent now owns its last block alone and writes in place.
        assert_eq!(bm.append_token(1, 8).unwrap(), None);
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
        assert_eq!(bm.append_token(2, 1).unwrap(), None);
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
        assert_eq!(bm.peek_prefix_hits(&tokens(9), None), PrefixHits::default());
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
        assert_eq!(bm.append_slots(1, &[7, 7]).unwrap(), None, "written in place");
        assert_eq!(bm.peek_prefix_hits(&[&kept[..], &[1]].concat(), None).device, 2, "named by its new content");
        // A block the truncation leaves partial but another sequence shares keeps its name, and
        // the next append copies it.
        bm.fork(1, 2).unwrap();
        bm.truncate(1, &kept[..6]).unwrap();
        assert!(bm.append_slots(1, &[9]).unwrap().is_some());
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
        assert_eq!(hits, PrefixHits { released: 1, device: 2, revived: 1, cpu: 0 });
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
        assert_eq!(hits, PrefixHits { released: 3, device: 2, revived: 2, cpu: 0 });
        assert_eq!(bm.allocate(3, &prompt, None).unwrap(), 20);
        assert_eq!(bm.table(3).unwrap().live_blocks().len(), 3, "hit blocks 3 and 4, and block 5 for the last token");
        bm.check_invariants().unwrap();
        // Without a window the same cache yields nothing: block 0 is gone.
        bm.free(3).unwrap();
        bm.set_sliding_window(0);
        assert_eq!(bm.peek_prefix_hits(&prompt, None), PrefixHits::default());
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
                Err(Error::InvalidState(
                    "the prefix cache's hash seed can only be set before any block is cached".into()
                ))
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
                KvEvent::BlockRemoved { block_hashes, medium } => {
                    for hash in block_hashes {
                        assert!(view[(medium == Device::Cpu) as usize].remove(&hash), "removed unknown {hash:x}");
                    }
                }
                KvEvent::AllBlocksCleared => view.iter_mut().for_each(|tier| tier.clear()),
            }
        }
        for (tier, device) in view.iter().zip([Device::Gpu, Device::Cpu]) {
            assert_eq!(tier.iter().copied().collect::<Vec<_>>(), bm.cached_block_hashes(device), "{device}");
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
        assert_eq!(bm.cached_block_hashes(Device::Cpu).len(), 2);
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
            match next(6) {
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
                        if let Some((src, dst)) = copy {
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
}

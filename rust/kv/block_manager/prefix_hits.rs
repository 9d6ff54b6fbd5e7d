//! A new sequence's start from the prefix cache: which cached blocks a prompt hits (device
//! blocks shared in place, CPU-tier blocks copied back, blocks before a sliding window skipped),
//! what that takes from the free pool, and the table it starts with.

use super::*;

/// Cached full blocks a prompt's prefix would hit, by where they are, summed over the KV-cache
/// groups (each group holds its own block of every prefix block it keeps).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixHits {
    /// Leading blocks of the prompt served from the cache (not computed again).
    pub length: usize,
    /// Of each group's `length` blocks, those before its sliding window of the first computed
    /// token: their tokens are skipped, but no block is taken (they need not even be cached).
    pub released: usize,
    /// On the device (shared in place).
    pub device: usize,
    /// Of the device hits, those free right now (taking them takes them off the free list).
    pub revived: usize,
    /// In the CPU tier (each needs a device block and a copy).
    pub cpu: usize,
    /// KV-cache groups counted.
    pub num_groups: usize,
}

impl PrefixHits {
    /// Blocks of the prompt not computed again.
    pub fn blocks(&self) -> usize {
        self.length
    }

    /// Device blocks that tables of `num_blocks` blocks (one per group) starting with these hits
    /// take from the free pool: fresh ones for all but the device hits, plus the device hits they
    /// revive.
    pub fn blocks_taken(&self, num_blocks: usize) -> usize {
        self.num_groups * num_blocks - self.released - self.device + self.revived
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

/// A prefix plan: the hits, the prefix's block hashes (the chain's), and for each KV-cache group
/// where each of its blocks is cached (None: before the group's window).
type PrefixPlan = (PrefixHits, Vec<BlockHash>, Vec<Vec<Option<CachedAt>>>);

impl BlockManager {
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
    /// start from: in every KV-cache group, every block its first computed token reads is cached,
    /// on the device or in the CPU tier, and the tier hits of all groups fit the free device
    /// blocks. In a full-attention group that is every block from the first; in a windowed group,
    /// the blocks in the window (vLLM's sliding-window cache hit), so a long prompt whose early
    /// blocks were evicted there still hits, but one whose window blocks were evicted does not.
    fn plan_prefix(&self, tokens: &[u32], extra_key: Option<u64>) -> PrefixPlan {
        let no_hits = PrefixHits { num_groups: self.windows.len(), ..Default::default() };
        if !self.enable_prefix_caching {
            return (no_hits, Vec::new(), Vec::new());
        }
        let block_size = self.block_size;
        let mut hashes =
            self.hasher.block_hashes(&tokens[..self.max_hit_blocks(tokens.len()) * block_size], block_size, extra_key);
        let mut found_by_group = Vec::with_capacity(self.windows.len());
        let mut counts_by_group = Vec::with_capacity(self.windows.len());
        for (group, &window) in self.windows.iter().enumerate() {
            let mut found = Vec::with_capacity(hashes.len());
            for (&hash, block_tokens) in hashes.iter().zip(tokens.chunks_exact(block_size)) {
                // A hit is served only from a block that holds these very tokens under this very name.
                let hash = hash.in_group(group);
                let at = match self.cache.lookup_verified(hash, block_tokens) {
                    Some(block) => Some(CachedAt::Device { block, free: self.gpu.refcount(block) == 0 }),
                    None => self.cpu_tier.lookup_verified(hash, block_tokens).map(CachedAt::Cpu),
                };
                if at.is_none() && window == 0 {
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
            found_by_group.push(found);
            counts_by_group.push(counts);
        }
        let num_free = self.gpu.num_free();
        let mut length = found_by_group.iter().map(Vec::len).min().unwrap_or(0);
        let mut hits = no_hits;
        while length > 0 {
            hits = PrefixHits { length, ..no_hits };
            let mut servable = true;
            for (counts, &window) in counts_by_group.iter().zip(&self.windows) {
                let first_needed = first_needed_block(length * block_size, window, block_size).min(length);
                let within = |kind: usize| counts[length][kind] - counts[first_needed][kind];
                servable &= within(0) == 0;
                hits.released += first_needed;
                hits.device += within(1);
                hits.revived += within(2);
                hits.cpu += within(3);
            }
            // Each tier hit takes a device block besides the free device hits it revives.
            if servable && hits.revived + hits.cpu <= num_free {
                break;
            }
            length -= 1;
        }
        if length == 0 {
            return (no_hits, Vec::new(), vec![Vec::new(); self.windows.len()]);
        }
        hashes.truncate(length);
        for (found, &window) in found_by_group.iter_mut().zip(&self.windows) {
            found.truncate(length);
            found[..first_needed_block(length * block_size, window, block_size).min(length)].fill(None);
        }
        (hits, hashes, found_by_group)
    }

    /// Starts tables for `seq` holding the longest cached prefix of `tokens` (`plan_prefix`):
    /// device hits shared in place, CPU-tier hits copied into fresh device blocks (the copies come
    /// out of `take_cpu_tier_copies`), blocks before a group's window released from the start.
    /// Returns the number of tokens that hit the cache; the caller appends the rest with
    /// `append_slots`.
    pub fn allocate_prefix(&mut self, seq: SeqId, tokens: &[u32], extra_key: Option<u64>) -> Result<usize> {
        if self.tables.contains_key(&seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        let mut tables: SeqTables = (0..self.windows.len()).map(|_| BlockTable::new(extra_key)).collect();
        if self.enable_prefix_caching {
            let (hits, hashes, found_by_group) = self.plan_prefix(tokens, extra_key);
            self.cache.queries += tokens.len() as u64 / self.block_size as u64;
            // Device hits first: once retained, reloading the tier hits cannot evict them.
            let mut reloads = Vec::with_capacity(hits.cpu);
            for (group, (table, found)) in tables.iter_mut().zip(&found_by_group).enumerate() {
                // Released entries keep block 0: nothing reads them.
                table.blocks = vec![0; found.len()];
                table.num_released =
                    first_needed_block(found.len() * self.block_size, self.windows[group], self.block_size)
                        .min(found.len());
                for (index, at) in found.iter().enumerate() {
                    match *at {
                        Some(CachedAt::Device { block, .. }) => {
                            self.gpu.retain(block);
                            table.blocks[index] = block;
                        }
                        Some(CachedAt::Cpu(cpu_block)) => {
                            self.cpu_tier.pin(&mut self.cpu, cpu_block);
                            reloads.push((group, index, cpu_block));
                        }
                        None => {}
                    }
                }
            }
            for (group, index, cpu_block) in reloads {
                let block = allocate_evicting!(self)?;
                self.cpu_tier.reload(cpu_block, block);
                let block_tokens = &tokens[index * self.block_size..(index + 1) * self.block_size];
                let entry = CachedBlock::in_chain(&hashes, index, group, block, block_tokens, extra_key);
                cache_on_device!(self, entry);
                tables[group].blocks[index] = block;
            }
            for table in tables.iter_mut() {
                table.tokens = tokens[..hashes.len() * self.block_size].to_vec();
                table.hashes = hashes.clone();
                table.num_tokens = table.blocks.len() * self.block_size;
            }
            // Counted in prompt blocks served from the device (tier reloads count as the tier's hits).
            let num_groups = self.windows.len();
            self.cache.hits += ((hits.length * num_groups).saturating_sub(hits.cpu) / num_groups) as u64;
        }
        let hit_tokens = tables[0].num_tokens;
        self.tables.insert(seq, tables);
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
}

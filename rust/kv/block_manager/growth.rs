//! Appending to a sequence's tables: the device blocks appends take (the one exact count the
//! scheduler decides by) and the append itself, one KV-cache group's table at a time
//! (`TableGrowth`), with the window's releases and copy-on-write.

use super::*;

impl BlockManager {
    /// Device blocks that appending `num_tokens` tokens to `seq` takes (see
    /// `blocks_needed_to_append_group`).
    pub fn blocks_needed_to_append(&self, seq: SeqId, num_tokens: usize) -> Result<usize> {
        self.blocks_needed_to_append_group(&[(seq, num_tokens)])
    }

    /// Device blocks that appending `appends` (sequence, tokens) to running sequences of one group
    /// takes from the free pool, in that order: the one exact count used for decode growth,
    /// chunked prefills and preemption. A partially filled last block shared by `r` tables costs a
    /// copy-on-write for each of the first `r - 1` appenders only (the last writes in place); a
    /// partial block with room needs nothing. Blocks a window releases count as soon as their
    /// table's turn comes (a block another table shares is not counted as freed), so the result is
    /// the fewest free blocks that let every append succeed in turn (each sequence's KV-cache
    /// groups in group order, as `append_slots` takes them).
    pub fn blocks_needed_to_append_group(&self, appends: &[(SeqId, usize)]) -> Result<usize> {
        let mut copies_of: SmallVec<[(BlockId, u32); 4]> = SmallVec::new();
        let (mut balance, mut needed) = (0isize, 0isize);
        for &(seq, num_tokens) in appends {
            let tables = self.seq_tables(seq)?;
            if tables[0].device != Device::Gpu {
                return Err(Error::InvalidState(format!("sequence {seq} is swapped out; swap it in before appending")));
            }
            if num_tokens == 0 {
                continue;
            }
            for (table, &window) in tables.iter().zip(&self.windows) {
                let release_to = first_needed_block(table.num_tokens, window, self.block_size)
                    .clamp(table.num_released, table.blocks.len());
                balance -= blocks_freed_by_release(table, &self.gpu, release_to) as isize;
                balance += table.new_blocks_for(num_tokens, self.block_size) as isize;
                if table.last_block_partial(self.block_size) {
                    let last = *table.blocks.last().unwrap();
                    balance += copy_on_write(&mut copies_of, last, self.gpu.refcount(last)) as isize;
                }
                needed = needed.max(balance);
            }
        }
        Ok(needed as usize)
    }

    /// Makes room for `tokens` after the sequence's current tokens, in every KV-cache group. When
    /// a partially filled last block is shared, it is copied first (copy-on-write) and the copies
    /// are returned. Blocks that fill up get their content hash (and enter the prefix cache).
    pub fn append_slots(&mut self, seq: SeqId, tokens: &[u32]) -> Result<BlockCopies> {
        self.grow(seq, tokens).map(|(copies, _)| copies.iter().copied().collect())
    }

    /// `append_slots` for the scheduler's hot path (one table lookup): also returns the updated
    /// tables and takes their unreported blocks (`BlockTable::take_unreported`).
    pub fn append_slots_for_step(&mut self, seq: SeqId, tokens: &[u32]) -> Result<StepSlots<'_>> {
        let (copies, tables) = self.grow(seq, tokens)?;
        let table_from = match &mut *tables {
            [table] => table.take_unreported(),
            all => all.iter_mut().map(BlockTable::take_unreported).min().unwrap_or(0),
        };
        Ok(StepSlots { copies, tables, table_from })
    }

    /// `append_slots` on every table of `seq`; returns the copies (kept in `step_copies`) and the tables.
    fn grow(&mut self, seq: SeqId, tokens: &[u32]) -> Result<(&[BlockCopy], &mut [BlockTable])> {
        if self.windows.len() > 1 && !tokens.is_empty() {
            // Checked for all groups first, so that a failure changes nothing.
            let needed = self.blocks_needed_to_append(seq, tokens.len())?;
            if needed > self.gpu.num_free() {
                return Err(Error::OutOfBlocks { device: Device::Gpu, needed, free: self.gpu.num_free() });
            }
        }
        let BlockManager {
            block_size,
            gpu,
            cpu,
            cache,
            cpu_tier,
            enable_prefix_caching,
            windows,
            hasher,
            events,
            tables,
            step_copies,
            ..
        } = self;
        step_copies.clear();
        let tables = tables.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?.as_mut_slice();
        if tables[0].device != Device::Gpu {
            return Err(Error::InvalidState(format!("sequence {seq} is swapped out; swap it in before appending")));
        }
        let mut growth = TableGrowth {
            block_size: *block_size,
            enable_prefix_caching: *enable_prefix_caching,
            hasher,
            gpu,
            cpu,
            cache,
            cpu_tier,
            events,
            copies: step_copies,
        };
        match &mut *tables {
            [table] => growth.grow(table, 0, windows[0], tokens)?, // (the one-group hot path)
            all => {
                for (group, table) in all.iter_mut().enumerate() {
                    growth.grow(table, group, windows[group], tokens)?;
                }
            }
        }
        Ok((step_copies, tables))
    }
}

/// What appending to one table borrows from the block manager (`BlockManager::grow`).
struct TableGrowth<'a> {
    block_size: usize,
    enable_prefix_caching: bool,
    hasher: &'a BlockHasher,
    gpu: &'a mut BlockPool,
    cpu: &'a mut BlockPool,
    cache: &'a mut PrefixCache,
    cpu_tier: &'a mut OffloadTier,
    events: &'a mut KvEventLog,
    /// The copy-on-write copies made, in order.
    copies: &'a mut Vec<BlockCopy>,
}

impl TableGrowth<'_> {
    /// Appends `tokens` to KV-cache group `group`'s `table` (its window: `window`), which the
    /// caller has checked fits.
    #[inline(always)]
    fn grow(&mut self, table: &mut BlockTable, group: usize, window: usize, tokens: &[u32]) -> Result<()> {
        let TableGrowth { block_size, enable_prefix_caching, hasher, gpu, cpu, cache, cpu_tier, events, copies } = self;
        let (block_size, enable_prefix_caching) = (*block_size, *enable_prefix_caching);
        let release_to = if window == 0 {
            table.num_released
        } else {
            first_needed_block(table.num_tokens, window, block_size).clamp(table.num_released, table.blocks.len())
        };
        // A partial last block this table alone holds may still be named after the full block it
        // was cut from (truncated while another table shared it, which let go since): it is about
        // to be written in place, so it stops serving that name first.
        if !tokens.is_empty() && table.last_block_partial(block_size) {
            let last = *table.blocks.last().unwrap();
            if gpu.refcount(last) == 1 && gpu.hash(last).is_some() {
                forget_name(gpu, cache, events, last);
            }
        }
        // The decode step's usual case, fifteen times in sixteen: one token lands in the unshared,
        // partially filled last block without filling it. Nothing to allocate, copy or hash.
        if let [token] = tokens {
            let offset = block_offset(table.num_tokens, block_size);
            if offset != 0 && offset + 1 < block_size && gpu.refcount(*table.blocks.last().unwrap()) == 1 {
                if release_to > table.num_released {
                    release_blocks_before(table, gpu, release_to);
                }
                table.num_tokens += 1;
                if enable_prefix_caching {
                    table.tokens.push(*token);
                }
                return Ok(());
            }
        }
        let cow = !tokens.is_empty()
            && table.last_block_partial(block_size)
            && gpu.refcount(*table.blocks.last().unwrap()) > 1;
        let needed = table.new_blocks_for(tokens.len(), block_size) + cow as usize;
        let freed = blocks_freed_by_release(table, gpu, release_to);
        if needed > gpu.num_free() + freed {
            let needed = needed - freed;
            return Err(Error::OutOfBlocks { device: Device::Gpu, needed, free: gpu.num_free() });
        }
        release_blocks_before(table, gpu, release_to);
        if cow {
            let last = *table.blocks.last().unwrap();
            let fresh = allocate_evicting(gpu, cache, cpu, cpu_tier, events)?;
            gpu.release(last);
            *table.blocks.last_mut().unwrap() = fresh;
            table.num_reported = table.num_reported.min(table.blocks.len() - 1);
            copies.push((last, fresh));
        }
        for &token in tokens {
            if !table.last_block_partial(block_size) {
                let block = allocate_evicting(gpu, cache, cpu, cpu_tier, events)?;
                table.blocks.push(block);
            }
            table.num_tokens += 1;
            if enable_prefix_caching {
                table.tokens.push(token);
                if table.tokens.len() == (table.hashes.len() + 1) * block_size {
                    let parent = table.hashes.last().copied();
                    let block_tokens = &table.tokens[table.tokens.len() - block_size..];
                    let hash = hasher.block_hash(parent, block_tokens, table.extra_key);
                    table.hashes.push(hash);
                    if block_tokens.contains(&PLACEHOLDER_TOKEN) {
                        continue; // (named once its token is filled in: fill_token)
                    }
                    let (index, block) = (table.hashes.len() - 1, *table.blocks.last().unwrap());
                    let entry =
                        CachedBlock::in_chain(&table.hashes, index, group, block, block_tokens, table.extra_key);
                    cache_on_device(gpu, cache, cpu, cpu_tier, events, entry);
                }
            }
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
pub(super) fn copy_on_write(copies_of: &mut SmallVec<[(BlockId, u32); 4]>, block: BlockId, refcount: u32) -> bool {
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

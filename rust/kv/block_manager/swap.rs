//! Moving a preempted sequence group's blocks between the pools: swap-out to the CPU pool, swap-in
//! back (full blocks still cached on the device are shared in place, not copied), and the exact
//! count of device blocks a swap-in takes.

use super::growth::copy_on_write;
use super::*;

impl BlockManager {
    /// Device blocks that swapping `appends`' sequences (one swapped group) back in and then
    /// appending their tokens takes: one per distinct CPU block (none for a full block whose
    /// content is held on the device by another table, which is shared in place), then the
    /// growth, with copy-on-write counted as in `blocks_needed_to_append_group`.
    pub fn blocks_needed_to_swap_in_group(&self, appends: &[(SeqId, usize)]) -> Result<usize> {
        let mut seen = HashSet::default();
        let mut copies_of: SmallVec<[(BlockId, u32); 4]> = SmallVec::new();
        let mut needed = 0;
        for &(seq, num_tokens) in appends {
            let tables = self.seq_tables(seq)?;
            if tables[0].device != Device::Cpu {
                return Err(Error::InvalidState(format!("sequence {seq} is not in the cpu pool")));
            }
            for (group, table) in tables.iter().enumerate() {
                for (index, &block) in table.blocks.iter().enumerate().skip(table.num_released) {
                    if seen.insert(block) {
                        let cached = table.hashes.get(index).and_then(|&hash| self.cache.lookup(hash.in_group(group)));
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
        }
        Ok(needed)
    }

    fn unique_blocks(&self, seqs: &[SeqId], device: Device) -> Result<Vec<BlockId>> {
        let mut seen = HashSet::default();
        let mut unique = Vec::new();
        for &seq in seqs {
            let tables = self.seq_tables(seq)?;
            if tables[0].device != device {
                return Err(Error::InvalidState(format!("sequence {seq} is not in the {device} pool")));
            }
            for table in tables {
                unique.extend(table.live_blocks().iter().copied().filter(|block| seen.insert(*block)));
            }
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
            for table in self.tables.get_mut(&seq).unwrap().iter_mut() {
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
            for (group, table) in self.tables.get_mut(&seq).unwrap().iter_mut().enumerate() {
                let num_released = table.num_released;
                for (index, block) in table.blocks.iter_mut().enumerate().skip(num_released) {
                    let device_block = match mapping.get(block) {
                        Some(&device_block) => {
                            self.gpu.retain(device_block);
                            device_block
                        }
                        None => {
                            let hash = table.hashes.get(index).map(|hash| hash.in_group(group));
                            let cached = hash.and_then(|hash| self.cache.lookup(hash));
                            let device_block = match cached {
                                Some(device_block) => {
                                    self.gpu.retain(device_block);
                                    device_block
                                }
                                None => {
                                    let device_block = allocate_evicting!(self)?;
                                    copies.push((*block, device_block));
                                    let block_tokens =
                                        table.tokens.get(index * self.block_size..(index + 1) * self.block_size);
                                    let unfilled =
                                        block_tokens.is_some_and(|tokens| tokens.contains(&PLACEHOLDER_TOKEN));
                                    if let (Some(_), Some(block_tokens), false) = (hash, block_tokens, unfilled) {
                                        let entry = CachedBlock::in_chain(
                                            &table.hashes,
                                            index,
                                            group,
                                            device_block,
                                            block_tokens,
                                            table.extra_key,
                                        );
                                        cache_on_device!(self, entry);
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
        }
        Ok(copies)
    }
}

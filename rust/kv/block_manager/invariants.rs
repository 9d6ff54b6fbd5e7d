//! The bookkeeping checked against the tables: refcounts, free lists, KV-cache groups and both
//! tiers' cache names (what every test of the block manager and the scheduler asserts after a step).

use super::*;

impl BlockManager {
    /// Checks the bookkeeping against the tables: every refcount equals the number of tables
    /// holding the block, free blocks are unreferenced, cached blocks are named in the cache.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut group_of: HashMap<(bool, BlockId), usize> = HashMap::default();
        for (seq, tables) in &self.tables {
            if tables.len() != self.windows.len() {
                return Err(format!(
                    "sequence {seq} has {} tables for {} KV-cache groups",
                    tables.len(),
                    self.windows.len()
                ));
            }
            for (group, table) in tables.iter().enumerate() {
                let first = &tables[0];
                if (table.num_tokens, table.blocks.len(), table.device)
                    != (first.num_tokens, first.blocks.len(), first.device)
                {
                    return Err(format!("sequence {seq}: the tables of groups 0 and {group} disagree"));
                }
                for &block in table.live_blocks() {
                    if *group_of.entry((table.device == Device::Gpu, block)).or_insert(group) != group {
                        return Err(format!("{} block {block} is held in two KV-cache groups", table.device));
                    }
                }
            }
        }
        for device in [Device::Gpu, Device::Cpu] {
            let pool = self.pool(device);
            let mut holders = vec![0u32; pool.num_blocks()];
            for (_, table) in self.tables().filter(|(_, table)| table.device == device) {
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

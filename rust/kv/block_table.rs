//! One sequence's logical -> physical block map, with the hash chain of its full blocks.

use smallvec::SmallVec;

use crate::device::Device;
use crate::kv::block_pool::BlockId;
use crate::kv::prefix_cache::BlockHash;

/// The token id `Scheduler::append_placeholders` appends for a token still being sampled (no
/// vocabulary reaches it; prompts holding it are refused). A block holding one is not named in the
/// prefix cache until the token is filled in (`BlockManager::fill_token`).
pub const PLACEHOLDER_TOKEN: u32 = u32::MAX;

/// A sequence's block tables, one per KV-cache group (`BlockManager::set_kv_groups`), in group
/// order. Each maps the same logical blocks to physical blocks of the one shared pool; they differ
/// only in which blocks each group's attention window has released.
pub type SeqTables = SmallVec<[BlockTable; 1]>;

/// Logical block `i` of a sequence lives in physical block `blocks[i]` of the pool named by
/// `device`. `num_tokens` slots are in use; only the last block can be partially filled.
#[derive(Debug, Clone)]
pub struct BlockTable {
    pub blocks: Vec<BlockId>,
    pub device: Device,
    pub num_tokens: usize,
    /// Content hash of each full block, in order (empty when prefix caching is off).
    pub hashes: Vec<BlockHash>,
    /// The sequence's token ids (empty when prefix caching is off): the partial last block's are
    /// hashed once it fills up, a full block's name its cache entry again after a swap-in.
    pub tokens: Vec<u32>,
    pub extra_key: Option<u64>,
    /// Leading blocks released because the group's sliding-window attention will never read them
    /// again (`BlockManager::set_kv_groups`): `blocks[..num_released]` keep the ids they had, which
    /// may since hold other sequences' KV, and are held by nobody. Live blocks are the rest.
    pub num_released: usize,
    /// Leading blocks the step consumer already holds as they are: the scheduler reports only
    /// `blocks[num_reported..]` (see `ScheduledSequence::block_table_from`). Anything that remaps
    /// a block lowers it; a new table starts at 0.
    pub num_reported: usize,
}

impl BlockTable {
    pub fn new(extra_key: Option<u64>) -> Self {
        BlockTable {
            blocks: Vec::new(),
            device: Device::Gpu,
            num_tokens: 0,
            hashes: Vec::new(),
            tokens: Vec::new(),
            extra_key,
            num_released: 0,
            num_reported: 0,
        }
    }

    /// The blocks this table holds a reference to (all but the released ones).
    #[inline]
    pub fn live_blocks(&self) -> &[BlockId] {
        &self.blocks[self.num_released..]
    }

    /// The first logical block changed since the last call (`blocks[from..]` is new or
    /// remapped). Marks the whole table reported.
    pub fn take_unreported(&mut self) -> usize {
        let from = self.num_reported.min(self.blocks.len());
        self.num_reported = self.blocks.len();
        from
    }

    /// The slot (block * block_size + offset) that holds token position `pos`.
    #[inline]
    pub fn slot(&self, pos: usize, block_size: usize) -> i64 {
        (self.blocks[block_index(pos, block_size)] as usize * block_size + block_offset(pos, block_size)) as i64
    }

    /// Blocks to add so that `extra_tokens` more tokens fit (copy-on-write not counted).
    #[inline]
    pub fn new_blocks_for(&self, extra_tokens: usize, block_size: usize) -> usize {
        block_index(self.num_tokens + extra_tokens + block_size - 1, block_size) - self.blocks.len()
    }

    /// Whether the next token goes into the existing, partially filled last block.
    #[inline]
    pub fn last_block_partial(&self, block_size: usize) -> bool {
        block_offset(self.num_tokens, block_size) != 0
    }
}

// Token position -> (block, offset). Block sizes are powers of two (checked by the block
// manager and the config), so a shift and a mask replace two 64-bit divisions on the per-token path.
#[inline]
pub fn block_index(pos: usize, block_size: usize) -> usize {
    debug_assert!(block_size.is_power_of_two());
    pos >> block_size.trailing_zeros()
}

#[inline]
pub fn block_offset(pos: usize, block_size: usize) -> usize {
    debug_assert!(block_size.is_power_of_two());
    pos & (block_size - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_and_growth() {
        let mut table = BlockTable::new(None);
        table.blocks = vec![7, 3];
        table.num_tokens = 5;
        assert_eq!(table.slot(0, 4), 28);
        assert_eq!(table.slot(4, 4), 12);
        assert!(table.last_block_partial(4));
        assert_eq!(table.new_blocks_for(3, 4), 0);
        assert_eq!(table.new_blocks_for(4, 4), 1);
        assert_eq!(table.new_blocks_for(12, 4), 3);
    }

    #[test]
    fn block_index_and_offset_for_power_of_two_block_sizes() {
        for block_size in [1, 2, 4, 16, 32, 128] {
            for pos in 0..200 {
                assert_eq!(block_index(pos, block_size), pos / block_size);
                assert_eq!(block_offset(pos, block_size), pos % block_size);
            }
        }
    }
}

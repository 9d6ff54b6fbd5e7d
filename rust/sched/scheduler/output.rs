//! What a step hands the model runner: one `ScheduledSequence` per sequence with its work, the
//! step's flat token, slot and block-table arrays, the copies to run, and the persistent-batch
//! rows the sequences keep from step to step.

use super::*;

/// One sequence's work in a step: compute KV for tokens[start..end]. Its token ids, slot mapping
/// and block-table update live in the output's flat arrays (see the `SchedulerOutput` accessors),
/// so a step allocates a handful of vectors, not three per sequence.
///
/// Block tables are reported as changes, the way a persistent batch consumes them: blocks
/// `block_table_from..num_blocks` of the sequence's table are `out.block_table_update(seq)`
/// (with several KV-cache groups, that range of every group's table, group after group), and
/// blocks before `block_table_from` are what earlier steps reported. The first time a sequence
/// is scheduled (and after a fork, swap-in or recompute) that is the whole table; in steady decode
/// it is one block every `block_size` steps, or the last block after a copy-on-write. A consumer
/// keeps one table per sequence and applies `table.truncate(from); table.extend(update)`; the
/// whole current table is also `Scheduler::block_table(seq_id)`.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduledSequence {
    /// The sequence; `Scheduler::request_id` names its request. (No request id here: cloning an
    /// `Arc<str>` per sequence per step costs two atomic operations on the decode hot path.)
    pub seq_id: SeqId,
    pub is_prefill: bool,
    pub start: usize,
    pub end: usize,
    /// Whether this step yields the sequence's next token (a decode, or the last prefill chunk).
    pub sample: bool,
    pub token_range: Range<usize>,
    /// First logical block reported in this step (see the type's doc).
    pub block_table_from: usize,
    /// Blocks in each of the sequence's tables after this step.
    pub num_blocks: usize,
    /// Range of this sequence's update in `SchedulerOutput::block_table_updates` (every KV-cache
    /// group's `num_blocks - block_table_from` blocks, in group order).
    pub block_range: Range<usize>,
    /// The sequence's persistent-batch row: kept from its first step on the device until it
    /// leaves the device (finished, preempted, aborted), then reused. A sequence that takes a
    /// row reports its whole table (`block_table_from` 0), so a row's previous content never leaks.
    pub row: u32,
}

impl ScheduledSequence {
    /// Tokens in the KV cache after this step.
    pub fn context_len(&self) -> usize {
        self.end
    }
}

/// Everything the model runner must do for one step. Prefills come before decodes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerOutput {
    pub scheduled: Vec<ScheduledSequence>,
    /// All scheduled token ids, back to back in `scheduled` order (`token_range` of each sequence).
    pub token_ids: Vec<u32>,
    /// Destination slot (block * block_size + offset) of each token in `token_ids`, for each
    /// KV-cache group in turn: group g's slots are `slot_mapping[g * T..(g + 1) * T]` (T tokens).
    pub slot_mapping: Vec<i64>,
    /// KV-cache groups (`BlockManager::set_kv_groups`): each sequence has a table per group.
    pub num_kv_groups: usize,
    /// All block-table updates, back to back (`block_range` of each sequence).
    pub block_table_updates: Vec<u32>,
    pub blocks_to_swap_in: Vec<BlockCopy>,
    pub blocks_to_swap_out: Vec<BlockCopy>,
    pub blocks_to_copy: Vec<BlockCopy>,
    /// Requests preempted in this step (their sequences are not in `scheduled`).
    pub preempted: Vec<Arc<str>>,
    /// Requests dropped because they cannot run even alone on the empty device pool (e.g. n
    /// beams grown too long), with the reason for each in `abort_reasons`.
    pub aborted: Vec<Arc<str>>,
    pub abort_reasons: Vec<String>,
    pub num_batched_tokens: usize,
    pub num_prefix_hit_tokens: usize,
}

impl SchedulerOutput {
    /// An empty step of a scheduler with `num_kv_groups` KV-cache groups.
    pub fn new(num_kv_groups: usize) -> Self {
        SchedulerOutput { num_kv_groups, ..Default::default() }
    }

    pub fn token_ids(&self, seq: &ScheduledSequence) -> &[u32] {
        &self.token_ids[seq.token_range.clone()]
    }

    /// The sequence's token slots in KV-cache group `group`'s blocks.
    pub fn slot_mapping(&self, seq: &ScheduledSequence, group: usize) -> &[i64] {
        let offset = group * self.token_ids.len();
        &self.slot_mapping[offset + seq.token_range.start..offset + seq.token_range.end]
    }

    /// Blocks `seq.block_table_from..seq.num_blocks` of the sequence's tables, group after group.
    pub fn block_table_update(&self, seq: &ScheduledSequence) -> &[u32] {
        &self.block_table_updates[seq.block_range.clone()]
    }

    /// Rows of a persistent batch's tables (`tables.len() / width`, all KV-cache groups) per group.
    fn rows_per_group(&self, tables_len: usize, width: usize) -> usize {
        tables_len.checked_div(width).unwrap_or(0) / self.num_kv_groups.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty() && self.blocks_to_swap_out.is_empty()
    }

    /// Writes each sequence's block-table update into a persistent batch's tables, `width`
    /// blocks a row (row `seq.row`, blocks from `block_table_from` on). With several KV-cache
    /// groups the tables are the groups' tables one after another (group g's row r is row
    /// `g * rows_per_group + r`). Checks first: a row or a table that does not fit writes nothing.
    pub fn write_block_tables(&self, tables: &mut [i32], width: usize) -> Result<()> {
        let num_rows = self.rows_per_group(tables.len(), width);
        if let Some(seq) = self.scheduled.iter().find(|seq| seq.row as usize >= num_rows || seq.num_blocks > width) {
            return Err(Error::InvalidState(format!(
                "sequence {} (row {}, {} blocks) does not fit block tables of {num_rows} rows x {width} blocks",
                seq.seq_id, seq.row, seq.num_blocks
            )));
        }
        for seq in &self.scheduled {
            let update_len = seq.num_blocks - seq.block_table_from;
            if update_len == 0 {
                continue;
            }
            for (group, update) in self.block_table_update(seq).chunks_exact(update_len).enumerate() {
                let start = (group * num_rows + seq.row as usize) * width + seq.block_table_from;
                for (slot, &block) in tables[start..start + update_len].iter_mut().zip(update) {
                    *slot = block as i32;
                }
            }
        }
        Ok(())
    }

    /// The scheduled sequences' tables, in `scheduled` order, from a persistent batch's tables
    /// (`width` blocks a row): `out` holds `num_blocks` blocks per sequence (blocks past a
    /// sequence's own are whatever its row holds there), each KV-cache group's sequences after
    /// the previous group's.
    pub fn gather_block_tables(&self, tables: &[i32], width: usize, out: &mut [i32], num_blocks: usize) -> Result<()> {
        let num_rows = self.rows_per_group(tables.len(), width);
        let num_groups = self.num_kv_groups.max(1);
        if num_blocks > width || out.len() != num_groups * self.scheduled.len() * num_blocks {
            return Err(Error::InvalidState(format!(
                "{num_blocks} blocks for {} sequences in {num_groups} KV-cache groups do not fit an output of {} \
                 blocks from rows of {width}",
                self.scheduled.len(),
                out.len()
            )));
        }
        if let Some(seq) = self.scheduled.iter().find(|seq| seq.row as usize >= num_rows) {
            return Err(Error::InvalidState(format!(
                "sequence {} has row {}, past the {num_rows} rows of the tables",
                seq.seq_id, seq.row
            )));
        }
        if num_blocks == 0 {
            return Ok(());
        }
        for (index, out) in out.chunks_exact_mut(num_blocks).enumerate() {
            let (group, seq) = (index / self.scheduled.len(), &self.scheduled[index % self.scheduled.len()]);
            let start = (group * num_rows + seq.row as usize) * width;
            out.copy_from_slice(&tables[start..start + num_blocks]);
        }
        Ok(())
    }

    /// Sequences are recorded as they are planned, decodes among prefills; the flat arrays then
    /// follow `scheduled` (prefills first), so each sequence's tokens come after the previous one's.
    pub(super) fn put_flat_arrays_in_scheduled_order(&mut self) {
        let (mut token_ids, mut slot_mapping, mut updates) =
            (Vec::with_capacity(self.token_ids.len()), Vec::with_capacity(self.slot_mapping.len()), Vec::new());
        for seq in self.scheduled.iter_mut() {
            let tokens = token_ids.len()..token_ids.len() + seq.token_range.len();
            token_ids.extend_from_slice(&self.token_ids[seq.token_range.clone()]);
            let groups = self.num_kv_groups.max(1);
            slot_mapping
                .extend_from_slice(&self.slot_mapping[seq.token_range.start * groups..seq.token_range.end * groups]);
            seq.token_range = tokens;
            let blocks = updates.len()..updates.len() + seq.block_range.len();
            updates.extend_from_slice(&self.block_table_updates[seq.block_range.clone()]);
            seq.block_range = blocks;
        }
        (self.token_ids, self.slot_mapping, self.block_table_updates) = (token_ids, slot_mapping, updates);
    }

    /// Appends one sequence's new tokens, their slots, its copy-on-write copies and its block-table
    /// update (positions `start..start + tokens.len()`); returns its entry for `scheduled`. Slots
    /// are booked token by token, each token's in every KV-cache group (`finish_slot_mapping`
    /// puts them group after group).
    #[inline(always)] // into the decode path, where most arguments are constants
    #[allow(clippy::too_many_arguments)]
    pub(super) fn record(
        &mut self,
        work: SequenceWork,
        tokens: &[u32],
        slots: &StepSlots<'_>,
        block_size: usize,
    ) -> ScheduledSequence {
        let SequenceWork { seq_id, start, is_prefill, sample, row } = work;
        if !slots.copies.is_empty() {
            self.blocks_to_copy.extend_from_slice(slots.copies);
        }
        let end = start + tokens.len();
        let token_range = self.token_ids.len()..self.token_ids.len() + tokens.len();
        let update_start = self.block_table_updates.len();
        match (tokens, slots.tables) {
            // A decode in one group (the hot path): no slice-copy or iterator set-up.
            ([token], [table]) => {
                self.token_ids.push(*token);
                self.slot_mapping.push(table.slot(start, block_size));
                if slots.table_from < table.blocks.len() {
                    self.block_table_updates.extend_from_slice(&table.blocks[slots.table_from..]);
                }
            }
            _ => {
                self.token_ids.extend_from_slice(tokens);
                for pos in start..end {
                    self.slot_mapping.extend(slots.tables.iter().map(|table| table.slot(pos, block_size)));
                }
                for table in slots.tables {
                    self.block_table_updates.extend_from_slice(&table.blocks[slots.table_from..]);
                }
            }
        }
        let num_blocks = slots.tables[0].blocks.len();
        ScheduledSequence {
            seq_id,
            is_prefill,
            start,
            end,
            sample,
            token_range,
            block_table_from: slots.table_from,
            num_blocks,
            block_range: update_start..self.block_table_updates.len(),
            row,
        }
    }

    /// Puts the step's slots group after group (they are booked token by token: `record`).
    pub(super) fn finish_slot_mapping(&mut self) {
        let groups = self.num_kv_groups;
        if groups <= 1 {
            return;
        }
        let num_tokens = self.token_ids.len();
        let mut by_group = vec![0i64; self.slot_mapping.len()];
        for (token, slots) in self.slot_mapping.chunks_exact(groups).enumerate() {
            for (group, &slot) in slots.iter().enumerate() {
                by_group[group * num_tokens + token] = slot;
            }
        }
        self.slot_mapping = by_group;
    }
}

/// One sequence's work in a step, as `SchedulerOutput::record` books it: tokens from `start` on,
/// a prefill or a decode, whether the step samples its next token, its persistent-batch row.
pub(super) struct SequenceWork {
    pub seq_id: SeqId,
    pub start: usize,
    pub is_prefill: bool,
    pub sample: bool,
    pub row: u32,
}

/// Persistent-batch rows (`ScheduledSequence::row`): the lowest numbers in use, a freed one is
/// taken again first.
#[derive(Debug, Default)]
pub(super) struct Rows {
    free: Vec<u32>,
    num_rows: u32,
}

impl Rows {
    pub(super) fn take(&mut self) -> u32 {
        self.free.pop().unwrap_or_else(|| {
            self.num_rows += 1;
            self.num_rows - 1
        })
    }

    pub(super) fn give_back(&mut self, row: &mut Option<u32>) {
        if let Some(row) = row.take() {
            self.free.push(row);
        }
    }
}

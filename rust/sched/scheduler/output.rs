//! What a step hands the model runner: one `ScheduledSequence` per sequence with its work, the
//! step's flat token, slot and block-table arrays, the copies to run, and the persistent-batch
//! rows the sequences keep from step to step.

use super::*;

/// One sequence's work in a step: compute KV for tokens[start..end]. Its token ids, slot mapping
/// and block-table update live in the output's flat arrays (see the `SchedulerOutput` accessors),
/// so a step allocates a handful of vectors, not three per sequence.
///
/// Block tables are reported as changes, the way a persistent batch consumes them: blocks
/// `block_table_from..num_blocks` of the sequence's table are `out.block_table_update(seq)`, and
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
    /// Range of this sequence's update in `SchedulerOutput::block_table_updates`.
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

    /// Blocks in the sequence's table after this step.
    pub fn num_blocks(&self) -> usize {
        self.block_table_from + self.block_range.len()
    }
}

/// Everything the model runner must do for one step. Prefills come before decodes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerOutput {
    pub scheduled: Vec<ScheduledSequence>,
    /// All scheduled token ids, back to back in `scheduled` order (`token_range` of each sequence).
    pub token_ids: Vec<u32>,
    /// Destination slot (block * block_size + offset) of each token in `token_ids`.
    pub slot_mapping: Vec<i64>,
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
    pub fn token_ids(&self, seq: &ScheduledSequence) -> &[u32] {
        &self.token_ids[seq.token_range.clone()]
    }

    pub fn slot_mapping(&self, seq: &ScheduledSequence) -> &[i64] {
        &self.slot_mapping[seq.token_range.clone()]
    }

    /// Blocks `seq.block_table_from..seq.num_blocks()` of the sequence's table.
    pub fn block_table_update(&self, seq: &ScheduledSequence) -> &[u32] {
        &self.block_table_updates[seq.block_range.clone()]
    }

    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty() && self.blocks_to_swap_out.is_empty()
    }

    /// Writes each sequence's block-table update into a persistent batch's tables, `width`
    /// blocks a row (row `seq.row`, blocks from `block_table_from` on). Checks first: a row or
    /// a table that does not fit writes nothing.
    pub fn write_block_tables(&self, tables: &mut [i32], width: usize) -> Result<()> {
        let num_rows = tables.len().checked_div(width).unwrap_or(0);
        if let Some(seq) = self.scheduled.iter().find(|seq| seq.row as usize >= num_rows || seq.num_blocks() > width) {
            return Err(Error::InvalidState(format!(
                "sequence {} (row {}, {} blocks) does not fit block tables of {num_rows} rows x {width} blocks",
                seq.seq_id,
                seq.row,
                seq.num_blocks()
            )));
        }
        for seq in &self.scheduled {
            let start = seq.row as usize * width + seq.block_table_from;
            for (slot, &block) in
                tables[start..start + seq.block_range.len()].iter_mut().zip(self.block_table_update(seq))
            {
                *slot = block as i32;
            }
        }
        Ok(())
    }

    /// The scheduled sequences' tables, in `scheduled` order, from a persistent batch's tables
    /// (`width` blocks a row): `out` holds `num_blocks` blocks per sequence (blocks past a
    /// sequence's own are whatever its row holds there).
    pub fn gather_block_tables(&self, tables: &[i32], width: usize, out: &mut [i32], num_blocks: usize) -> Result<()> {
        let num_rows = tables.len().checked_div(width).unwrap_or(0);
        if num_blocks > width || out.len() != self.scheduled.len() * num_blocks {
            return Err(Error::InvalidState(format!(
                "{num_blocks} blocks for {} sequences do not fit an output of {} blocks from rows of {width}",
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
        for (seq, out) in self.scheduled.iter().zip(out.chunks_exact_mut(num_blocks)) {
            let start = seq.row as usize * width;
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
            slot_mapping.extend_from_slice(&self.slot_mapping[seq.token_range.clone()]);
            seq.token_range = tokens;
            let blocks = updates.len()..updates.len() + seq.block_range.len();
            updates.extend_from_slice(&self.block_table_updates[seq.block_range.clone()]);
            seq.block_range = blocks;
        }
        (self.token_ids, self.slot_mapping, self.block_table_updates) = (token_ids, slot_mapping, updates);
    }

    /// Appends one sequence's new tokens, their slots, its copy-on-write copy and its block-table
    /// update (positions `start..start + tokens.len()`); returns its entry for `scheduled`.
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
        if let Some(copy) = slots.copy {
            self.blocks_to_copy.push(copy);
        }
        let end = start + tokens.len();
        let token_range = self.token_ids.len()..self.token_ids.len() + tokens.len();
        if let [token] = tokens {
            // A decode (the hot path): no slice-copy or iterator set-up for a single element.
            self.token_ids.push(*token);
            self.slot_mapping.push(slots.table.slot(start, block_size));
        } else {
            self.token_ids.extend_from_slice(tokens);
            self.slot_mapping.extend((start..end).map(|pos| slots.table.slot(pos, block_size)));
        }
        let update = &slots.table.blocks[slots.table_from..];
        let block_range = self.block_table_updates.len()..self.block_table_updates.len() + update.len();
        self.block_table_updates.extend_from_slice(update);
        ScheduledSequence {
            seq_id,
            is_prefill,
            start,
            end,
            sample,
            token_range,
            block_table_from: slots.table_from,
            block_range,
            row,
        }
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

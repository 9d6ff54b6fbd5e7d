//! Continuous batching under a token budget: running decodes first, then queued groups (swapped
//! ones back in, waiting prefills chunked into what is left of the budget) in queue order. Groups
//! that cannot grow preempt the last running group by swap or recompute. Every queue is ordered
//! by `SequenceGroup::order`: arrival under FCFS, (priority, arrival) under the priority policy,
//! where a queued group that cannot start also preempts running groups of lower priority.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use rustc_hash::FxHashMap as HashMap;
use slab::Slab;

use crate::errors::{Error, Result};
use crate::kv::block_manager::{BlockCopy, BlockManager, SeqId, StepSlots};
use crate::kv::events::KvEvent;
use crate::sched::config::{SchedulerConfig, SchedulingPolicy};
use crate::sched::preemption::Preemption;
use crate::sched::sequence::{GroupState, PendingTable, SeqStatus, Sequence, SequenceGroup};

/// The token id `append_placeholders` appends for a token still being sampled (no vocabulary
/// reaches it; prompts holding it are refused).
pub const PLACEHOLDER_TOKEN: u32 = u32::MAX;

/// A group's key in the scheduler's slab (reused after the group ends; never exposed).
type GroupId = usize;

/// One sequence's share of a group's step: `take` tokens to compute for `group.seqs[index]`.
#[derive(Debug, Clone, Copy)]
struct Planned {
    index: usize,
    seq: SeqId,
    take: usize,
}

/// A group's plan; one buffer is reused for every group of a step.
type Plan = Vec<Planned>;

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
    fn put_flat_arrays_in_scheduled_order(&mut self) {
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
    fn record(
        &mut self,
        seq_id: SeqId,
        is_prefill: bool,
        start: usize,
        tokens: &[u32],
        slots: &StepSlots<'_>,
        block_size: usize,
        sample: bool,
        row: u32,
    ) -> ScheduledSequence {
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

/// Persistent-batch rows (`ScheduledSequence::row`): the lowest numbers in use, a freed one is
/// taken again first.
#[derive(Debug, Default)]
struct Rows {
    free: Vec<u32>,
    num_rows: u32,
}

impl Rows {
    fn take(&mut self) -> u32 {
        self.free.pop().unwrap_or_else(|| {
            self.num_rows += 1;
            self.num_rows - 1
        })
    }

    fn give_back(&mut self, row: &mut Option<u32>) {
        if let Some(row) = row.take() {
            self.free.push(row);
        }
    }
}

/// Counters and gauges at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerStats {
    pub num_device_blocks: usize,
    pub num_free_device_blocks: usize,
    pub num_cached_device_blocks: usize,
    pub num_cpu_blocks: usize,
    /// Free CPU blocks holding evicted prefix blocks (the CPU prefix tier).
    pub num_cached_cpu_blocks: usize,
    pub num_free_cpu_blocks: usize,
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_swapped: usize,
    pub num_running_seqs: usize,
    pub num_preemptions_swap: u64,
    pub num_preemptions_recompute: u64,
    pub num_blocks_swapped_in: u64,
    pub num_blocks_swapped_out: u64,
    pub num_blocks_copied: u64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Evicted prefix blocks copied to the CPU tier, and tier hits copied back.
    pub num_blocks_offloaded: u64,
    pub cpu_prefix_cache_hits: u64,
    pub num_steps: u64,
}

#[derive(Debug, Default)]
struct Counters {
    preemptions_swap: u64,
    preemptions_recompute: u64,
    blocks_swapped_in: u64,
    blocks_swapped_out: u64,
    blocks_copied: u64,
    steps: u64,
}

/// The scheduler: owns the block manager, the sequence groups and the three queues.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    max_model_len: usize,
    blocks: BlockManager,
    /// Slab, not a map: the decode hot path indexes it once per group, with no hashing.
    groups: Slab<SequenceGroup>,
    group_by_request: HashMap<Arc<str>, GroupId>,
    group_by_seq: HashMap<SeqId, GroupId>,
    /// All three ordered by `SequenceGroup::order`; preemption victims come from the back of `running`.
    waiting: VecDeque<GroupId>,
    running: VecDeque<GroupId>,
    swapped: VecDeque<GroupId>,
    next_arrival: u64,
    next_seq: SeqId,
    rows: Rows,
    counters: Counters,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        let mut blocks = BlockManager::new(
            config.num_device_blocks,
            config.num_cpu_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.watermark,
        )?;
        if config.enable_cpu_prefix_cache {
            blocks.enable_cpu_prefix_cache()?;
        }
        blocks.set_sliding_window(config.sliding_window);
        blocks.set_hash_seed(config.prefix_caching_hash_seed)?;
        if config.enable_kv_events {
            blocks.enable_kv_events()?;
        }
        Ok(Scheduler {
            max_model_len: config.effective_max_model_len(),
            config,
            blocks,
            groups: Slab::new(),
            group_by_request: HashMap::default(),
            group_by_seq: HashMap::default(),
            waiting: VecDeque::new(),
            running: VecDeque::new(),
            swapped: VecDeque::new(),
            next_arrival: 0,
            next_seq: 0,
            rows: Rows::default(),
            counters: Counters::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The longest sequence this scheduler serves (see `SchedulerConfig::effective_max_model_len`).
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    pub fn block_manager(&self) -> &BlockManager {
        &self.blocks
    }

    pub fn has_unfinished(&self) -> bool {
        !self.groups.is_empty()
    }

    /// Forgets every cached prefix (see `BlockManager::reset_prefix_cache`); false while any
    /// request is unfinished.
    pub fn reset_prefix_cache(&mut self) -> bool {
        !self.has_unfinished() && self.blocks.reset_prefix_cache()
    }

    /// The KV-cache events since the last call, oldest first (`enable_kv_events`): take them once
    /// per step, after `schedule` and `update`, and hand them to the consumers in this order.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.blocks.take_kv_events()
    }

    pub fn num_unfinished(&self) -> usize {
        self.groups.len()
    }

    /// Queues a request. Fails at once, changing nothing, when the prompt can never be served
    /// (`PromptTooLong`, `PromptExceedsPool`) or the waiting queue is full (`Overloaded`).
    /// Returns the id of the request's first sequence.
    pub fn add_request(&mut self, request_id: &str, prompt: Vec<u32>, extra_key: Option<u64>) -> Result<SeqId> {
        self.add_request_with_priority(request_id, prompt, extra_key, 0)
    }

    /// `add_request` with a priority: smaller is served first (the priority policy only; under
    /// FCFS any priority but 0 is an `InvalidConfig` error, as in vLLM).
    pub fn add_request_with_priority(
        &mut self,
        request_id: &str,
        prompt: Vec<u32>,
        extra_key: Option<u64>,
        priority: i64,
    ) -> Result<SeqId> {
        if priority != 0 && self.config.scheduling_policy != SchedulingPolicy::Priority {
            return Err(Error::InvalidConfig {
                field: "priority",
                message: format!(
                    "got {priority}, but priorities need scheduling_policy='priority' (this scheduler is 'fcfs')"
                ),
            });
        }
        if self.group_by_request.contains_key(request_id) {
            return Err(Error::DuplicateRequest(request_id.to_string()));
        }
        if prompt.is_empty() {
            return Err(Error::InvalidState("prompt must contain at least one token".into()));
        }
        if prompt.contains(&PLACEHOLDER_TOKEN) {
            return Err(Error::InvalidState(format!("prompt holds token id {PLACEHOLDER_TOKEN}, the placeholder")));
        }
        if prompt.len() > self.config.max_model_len {
            return Err(Error::PromptTooLong { prompt_len: prompt.len(), max_model_len: self.config.max_model_len });
        }
        if prompt.len() > self.max_model_len {
            // Fits max_model_len but not the pool: name the pool, which is the real limit.
            return Err(Error::PromptExceedsPool {
                blocks_needed: self.blocks.blocks_for_tokens(prompt.len()),
                num_device_blocks: self.config.num_device_blocks,
                block_size: self.config.block_size,
            });
        }
        if self.waiting.len() >= self.config.max_waiting_requests {
            return Err(Error::Overloaded {
                num_waiting: self.waiting.len(),
                max_waiting_requests: self.config.max_waiting_requests,
            });
        }
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let seq_id = self.new_seq_id();
        let request_id: Arc<str> = Arc::from(request_id);
        let group = SequenceGroup {
            request_id: request_id.clone(),
            arrival,
            priority,
            extra_key,
            num_prompt_tokens: prompt.len(),
            seqs: smallvec::smallvec![Sequence::new(seq_id, prompt)],
            state: GroupState::Waiting,
            num_prefix_hit_tokens: 0,
            num_preemptions: 0,
            rebuilding: false,
        };
        let group_id = self.groups.insert(group);
        self.group_by_request.insert(request_id, group_id);
        self.group_by_seq.insert(seq_id, group_id);
        enqueue(&mut self.waiting, &self.groups, group_id);
        Ok(seq_id)
    }

    fn new_seq_id(&mut self) -> SeqId {
        let id = self.next_seq;
        self.next_seq += 1;
        id
    }

    fn group_of_seq(&self, seq_id: SeqId) -> Result<GroupId> {
        self.group_by_seq.get(&seq_id).copied().ok_or(Error::UnknownSequence(seq_id))
    }

    /// The sampled token of a sequence that had `sample = true` in the last step.
    pub fn append_token(&mut self, seq_id: SeqId, token: u32) -> Result<()> {
        self.append_token_with_drafts(seq_id, token, &[])
    }

    /// `append_token`, then speculative `drafts` after it: the next step computes them all in one
    /// multi-token decode (never split across steps), and `accept_drafts` keeps the verified ones.
    pub fn append_token_with_drafts(&mut self, seq_id: SeqId, token: u32, drafts: &[u32]) -> Result<()> {
        let group_id = self.group_of_seq(seq_id)?;
        let max_model_len = self.max_model_len;
        if 1 + drafts.len() > self.config.max_num_batched_tokens {
            return Err(Error::InvalidState(format!(
                "{} drafts do not fit max_num_batched_tokens={}",
                drafts.len(),
                self.config.max_num_batched_tokens
            )));
        }
        let group = &mut self.groups[group_id];
        if group.state != GroupState::Running {
            return Err(Error::InvalidState(format!("sequence {seq_id} is not running")));
        }
        let seq = group.seq_mut(seq_id).unwrap();
        if !seq.is_active() {
            return Err(Error::InvalidState(format!("sequence {seq_id} is finished")));
        }
        if seq.num_computed != seq.len() {
            return Err(Error::InvalidState(format!(
                "sequence {seq_id} has {} tokens without KV; it was not sampled in the last step",
                seq.num_uncomputed()
            )));
        }
        if seq.len() + 1 + drafts.len() > max_model_len {
            return Err(Error::InvalidState(format!(
                "sequence {seq_id} has {} tokens: {} more exceed max_model_len={max_model_len}",
                seq.len(),
                1 + drafts.len()
            )));
        }
        seq.tokens.push(token);
        seq.tokens.extend_from_slice(drafts);
        seq.num_draft = drafts.len();
        Ok(())
    }

    /// Closes a step in one call: appends `appends` (sequence, sampled token), then ends the
    /// `finished` sequences. Everything is checked first (known, running, sampled in the last
    /// step, so each at most once), and an error changes nothing. Speculative drafts and forks
    /// keep their own calls (`append_token_with_drafts`, `fork`).
    pub fn update(&mut self, appends: &[(SeqId, u32)], finished: &[SeqId]) -> Result<()> {
        for &seq_id in finished {
            self.group_of_seq(seq_id)?;
            if appends.iter().any(|&(appended, _)| appended == seq_id) {
                return Err(Error::InvalidState(format!("sequence {seq_id} is both appended to and finished")));
            }
        }
        // Each append checks its sequence (a second token for one fails: the first has no KV
        // yet); on an error the tokens appended so far are taken back.
        for (index, &(seq_id, token)) in appends.iter().enumerate() {
            if let Err(error) = self.append_token(seq_id, token) {
                for &(appended, _) in &appends[..index] {
                    let group_id = self.group_by_seq[&appended];
                    self.groups[group_id].seq_mut(appended).unwrap().tokens.pop();
                }
                return Err(error);
            }
        }
        for &seq_id in finished {
            self.finish_sequence(seq_id)?;
        }
        Ok(())
    }

    /// Asynchronous scheduling: appends a placeholder (`PLACEHOLDER_TOKEN`) to each sequence in
    /// place of the token its last step is still sampling on the device, so the next step can be
    /// planned before that token is known (its consumer reads the token from the device).
    /// `fill_placeholders` later writes the real tokens. Checked as `update`: an error changes
    /// nothing.
    pub fn append_placeholders(&mut self, seq_ids: &[SeqId]) -> Result<()> {
        let appends: Vec<(SeqId, u32)> = seq_ids.iter().map(|&seq_id| (seq_id, PLACEHOLDER_TOKEN)).collect();
        self.update(&appends, &[])
    }

    /// The sampled tokens that `append_placeholders` stood in for: `tokens[i]` replaces the
    /// placeholder that is the last token of `seq_ids[i]`, in whatever state the sequence is
    /// (running, swapped out, or waiting to be recomputed). A block that the placeholder filled is
    /// hashed again, so the prefix cache holds it under its real content. Everything is checked
    /// first: an error changes nothing.
    pub fn fill_placeholders(&mut self, seq_ids: &[SeqId], tokens: &[u32]) -> Result<()> {
        if seq_ids.len() != tokens.len() {
            return Err(Error::InvalidState(format!("{} seq_ids but {} tokens", seq_ids.len(), tokens.len())));
        }
        for (index, (&seq_id, &token)) in seq_ids.iter().zip(tokens).enumerate() {
            let group_id = self.group_of_seq(seq_id)?;
            let seq = self.groups[group_id].seq(seq_id).unwrap();
            if seq.tokens.last() != Some(&PLACEHOLDER_TOKEN) {
                return Err(Error::InvalidState(format!("sequence {seq_id} does not end in a placeholder")));
            }
            if token == PLACEHOLDER_TOKEN {
                return Err(Error::InvalidState(format!("token id {token} is the placeholder")));
            }
            if seq_ids[..index].contains(&seq_id) {
                return Err(Error::InvalidState(format!("sequence {seq_id} is filled twice")));
            }
        }
        for (&seq_id, &token) in seq_ids.iter().zip(tokens) {
            let group_id = self.group_by_seq[&seq_id];
            let seq = self.groups[group_id].seq_mut(seq_id).unwrap();
            let position = seq.tokens.len() - 1;
            seq.tokens[position] = token;
            if self.blocks.contains(seq_id) {
                self.blocks.fill_token(seq_id, position, &seq.tokens)?;
            }
        }
        Ok(())
    }

    /// After the step that computed a sequence's drafts: keeps the first `num_accepted` of them and
    /// drops the rest, with their KV slots (`BlockManager::truncate`). The next token then comes
    /// from `append_token` as usual.
    pub fn accept_drafts(&mut self, seq_id: SeqId, num_accepted: usize) -> Result<()> {
        let group_id = self.group_of_seq(seq_id)?;
        let group = &mut self.groups[group_id];
        if group.state != GroupState::Running {
            return Err(Error::InvalidState(format!("sequence {seq_id} is not running")));
        }
        let seq = group.seq_mut(seq_id).unwrap();
        if num_accepted > seq.num_draft || seq.num_computed != seq.len() {
            return Err(Error::InvalidState(format!(
                "sequence {seq_id}: cannot accept {num_accepted} of {} drafts with {} tokens not computed",
                seq.num_draft,
                seq.num_uncomputed()
            )));
        }
        let new_len = seq.len() - (seq.num_draft - num_accepted);
        self.blocks.truncate(seq_id, &seq.tokens[..new_len])?;
        seq.tokens.truncate(new_len);
        seq.num_computed = new_len;
        seq.num_draft = 0;
        Ok(())
    }

    /// A new sequence in the same group sharing every block of `parent` (n > 1, beam search).
    pub fn fork(&mut self, parent: SeqId) -> Result<SeqId> {
        let group_id = self.group_of_seq(parent)?;
        let child = self.new_seq_id();
        let group = &mut self.groups[group_id];
        if group.state != GroupState::Running {
            return Err(Error::InvalidState(format!("sequence {parent} is not running")));
        }
        let parent_seq = group.seq(parent).unwrap();
        if !parent_seq.is_active() {
            return Err(Error::InvalidState(format!("sequence {parent} is finished")));
        }
        if parent_seq.in_prefill() || group.rebuilding {
            return Err(Error::InvalidState(format!(
                "sequence {parent} has not sampled since its prefill; fork after it does"
            )));
        }
        // A group's sequences decode together: more than a step holds would never run again.
        let limit = self.config.max_num_seqs.min(self.config.max_num_batched_tokens);
        if group.num_active() >= limit {
            return Err(Error::InvalidState(format!(
                "a group of {} sequences exceeds max_num_seqs={} or max_num_batched_tokens={}",
                group.num_active() + 1,
                self.config.max_num_seqs,
                self.config.max_num_batched_tokens
            )));
        }
        let mut seq = parent_seq.clone();
        seq.id = child;
        seq.row = None; // its own row, with its whole table, at its first step
        self.blocks.fork(parent, child)?;
        group.seqs.push(seq);
        self.group_by_seq.insert(child, group_id);
        Ok(child)
    }

    /// Ends one sequence and frees its blocks; the request ends with its last sequence.
    pub fn finish_sequence(&mut self, seq_id: SeqId) -> Result<()> {
        let group_id = self.group_of_seq(seq_id)?;
        let group = &mut self.groups[group_id];
        let seq = group.seq_mut(seq_id).unwrap();
        if seq.status == SeqStatus::Finished {
            return Ok(());
        }
        seq.status = SeqStatus::Finished;
        self.rows.give_back(&mut seq.row);
        self.hand_over_pending(group_id, seq_id);
        if self.blocks.contains(seq_id) {
            self.blocks.free(seq_id)?;
        }
        if self.groups[group_id].num_active() == 0 {
            self.remove_group(group_id);
        }
        Ok(())
    }

    /// Drops a request at once, whatever its state, and frees all its blocks.
    pub fn abort(&mut self, request_id: &str) -> Result<()> {
        let group_id =
            *self.group_by_request.get(request_id).ok_or_else(|| Error::UnknownRequest(request_id.to_string()))?;
        self.free_group_blocks(group_id);
        self.remove_group(group_id);
        Ok(())
    }

    fn free_group_blocks(&mut self, group_id: GroupId) {
        for seq in self.groups[group_id].seqs.iter_mut() {
            self.rows.give_back(&mut seq.row);
            if self.blocks.contains(seq.id) {
                self.blocks.free(seq.id).expect("table exists");
            }
        }
    }

    fn remove_group(&mut self, group_id: GroupId) {
        let group = self.groups.remove(group_id);
        let queue = match group.state {
            GroupState::Waiting => &mut self.waiting,
            GroupState::Running => &mut self.running,
            GroupState::Swapped => &mut self.swapped,
        };
        if let Some(position) = queue.iter().position(|id| *id == group_id) {
            queue.remove(position);
        }
        self.group_by_request.remove(&group.request_id);
        for seq in &group.seqs {
            self.group_by_seq.remove(&seq.id);
        }
    }

    /// The request a sequence belongs to.
    pub fn request_id(&self, seq_id: SeqId) -> Result<&str> {
        Ok(&self.groups[self.group_of_seq(seq_id)?].request_id)
    }

    /// The sequence's whole current block table (logical block i -> physical block).
    pub fn block_table(&self, seq_id: SeqId) -> Result<&[u32]> {
        Ok(&self.blocks.table(seq_id)?.blocks)
    }

    /// Tokens a sequence holds (prompt + generated).
    pub fn sequence_len(&self, seq_id: SeqId) -> Result<usize> {
        let group = &self.groups[self.group_of_seq(seq_id)?];
        Ok(group.seq(seq_id).unwrap().len())
    }

    /// Plans one step. See the module doc for the order; the returned copies must be executed
    /// (swap-out, then swap-in, then copy) before the step's forward pass writes any KV.
    pub fn schedule(&mut self) -> SchedulerOutput {
        self.counters.steps += 1;
        self.blocks.begin_step();
        let mut out = SchedulerOutput::default();
        let mut budget = self.config.max_num_batched_tokens;
        let expected = self.running.len() + 8;
        out.token_ids.reserve(expected);
        out.slot_mapping.reserve(expected);
        let mut decodes = Vec::with_capacity(expected);
        let mut plan = Plan::with_capacity(8);

        // 0. Priority policy: the first queued group may displace running groups of lower priority.
        if self.config.scheduling_policy == SchedulingPolicy::Priority {
            self.preempt_for_priority(&mut out);
        }

        // 1. Running groups in queue order; make room by preempting from the back.
        let mut preempted_any = false;
        let mut index = 0;
        while index < self.running.len() {
            let group_id = self.running[index];
            if budget > 0 && self.schedule_single_decode(group_id, &mut out, &mut decodes) {
                budget -= 1;
                index += 1;
                continue;
            }
            if self.groups[group_id].rebuilding {
                self.advance_rebuild(group_id);
            }
            self.plan_group(group_id, budget, &mut plan);
            if plan.is_empty() {
                index += 1;
                continue;
            }
            let needed = self.blocks_needed(&plan);
            if needed > self.blocks.num_free_device_blocks() {
                if index + 1 < self.running.len() {
                    let victim = self.running.pop_back().unwrap();
                    self.preempt(victim, &mut out);
                    preempted_any = true;
                    continue; // retry the same group with more free blocks
                }
                // The group is the newest running one: preempt it, unless it is alone on the
                // device and still does not fit, in which case it never will.
                self.running.remove(index);
                if index == 0 {
                    let reason = format!(
                        "its next step needs {needed} more KV blocks, but alone on the device it has only {} free of \
                         num_device_blocks={}",
                        self.blocks.num_free_device_blocks(),
                        self.config.num_device_blocks
                    );
                    self.drop_group(group_id, reason, &mut out);
                } else {
                    self.preempt(group_id, &mut out);
                    preempted_any = true;
                }
                continue;
            }
            budget -= self.execute_plan(group_id, &plan, &mut out, &mut decodes);
            index += 1;
        }

        // 2. Queued groups in queue order (swapped ones back in, waiting ones admitted), if no
        // running group had to be preempted; the first that cannot start stops the rest.
        if !preempted_any {
            while let Some((group_id, swapped)) = self.first_queued() {
                let started = if swapped {
                    self.try_swap_in(group_id, &mut budget, &mut out, &mut decodes, &mut plan)
                } else {
                    self.try_admit(group_id, &mut budget, &mut out, &mut decodes, &mut plan)
                };
                if !started {
                    break;
                }
            }
        }

        // The CPU prefix tier's copies join the swaps (its pins make any order within each safe).
        if self.blocks.cpu_tier().is_enabled() {
            let (offloads, reloads) = self.blocks.take_cpu_tier_copies();
            out.blocks_to_swap_out.extend(offloads);
            out.blocks_to_swap_in.extend(reloads);
        }
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget;
        if out.scheduled.is_empty() {
            out.scheduled = decodes; // steady decode: no prefill to put first, nothing to move
        } else {
            out.scheduled.append(&mut decodes);
            out.put_flat_arrays_in_scheduled_order();
        }
        out
    }

    fn num_running_seqs(&self) -> usize {
        self.running.iter().map(|id| self.groups[*id].num_active()).sum()
    }

    fn insert_running(&mut self, group_id: GroupId) {
        enqueue(&mut self.running, &self.groups, group_id);
    }

    /// The queued group to serve next, and whether it is swapped (else waiting).
    fn first_queued(&self) -> Option<(GroupId, bool)> {
        match (self.swapped.front(), self.waiting.front()) {
            (Some(&swapped), Some(&waiting)) => {
                let swapped_first = self.groups[swapped].order() < self.groups[waiting].order();
                Some(if swapped_first { (swapped, true) } else { (waiting, false) })
            }
            (Some(&swapped), None) => Some((swapped, true)),
            (None, Some(&waiting)) => Some((waiting, false)),
            (None, None) => None,
        }
    }

    /// Swaps a group back in and schedules what fits of it. Returns false, changing nothing, when
    /// the budget, max_num_seqs or the device pool (above the watermark, unless nothing runs) has
    /// no room for it. A group that cannot come back even alone on the empty pool is not left
    /// at the head of the queue: it is rebuilt by recompute instead (returns true).
    fn try_swap_in(
        &mut self,
        group_id: GroupId,
        budget: &mut usize,
        out: &mut SchedulerOutput,
        decodes: &mut Vec<ScheduledSequence>,
        plan: &mut Plan,
    ) -> bool {
        if !self.swapped_group_fits(group_id, *budget, 0) {
            if !self.alone(*budget) {
                return false;
            }
            self.swapped.pop_front();
            self.free_group_blocks(group_id);
            self.requeue_for_recompute(group_id);
            return true;
        }
        let seq_ids = self.groups[group_id].scheduled_seq_ids();
        self.swapped.pop_front();
        let copies = self.blocks.swap_in(&seq_ids).expect("room was checked");
        self.counters.blocks_swapped_in += copies.len() as u64;
        out.blocks_to_swap_in.extend(copies);
        self.groups[group_id].state = GroupState::Running;
        self.insert_running(group_id);
        self.plan_group(group_id, *budget, plan);
        if self.blocks_needed(plan) <= self.blocks.num_free_device_blocks() {
            *budget -= self.execute_plan(group_id, plan, out, decodes);
        }
        true
    }

    /// Whether nothing else can take this step: no running group and the whole budget left. A
    /// queued group that cannot start then can never start as it is.
    fn alone(&self, budget: usize) -> bool {
        self.running.is_empty() && budget == self.config.max_num_batched_tokens
    }

    /// Whether a swapped group can come back and take its next step within `budget`, with
    /// `reserved_blocks` of the free device blocks spoken for.
    fn swapped_group_fits(&self, group_id: GroupId, budget: usize, reserved_blocks: usize) -> bool {
        let group = &self.groups[group_id];
        let mut plan = Plan::new();
        self.plan_group(group_id, budget, &mut plan);
        // (A group being rebuilt may have nothing to compute until its next sequences fork.)
        if (plan.is_empty() && !group.rebuilding)
            || self.num_running_seqs() + group.num_active() > self.config.max_num_seqs
        {
            return false;
        }
        let mut appends: Vec<(SeqId, usize)> = group.scheduled_seqs().map(|seq| (seq.id, 0)).collect();
        for planned in plan.iter() {
            appends.iter_mut().find(|(seq, _)| *seq == planned.seq).unwrap().1 = planned.take;
        }
        let needed = self.blocks.blocks_needed_to_swap_in_group(&appends).expect("swapped tables") + reserved_blocks;
        self.fits_device(needed)
    }

    /// Whether `num_blocks` can be taken from the free device pool for a group that starts: the
    /// watermark stays free for the running groups' growth, unless none runs.
    fn fits_device(&self, num_blocks: usize) -> bool {
        if self.running.is_empty() {
            num_blocks <= self.blocks.num_free_device_blocks()
        } else {
            self.blocks.can_admit(num_blocks)
        }
    }

    /// Admits the first waiting group with its prefix-cache hits and schedules its first chunk.
    /// Returns false when it does not fit now; one that can never fit is dropped (returns true).
    fn try_admit(
        &mut self,
        group_id: GroupId,
        budget: &mut usize,
        out: &mut SchedulerOutput,
        decodes: &mut Vec<ScheduledSequence>,
        plan: &mut Plan,
    ) -> bool {
        if let Some(reason) = self.never_fits(group_id) {
            self.waiting.pop_front();
            self.drop_group(group_id, reason, out);
            return true;
        }
        let admitted_tokens = if *budget == 0
            || self.num_running_seqs() + self.groups[group_id].num_active() > self.config.max_num_seqs
        {
            None
        } else {
            self.plan_admission(group_id, *budget, 0)
        };
        let Some(admitted_tokens) = admitted_tokens else {
            if !self.alone(*budget) {
                return false;
            }
            let reason = format!(
                "it cannot start even alone: {} sequences (max_num_seqs={}), {} free of num_device_blocks={}",
                self.groups[group_id].num_active(),
                self.config.max_num_seqs,
                self.blocks.num_free_device_blocks(),
                self.config.num_device_blocks
            );
            self.waiting.pop_front();
            self.drop_group(group_id, reason, out);
            return true;
        };
        self.waiting.pop_front();
        let mut hit_tokens = 0;
        let group = &mut self.groups[group_id];
        group.state = GroupState::Running;
        for seq in group.seqs.iter_mut().filter(|seq| seq.is_scheduled()) {
            let hits = self
                .blocks
                .allocate_prefix(seq.id, &seq.tokens, group.extra_key)
                .expect("a waiting sequence has no table");
            seq.num_computed = hits;
            hit_tokens += hits;
        }
        group.num_prefix_hit_tokens += hit_tokens;
        out.num_prefix_hit_tokens += hit_tokens;
        self.insert_running(group_id);
        // Hits can only be more than planned (a sibling may have just filled a block).
        self.plan_group(group_id, (*budget).min(admitted_tokens), plan);
        *budget -= self.execute_plan(group_id, plan, out, decodes);
        true
    }

    /// Priority policy (vLLM's priority preemption): while the first queued group could not start
    /// this step and the last running group has a lower priority, preempt that running group.
    /// "Could start" is judged before the running groups take their share of the step: their
    /// outstanding tokens come off the budget and the blocks they will append off the free pool.
    /// A group never displaces one of equal or higher priority, so nothing ping-pongs.
    fn preempt_for_priority(&mut self, out: &mut SchedulerOutput) {
        let Some((candidate, swapped)) = self.first_queued() else {
            return;
        };
        let order = self.groups[candidate].order();
        if self.running.back().is_none_or(|&last| self.groups[last].order() <= order) {
            return; // nobody of lower priority: the common case costs no pass over the running groups
        }
        let (mut running_tokens, mut running_blocks) = (0, 0);
        for &group_id in &self.running {
            let (tokens, blocks) = self.step_demand(group_id);
            running_tokens += tokens;
            running_blocks += blocks;
        }
        while let Some(&victim) = self.running.back() {
            if self.groups[victim].order() <= order {
                break;
            }
            let budget = self.config.max_num_batched_tokens.saturating_sub(running_tokens);
            let fits = if swapped {
                self.swapped_group_fits(candidate, budget, running_blocks)
            } else {
                budget > 0
                    && self.num_running_seqs() + self.groups[candidate].num_active() <= self.config.max_num_seqs
                    && self.plan_admission(candidate, budget, running_blocks).is_some()
            };
            if fits {
                break;
            }
            let (tokens, blocks) = self.step_demand(victim);
            running_tokens -= tokens;
            running_blocks -= blocks;
            self.running.pop_back();
            self.preempt(victim, out);
        }
    }

    /// The tokens a running group has left to compute (at most a step's budget per sequence) and
    /// the device blocks appending them takes.
    fn step_demand(&self, group_id: GroupId) -> (usize, usize) {
        let group = &self.groups[group_id];
        let appends: Vec<(SeqId, usize)> = group
            .scheduled_seqs()
            .map(|seq| {
                let target = self.tokens_to_compute(group, seq);
                (seq.id, target.min(self.config.max_num_batched_tokens).min(self.step_cap(seq.in_prefill())))
            })
            .collect();
        let tokens = appends.iter().map(|(_, take)| take).sum();
        (tokens, self.blocks.blocks_needed_to_append_group(&appends).expect("running tables"))
    }

    /// Most tokens a sequence computes in one step besides the budget: a chunked prefill stops at
    /// long_prefill_token_threshold (where set).
    fn step_cap(&self, in_prefill: bool) -> usize {
        let threshold = self.config.long_prefill_token_threshold;
        if in_prefill && self.config.enable_chunked_prefill && threshold > 0 {
            threshold
        } else {
            usize::MAX
        }
    }

    /// (seq, tokens to compute) for each active sequence of a running group within `budget`.
    /// Decoding sequences of a group are scheduled together or not at all.
    fn plan_group(&self, group_id: GroupId, budget: usize, plan: &mut Plan) {
        plan.clear();
        let group = &self.groups[group_id];
        let mut left = budget;
        for (index, seq) in group.seqs.iter().enumerate().filter(|(_, seq)| seq.is_scheduled()) {
            let target = self.tokens_to_compute(group, seq);
            if target == 0 {
                continue;
            }
            let take = target.min(left).min(self.step_cap(seq.in_prefill()));
            // Only prefills are chunked: a decode with drafts is verified in one forward pass, and
            // the sequences of a group (rebuilt, about to sample again) sample in one step.
            let whole = !self.config.enable_chunked_prefill
                || !seq.in_prefill()
                || (group.num_active() > 1 && !group.rebuilding);
            if take == 0 || (whole && take < target) {
                if group.rebuilding {
                    continue; // nothing samples while rebuilding: this sequence's chunk can wait
                }
                plan.clear();
                return;
            }
            plan.push(Planned { index, seq: seq.id, take });
            left -= take;
        }
    }

    /// Tokens a sequence of a running or swapped group computes next if the budget allows: all it
    /// has not computed, but while its group is rebuilt, not its last token (see `rebuilding`).
    fn tokens_to_compute(&self, group: &SequenceGroup, seq: &Sequence) -> usize {
        if group.rebuilding {
            (seq.len() - 1).saturating_sub(seq.num_computed)
        } else {
            seq.num_uncomputed()
        }
    }

    /// The device blocks the plan takes (single-token decodes of one-sequence groups, the bulk
    /// of a step, take `schedule_single_decode` and never come here).
    fn blocks_needed(&self, plan: &[Planned]) -> usize {
        let appends: Vec<(SeqId, usize)> = plan.iter().map(|planned| (planned.seq, planned.take)).collect();
        self.blocks.blocks_needed_to_append_group(&appends).expect("running tables")
    }

    /// Token budget a waiting group would use now, or None when it does not fit (budget,
    /// blocks above the watermark with `reserved_blocks` of the free ones spoken for, or chunking
    /// disabled and the prompt too long for the budget).
    fn plan_admission(&self, group_id: GroupId, budget: usize, reserved_blocks: usize) -> Option<usize> {
        let group = &self.groups[group_id];
        let mut left = budget;
        let mut blocks = 0;
        for seq in group.scheduled_seqs() {
            let hits = self.blocks.peek_prefix_hits(&seq.tokens, group.extra_key);
            let hit_tokens = hits.blocks() * self.config.block_size;
            let uncomputed = seq.len() - hit_tokens;
            let target = if group.rebuilding { uncomputed - 1 } else { uncomputed };
            let take = target.min(left).min(self.step_cap(true));
            if (take == 0 && target > 0) || (!self.config.enable_chunked_prefill && take < target) {
                return None;
            }
            // Fresh blocks for the chunk and the CPU-tier hits, plus device hits that must be taken
            // off the free list.
            blocks += hits.blocks_taken(self.blocks.blocks_for_tokens(hit_tokens + take));
            left -= take;
        }
        self.fits_device(blocks + reserved_blocks).then_some(budget - left)
    }

    /// The common case on its own short path: a group of one sequence decoding one token.
    /// Returns false, changing nothing, for anything else (including a full device pool, which
    /// the general path answers with preemption).
    fn schedule_single_decode(
        &mut self,
        group_id: GroupId,
        out: &mut SchedulerOutput,
        decodes: &mut Vec<ScheduledSequence>,
    ) -> bool {
        let group = &mut self.groups[group_id];
        let [seq] = group.seqs.as_mut_slice() else {
            return false;
        };
        if !seq.is_active() || seq.num_uncomputed() != 1 || seq.in_prefill() {
            return false;
        }
        let position = seq.num_computed;
        let token = &seq.tokens[position..position + 1];
        let Ok(slots) = self.blocks.append_slots_for_step(seq.id, token) else {
            return false;
        };
        self.counters.blocks_copied += slots.copy.is_some() as u64;
        let row = *seq.row.get_or_insert_with(|| self.rows.take());
        decodes.push(out.record(seq.id, false, position, token, &slots, self.config.block_size, true, row));
        seq.num_computed = position + 1;
        true
    }

    /// Allocates the plan's slots and records it in `out`. Returns the tokens used.
    fn execute_plan(
        &mut self,
        group_id: GroupId,
        plan: &[Planned],
        out: &mut SchedulerOutput,
        decodes: &mut Vec<ScheduledSequence>,
    ) -> usize {
        let block_size = self.config.block_size;
        let group = &mut self.groups[group_id];
        let mut used = 0;
        for &Planned { index, seq: seq_id, take } in plan {
            let seq = &mut group.seqs[index];
            let (start, end) = (seq.num_computed, seq.num_computed + take);
            let is_prefill = seq.in_prefill();
            let new_tokens = &seq.tokens[start..end];
            let slots = self.blocks.append_slots_for_step(seq_id, new_tokens).expect("blocks were checked");
            self.counters.blocks_copied += slots.copy.is_some() as u64;
            let row = *seq.row.get_or_insert_with(|| self.rows.take());
            let scheduled =
                out.record(seq_id, is_prefill, start, new_tokens, &slots, block_size, end == seq.len(), row);
            seq.num_computed = end;
            if is_prefill || take > 1 {
                // Multi-token decodes (drafts) go with the prefills: decodes are one token each.
                out.scheduled.push(scheduled);
            } else {
                decodes.push(scheduled);
            }
            used += take;
        }
        used
    }

    /// Takes a running group off the device: swap or recompute by the configured policy and cost.
    fn preempt(&mut self, group_id: GroupId, out: &mut SchedulerOutput) {
        let group = &self.groups[group_id];
        let seq_ids = group.scheduled_seq_ids();
        let num_blocks = self.blocks.num_unique_blocks(&seq_ids).expect("running tables");
        let num_tokens: usize = group.active_seqs().map(Sequence::len).sum();
        let cpu_has_room = num_blocks <= self.blocks.num_free_cpu_blocks();
        let how = self.config.cost_model().choose(self.config.preemption_mode, num_tokens, num_blocks, cpu_has_room);
        out.preempted.push(group.request_id.clone());
        match how {
            Preemption::Swap => {
                let copies = self.blocks.swap_out(&seq_ids).expect("room was checked");
                for seq in self.groups[group_id].seqs.iter_mut() {
                    self.rows.give_back(&mut seq.row);
                }
                self.counters.preemptions_swap += 1;
                self.counters.blocks_swapped_out += copies.len() as u64;
                out.blocks_to_swap_out.extend(copies);
                let group = &mut self.groups[group_id];
                group.state = GroupState::Swapped;
                group.num_preemptions += 1;
                enqueue(&mut self.swapped, &self.groups, group_id);
            }
            Preemption::Recompute => {
                self.free_group_blocks(group_id);
                self.counters.preemptions_recompute += 1;
                self.groups[group_id].num_preemptions += 1;
                self.requeue_for_recompute(group_id);
            }
        }
    }

    /// Queues a group whose blocks are freed to be computed again from its tokens, rebuilt with
    /// the sharing it had (`SequenceGroup::plan_rebuild`).
    fn requeue_for_recompute(&mut self, group_id: GroupId) {
        let windowed = self.config.sliding_window > 0;
        let group = &mut self.groups[group_id];
        for seq in group.seqs.iter_mut() {
            seq.reset_for_recompute();
        }
        group.plan_rebuild();
        if windowed {
            // A parent's window may have released blocks its fork would read: under a window every
            // sequence takes a table of its own (prefix-cache hits still share full blocks).
            for seq in group.seqs.iter_mut().filter(|seq| seq.pending.is_some()) {
                seq.pending = None;
            }
        }
        group.state = GroupState::Waiting;
        enqueue(&mut self.waiting, &self.groups, group_id);
    }

    /// Why a waiting group can never run, even alone on the empty device pool, if it cannot: its
    /// sequences, rebuilt with their sharing, hold more blocks than the pool has. (Under a sliding
    /// window sequences hold only their windows, so length alone does not rule a group out.)
    fn never_fits(&self, group_id: GroupId) -> Option<String> {
        let group = &self.groups[group_id];
        if self.config.sliding_window > 0 || group.seqs.len() == 1 {
            return None; // (a single prompt was checked against the pool when it was added)
        }
        let needed = self.blocks.blocks_to_rebuild(&group.rebuild_shape());
        (needed > self.config.num_device_blocks).then(|| {
            format!(
                "its {} sequences hold {needed} KV blocks, more than num_device_blocks={}",
                group.num_active(),
                self.config.num_device_blocks
            )
        })
    }

    /// Gives tables to the sequences of a rebuilt group whose turn has come: a sequence forks its
    /// parent once the parent's KV (computed in earlier steps) covers their shared prefix, and one
    /// without a parent takes its own table. Once every sequence holds a table and has computed
    /// all but its last token, the group samples again as one.
    fn advance_rebuild(&mut self, group_id: GroupId) {
        let group = &mut self.groups[group_id];
        let mut progressed = true;
        while progressed {
            progressed = false;
            for index in 0..group.seqs.len() {
                let seq = &group.seqs[index];
                let Some(pending) = seq.pending.filter(|_| seq.is_active()) else {
                    continue;
                };
                let ready = match pending.parent {
                    None => true,
                    Some(parent) => group
                        .seq(parent)
                        .is_some_and(|parent| parent.is_scheduled() && parent.num_computed >= pending.shared_len),
                };
                if !ready {
                    continue;
                }
                let seq = &mut group.seqs[index];
                seq.num_computed = match pending.parent {
                    None => self
                        .blocks
                        .allocate_prefix(seq.id, &seq.tokens, group.extra_key)
                        .expect("a pending sequence has no table"),
                    Some(parent) => {
                        let shared = &seq.tokens[..pending.shared_len];
                        self.blocks.fork_prefix(parent, seq.id, shared).expect("the parent holds the prefix");
                        pending.shared_len
                    }
                };
                seq.pending = None;
                progressed = true;
            }
        }
        let unfinished = group.active_seqs().any(|seq| seq.pending.is_some() || seq.num_computed + 1 < seq.len());
        group.rebuilding = unfinished;
    }

    /// Before sequence `seq_id` of a group ends: siblings waiting to fork it fork it now if its KV
    /// covers their shared prefix, else wait for its own parent (or take a table of their own).
    fn hand_over_pending(&mut self, group_id: GroupId, seq_id: SeqId) {
        let group = &self.groups[group_id];
        if !group
            .seqs
            .iter()
            .any(|seq| seq.is_active() && seq.pending.is_some_and(|pending| pending.parent == Some(seq_id)))
        {
            return;
        }
        let ending = group.seq(seq_id).unwrap();
        let (ending_pending, ending_computed) = (ending.pending, ending.num_computed);
        let running = group.state == GroupState::Running;
        let group = &mut self.groups[group_id];
        for seq in group.seqs.iter_mut().filter(|seq| seq.is_active()) {
            let Some(pending) = seq.pending.filter(|pending| pending.parent == Some(seq_id)) else {
                continue;
            };
            if running && ending_pending.is_none() && ending_computed >= pending.shared_len {
                let shared = &seq.tokens[..pending.shared_len];
                self.blocks.fork_prefix(seq_id, seq.id, shared).expect("the parent holds the prefix");
                seq.num_computed = pending.shared_len;
                seq.pending = None;
            } else {
                seq.pending = Some(match ending_pending {
                    Some(grand) => {
                        PendingTable { parent: grand.parent, shared_len: grand.shared_len.min(pending.shared_len) }
                    }
                    None => PendingTable { parent: None, shared_len: 0 },
                });
            }
        }
    }

    /// Gives up on a group that cannot run even alone on the empty device pool.
    fn drop_group(&mut self, group_id: GroupId, reason: String, out: &mut SchedulerOutput) {
        out.aborted.push(self.groups[group_id].request_id.clone());
        out.abort_reasons.push(reason);
        // The caller took it off its queue already; `remove_group` finds nothing to remove there.
        self.free_group_blocks(group_id);
        self.remove_group(group_id);
    }

    pub fn stats(&self) -> SchedulerStats {
        let cache = self.blocks.prefix_cache();
        SchedulerStats {
            num_device_blocks: self.blocks.num_device_blocks(),
            num_free_device_blocks: self.blocks.num_free_device_blocks(),
            num_cached_device_blocks: self.blocks.num_cached_device_blocks(),
            num_cpu_blocks: self.blocks.num_cpu_blocks(),
            num_cached_cpu_blocks: self.blocks.num_cached_cpu_blocks(),
            num_free_cpu_blocks: self.blocks.num_free_cpu_blocks(),
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            num_swapped: self.swapped.len(),
            num_running_seqs: self.num_running_seqs(),
            num_preemptions_swap: self.counters.preemptions_swap,
            num_preemptions_recompute: self.counters.preemptions_recompute,
            num_blocks_swapped_in: self.counters.blocks_swapped_in,
            num_blocks_swapped_out: self.counters.blocks_swapped_out,
            num_blocks_copied: self.counters.blocks_copied,
            prefix_cache_queries: cache.queries,
            prefix_cache_hits: cache.hits,
            num_blocks_offloaded: self.blocks.cpu_tier().num_offloaded,
            cpu_prefix_cache_hits: self.blocks.cpu_tier().num_reloaded,
            num_steps: self.counters.steps,
        }
    }
}

/// Inserts a group into a queue kept in `SequenceGroup::order`.
fn enqueue(queue: &mut VecDeque<GroupId>, groups: &Slab<SequenceGroup>, group_id: GroupId) {
    let order = groups[group_id].order();
    let position = queue.partition_point(|id| groups[*id].order() < order);
    queue.insert(position, group_id);
}

#[cfg(test)]
impl Scheduler {
    /// Every group's state, for test failure messages.
    pub(crate) fn describe_groups(&self) -> String {
        let mut text = String::new();
        for (_, group) in &self.groups {
            text += &format!("{} {:?} rebuilding={}:", group.request_id, group.state, group.rebuilding);
            for seq in &group.seqs {
                text += &format!(
                    " [seq {} {:?} len={} computed={} prefill_len={} pending={:?}]",
                    seq.id,
                    seq.status,
                    seq.len(),
                    seq.num_computed,
                    seq.prefill_len,
                    seq.pending
                );
            }
            text += "\n";
        }
        text
    }
}

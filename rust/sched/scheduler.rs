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

mod output;
mod preempting;
mod requests;
mod step_update;

use output::{Rows, SequenceWork};
pub use output::{ScheduledSequence, SchedulerOutput};
pub use step_update::{Fork, StepUpdate};

pub use crate::kv::block_table::PLACEHOLDER_TOKEN;

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
        blocks.set_kv_groups(&config.group_windows())?;
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

    /// Plans one step. See the module doc for the order; the returned copies must be executed
    /// (swap-out, then swap-in, then copy) before the step's forward pass writes any KV.
    pub fn schedule(&mut self) -> SchedulerOutput {
        self.counters.steps += 1;
        self.blocks.begin_step();
        let mut out = SchedulerOutput::new(self.blocks.num_kv_groups());
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
        out.finish_slot_mapping();
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
        self.counters.blocks_copied += slots.copies.len() as u64;
        let row = *seq.row.get_or_insert_with(|| self.rows.take());
        let work = SequenceWork { seq_id: seq.id, start: position, is_prefill: false, sample: true, row };
        decodes.push(out.record(work, token, &slots, self.config.block_size));
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
            self.counters.blocks_copied += slots.copies.len() as u64;
            let row = *seq.row.get_or_insert_with(|| self.rows.take());
            let scheduled = out.record(
                SequenceWork { seq_id, start, is_prefill, sample: end == seq.len(), row },
                new_tokens,
                &slots,
                block_size,
            );
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

//! Making room: priority preemption, preempting a group by swap or recompute, requeueing and
//! rebuilding a recomputed group (samples and beams that shared blocks share them again), and
//! dropping a group that can never fit.

use super::*;

impl Scheduler {
    /// Priority policy (vLLM's priority preemption): while the first queued group could not start
    /// this step and the last running group has a lower priority, preempt that running group.
    /// "Could start" is judged before the running groups take their share of the step: their
    /// outstanding tokens come off the budget and the blocks they will append off the free pool.
    /// A group never displaces one of equal or higher priority, so nothing ping-pongs.
    pub(super) fn preempt_for_priority(&mut self, out: &mut SchedulerOutput) {
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

    /// Takes a running group off the device: swap or recompute by the configured policy and cost.
    pub(super) fn preempt(&mut self, group_id: GroupId, out: &mut SchedulerOutput) {
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
    pub(super) fn requeue_for_recompute(&mut self, group_id: GroupId) {
        let group = &mut self.groups[group_id];
        for seq in group.seqs.iter_mut() {
            seq.reset_for_recompute();
        }
        group.plan_rebuild();
        group.state = GroupState::Waiting;
        enqueue(&mut self.waiting, &self.groups, group_id);
    }

    /// Why a waiting group can never run, even alone on the empty device pool, if it cannot: its
    /// sequences, rebuilt with their sharing, hold more blocks in the full-attention KV-cache
    /// groups than the pool has. (A windowed group's tables hold only their windows, so length
    /// alone does not rule a group out there.)
    pub(super) fn never_fits(&self, group_id: GroupId) -> Option<String> {
        let group = &self.groups[group_id];
        if group.seqs.len() == 1 {
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
    /// without a parent takes its own table, as does one whose parent's window already released
    /// blocks it would read (a prefix-cache hit can start the parent past the shared prefix).
    /// Once every sequence holds a table and has computed all but its last token, the group
    /// samples again as one.
    pub(super) fn advance_rebuild(&mut self, group_id: GroupId) {
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
                let parent = pending.parent.filter(|&parent| {
                    self.blocks.can_fork_prefix(parent, pending.shared_len).expect("the parent holds a table")
                });
                seq.num_computed = match parent {
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
    pub(super) fn hand_over_pending(&mut self, group_id: GroupId, seq_id: SeqId) {
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
        let holds_table = self.blocks.contains(seq_id);
        let running = group.state == GroupState::Running;
        let group = &mut self.groups[group_id];
        for seq in group.seqs.iter_mut().filter(|seq| seq.is_active()) {
            let Some(pending) = seq.pending.filter(|pending| pending.parent == Some(seq_id)) else {
                continue;
            };
            if running
                && ending_pending.is_none()
                && ending_computed >= pending.shared_len
                && holds_table
                && self.blocks.can_fork_prefix(seq_id, pending.shared_len).unwrap_or(false)
            {
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
    pub(super) fn drop_group(&mut self, group_id: GroupId, reason: String, out: &mut SchedulerOutput) {
        out.aborted.push(self.groups[group_id].request_id.clone());
        out.abort_reasons.push(reason);
        // The caller took it off its queue already; `remove_group` finds nothing to remove there.
        self.free_group_blocks(group_id);
        self.remove_group(group_id);
    }
}

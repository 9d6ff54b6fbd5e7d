//! The scheduler's side of a request's life: adding it, booking each sampled token (with drafts,
//! placeholders, forks), ending sequences, aborting, and looking sequences up.

use super::*;

impl Scheduler {
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
                blocks_needed: self.blocks.blocks_to_start(prompt.len()),
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

    pub(super) fn new_seq_id(&mut self) -> SeqId {
        let id = self.next_seq;
        self.next_seq += 1;
        id
    }

    pub(super) fn group_of_seq(&self, seq_id: SeqId) -> Result<GroupId> {
        self.group_by_seq.get(&seq_id).copied().ok_or(Error::UnknownSequence(seq_id))
    }

    /// The sampled token of a sequence that had `sample = true` in the last step.
    pub fn append_token(&mut self, seq_id: SeqId, token: u32) -> Result<()> {
        self.append_token_with_drafts(seq_id, token, &[])
    }

    /// `append_token`, then speculative `drafts` after it: the next step computes them all in one
    /// multi-token decode (never split across steps), and `accept_drafts` keeps the verified ones.
    pub fn append_token_with_drafts(&mut self, seq_id: SeqId, token: u32, drafts: &[u32]) -> Result<()> {
        self.check_append(seq_id, None, drafts.len())?;
        let group_id = self.group_by_seq[&seq_id];
        let seq = self.groups[group_id].seq_mut(seq_id).unwrap();
        seq.tokens.push(token);
        seq.tokens.extend_from_slice(drafts);
        seq.num_draft = drafts.len();
        Ok(())
    }

    /// Closes a step in one call: appends `appends` (sequence, sampled token), then ends the
    /// `finished` sequences. Everything is checked first (known, running, sampled in the last
    /// step, so each at most once), and an error changes nothing. `close_step` takes the rest of
    /// a step's report as well (placeholders filled, drafts, forks).
    pub fn update(&mut self, appends: &[(SeqId, u32)], finished: &[SeqId]) -> Result<()> {
        self.close_step(&StepUpdate { appends, finished, ..StepUpdate::default() }).map(|_| ())
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
        self.check_fork(parent)?;
        let group = &self.groups[self.group_of_seq(parent)?];
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
        self.fork_unlimited(parent)
    }

    /// Whether `parent` can be forked, its group's size aside: running, and sampled since its prefill.
    pub(super) fn check_fork(&self, parent: SeqId) -> Result<()> {
        let group = &self.groups[self.group_of_seq(parent)?];
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
        Ok(())
    }

    /// `fork` once `check_fork` and the group's size were checked.
    pub(super) fn fork_unlimited(&mut self, parent: SeqId) -> Result<SeqId> {
        let group_id = self.group_of_seq(parent)?;
        let child = self.new_seq_id();
        let group = &mut self.groups[group_id];
        let mut seq = group.seq(parent).unwrap().clone();
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

    pub(super) fn free_group_blocks(&mut self, group_id: GroupId) {
        for seq in self.groups[group_id].seqs.iter_mut() {
            self.rows.give_back(&mut seq.row);
            if self.blocks.contains(seq.id) {
                self.blocks.free(seq.id).expect("table exists");
            }
        }
    }

    pub(super) fn remove_group(&mut self, group_id: GroupId) {
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
}

//! The step's closing call: everything a step reports back about its sequences (placeholders
//! filled, drafts kept, forks, sampled tokens, finishes), checked as a whole and then applied,
//! so that one call either does all of it or changes nothing.

use rustc_hash::FxHashSet as HashSet;

use super::*;

/// A fork the closing call makes: a new sequence sharing every block of `parent` (as `fork`),
/// whose first token is `token`. `finished`: the child ends with that token (it is then
/// finished instead of appended to, as a finished sequence is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fork {
    pub parent: SeqId,
    pub token: u32,
    pub finished: bool,
}

/// What one step reports back (`Scheduler::close_step`), applied in this order:
/// 1. `fills`: the tokens that placeholders stood for (`fill_placeholders`);
/// 2. `accepted`: how many of its drafts each sequence keeps (`accept_drafts`);
/// 3. `forks`: each parent as it stands then (before this step's token is appended to it), forked;
///    each child then gets its own first token (n > 1 samples and beams draw the children's tokens
///    from the parent's row);
/// 4. `appends`: a sampled token per sequence, with the drafts named for it in `drafts` after it;
/// 5. `finished`: sequences that end (after being forked, if they were parents).
#[derive(Debug, Default, Clone, Copy)]
pub struct StepUpdate<'a> {
    pub fills: &'a [(SeqId, u32)],
    pub accepted: &'a [(SeqId, usize)],
    pub forks: &'a [Fork],
    pub appends: &'a [(SeqId, u32)],
    pub drafts: &'a [(SeqId, Vec<u32>)],
    pub finished: &'a [SeqId],
}

impl Scheduler {
    /// Closes a step in one call (see `StepUpdate` for what it holds and the order it is applied
    /// in). Everything is checked first: an error changes nothing. Returns the ids of the forked
    /// children, in the order of `update.forks`.
    pub fn close_step(&mut self, update: &StepUpdate) -> Result<Vec<SeqId>> {
        if update.fills.is_empty() && update.accepted.is_empty() && update.forks.is_empty() && update.drafts.is_empty()
        {
            self.append_and_finish(update.appends, update.finished)?;
            return Ok(Vec::new());
        }
        self.check_step_update(update)?;
        let fills: (Vec<SeqId>, Vec<u32>) = update.fills.iter().copied().unzip();
        self.fill_placeholders(&fills.0, &fills.1)?;
        for &(seq_id, num_accepted) in update.accepted {
            self.accept_drafts(seq_id, num_accepted)?;
        }
        let mut children = Vec::with_capacity(update.forks.len());
        for fork in update.forks {
            let child = self.fork_unlimited(fork.parent)?;
            if !fork.finished {
                self.append_token(child, fork.token)?;
            }
            children.push(child);
        }
        for &(seq_id, token) in update.appends {
            let drafts = update.drafts.iter().find(|(drafted, _)| *drafted == seq_id).map_or(&[][..], |(_, d)| d);
            self.append_token_with_drafts(seq_id, token, drafts)?;
        }
        for &seq_id in update.finished {
            self.finish_sequence(seq_id)?;
        }
        for (fork, &child) in update.forks.iter().zip(&children) {
            if fork.finished {
                self.finish_sequence(child)?;
            }
        }
        Ok(children)
    }

    /// The common step's report, appends and finishes alone, without a separate checking pass:
    /// each append checks its sequence (a second token for one fails: the first has no KV yet),
    /// and on an error the tokens appended so far are taken back.
    fn append_and_finish(&mut self, appends: &[(SeqId, u32)], finished: &[SeqId]) -> Result<()> {
        for (index, &seq_id) in finished.iter().enumerate() {
            self.group_of_seq(seq_id)?;
            if appends.iter().any(|&(appended, _)| appended == seq_id) {
                return Err(Error::InvalidState(format!("sequence {seq_id} is both appended to and finished")));
            }
            if finished[..index].contains(&seq_id) {
                return Err(Error::InvalidState(format!("sequence {seq_id} is finished twice")));
            }
        }
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

    /// Whether `close_step` can apply all of `update`: what each part checks in its own call,
    /// against the state the parts before it leave.
    fn check_step_update(&self, update: &StepUpdate) -> Result<()> {
        let invalid = |message: String| Err(Error::InvalidState(message));
        for (index, &(seq_id, token)) in update.fills.iter().enumerate() {
            let seq = self.groups[self.group_of_seq(seq_id)?].seq(seq_id).unwrap();
            if seq.tokens.last() != Some(&PLACEHOLDER_TOKEN) {
                return invalid(format!("sequence {seq_id} does not end in a placeholder"));
            }
            if token == PLACEHOLDER_TOKEN {
                return invalid(format!("token id {token} is the placeholder"));
            }
            if update.fills[..index].iter().any(|&(filled, _)| filled == seq_id) {
                return invalid(format!("sequence {seq_id} is filled twice"));
            }
        }
        // Each sequence's length once its drafts are settled (what forks and appends start from).
        let mut settled_len: HashMap<SeqId, usize> = HashMap::default();
        for &(seq_id, num_accepted) in update.accepted {
            let group = &self.groups[self.group_of_seq(seq_id)?];
            let seq = group.seq(seq_id).unwrap();
            if group.state != GroupState::Running {
                return invalid(format!("sequence {seq_id} is not running"));
            }
            if num_accepted > seq.num_draft || seq.num_computed != seq.len() {
                return invalid(format!(
                    "sequence {seq_id}: cannot accept {num_accepted} of {} drafts with {} tokens not computed",
                    seq.num_draft,
                    seq.num_uncomputed()
                ));
            }
            if settled_len.insert(seq_id, seq.len() - (seq.num_draft - num_accepted)).is_some() {
                return invalid(format!("sequence {seq_id} accepts drafts twice"));
            }
        }
        let filled = |seq_id: SeqId| update.fills.iter().any(|&(filled, _)| filled == seq_id);
        // Forks per group, less the group's sequences this call finishes: what it runs after it.
        let mut num_forks: HashMap<GroupId, usize> = HashMap::default();
        for fork in update.forks {
            let group_id = self.group_of_seq(fork.parent)?;
            self.check_fork(fork.parent)?;
            if filled(fork.parent) {
                return invalid(format!("sequence {} is filled and forked", fork.parent));
            }
            if !fork.finished {
                self.check_append(fork.parent, settled_len.get(&fork.parent).copied(), 0)?;
            }
            *num_forks.entry(group_id).or_default() += 1;
        }
        let limit = self.config.max_num_seqs.min(self.config.max_num_batched_tokens);
        for (&group_id, &forks) in &num_forks {
            let group = &self.groups[group_id];
            let ending = group.active_seqs().filter(|seq| update.finished.contains(&seq.id)).count();
            if group.num_active() + forks - ending > limit {
                return invalid(format!(
                    "a group of {} sequences exceeds max_num_seqs={} or max_num_batched_tokens={}",
                    group.num_active() + forks - ending,
                    self.config.max_num_seqs,
                    self.config.max_num_batched_tokens
                ));
            }
        }
        let mut appended: HashSet<SeqId> = HashSet::default();
        appended.reserve(update.appends.len());
        for &(seq_id, _) in update.appends {
            if !appended.insert(seq_id) {
                return invalid(format!("sequence {seq_id} is appended to twice"));
            }
            if filled(seq_id) {
                return invalid(format!("sequence {seq_id} is filled and appended to"));
            }
            let drafts = update.drafts.iter().find(|(drafted, _)| *drafted == seq_id).map_or(0, |(_, d)| d.len());
            self.check_append(seq_id, settled_len.get(&seq_id).copied(), drafts)?;
        }
        for (index, (seq_id, _)) in update.drafts.iter().enumerate() {
            if !appended.contains(seq_id) || update.drafts[..index].iter().any(|(drafted, _)| drafted == seq_id) {
                return invalid(format!("drafts for sequence {seq_id} need one append of it"));
            }
        }
        for (index, &seq_id) in update.finished.iter().enumerate() {
            self.group_of_seq(seq_id)?;
            if appended.contains(&seq_id) {
                return invalid(format!("sequence {seq_id} is both appended to and finished"));
            }
            if update.finished[..index].contains(&seq_id) {
                return invalid(format!("sequence {seq_id} is finished twice"));
            }
        }
        Ok(())
    }

    /// What `append_token_with_drafts` checks, for a sequence whose length is `settled_len` once
    /// its drafts are settled (None: as it stands).
    pub(super) fn check_append(&self, seq_id: SeqId, settled_len: Option<usize>, num_drafts: usize) -> Result<()> {
        let group = &self.groups[self.group_of_seq(seq_id)?];
        let seq = group.seq(seq_id).unwrap();
        let (len, num_computed) = settled_len.map_or((seq.len(), seq.num_computed), |len| (len, len));
        if 1 + num_drafts > self.config.max_num_batched_tokens {
            return Err(Error::InvalidState(format!(
                "{num_drafts} drafts do not fit max_num_batched_tokens={}",
                self.config.max_num_batched_tokens
            )));
        }
        if group.state != GroupState::Running {
            return Err(Error::InvalidState(format!("sequence {seq_id} is not running")));
        }
        if !seq.is_active() {
            return Err(Error::InvalidState(format!("sequence {seq_id} is finished")));
        }
        if num_computed != len {
            return Err(Error::InvalidState(format!(
                "sequence {seq_id} has {} tokens without KV; it was not sampled in the last step",
                len - num_computed
            )));
        }
        if len + 1 + num_drafts > self.max_model_len {
            return Err(Error::InvalidState(format!(
                "sequence {seq_id} has {len} tokens: {} more exceed max_model_len={}",
                1 + num_drafts,
                self.max_model_len
            )));
        }
        Ok(())
    }
}

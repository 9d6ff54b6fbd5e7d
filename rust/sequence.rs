//! Sequences (one stream of tokens with a block table) and sequence groups (one request: a prompt
//! and its samples or beams, admitted, preempted and resumed as a whole).

use std::sync::Arc;

use smallvec::SmallVec;

use crate::block_manager::SeqId;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    Active,
    Finished,
}

/// Tokens known so far and how many of them have KV in the cache.
#[derive(Debug, Clone)]
pub struct Sequence {
    pub id: SeqId,
    pub tokens: Vec<u32>,
    /// Tokens whose KV has been computed (or is being computed in the step just scheduled).
    pub num_computed: usize,
    /// Tokens to prefill in the current pass: the prompt, or every known token after a recompute.
    pub prefill_len: usize,
    /// Trailing tokens that are speculative drafts, not yet verified (see `Scheduler::accept_drafts`).
    pub num_draft: usize,
    pub status: SeqStatus,
}

impl Sequence {
    pub fn new(id: SeqId, tokens: Vec<u32>) -> Self {
        let prefill_len = tokens.len();
        Sequence { id, tokens, num_computed: 0, prefill_len, num_draft: 0, status: SeqStatus::Active }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn is_active(&self) -> bool {
        self.status == SeqStatus::Active
    }

    pub fn in_prefill(&self) -> bool {
        self.num_computed < self.prefill_len
    }

    /// Tokens that still need their KV computed.
    pub fn num_uncomputed(&self) -> usize {
        self.len() - self.num_computed
    }

    /// Forget the cache: the next pass prefills every known token (preemption by recompute).
    /// Unverified drafts are dropped: the prefill ends at the last real token and samples after it.
    pub fn reset_for_recompute(&mut self) {
        self.tokens.truncate(self.tokens.len() - self.num_draft);
        self.num_draft = 0;
        self.num_computed = 0;
        self.prefill_len = self.tokens.len();
    }
}

/// Where a group is in the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupState {
    Waiting,
    Running,
    Swapped,
}

/// One request: all of its sequences share a state and move between queues together.
#[derive(Debug, Clone)]
pub struct SequenceGroup {
    pub request_id: Arc<str>,
    /// Arrival order: smaller is older.
    pub arrival: u64,
    /// Smaller is served first and preempted last (always 0 under the FCFS policy).
    pub priority: i64,
    pub extra_key: Option<u64>,
    /// Inline for the common single-sequence request (one less pointer to chase per step).
    pub seqs: SmallVec<[Sequence; 1]>,
    pub state: GroupState,
    pub num_prompt_tokens: usize,
    pub num_prefix_hit_tokens: usize,
    pub num_preemptions: u32,
}

impl SequenceGroup {
    /// Where the group stands in every queue: served in ascending order, preempted from the end.
    pub fn order(&self) -> (i64, u64) {
        (self.priority, self.arrival)
    }

    pub fn active_seqs(&self) -> impl Iterator<Item = &Sequence> {
        self.seqs.iter().filter(|seq| seq.is_active())
    }

    pub fn active_seq_ids(&self) -> Vec<SeqId> {
        self.active_seqs().map(|seq| seq.id).collect()
    }

    pub fn num_active(&self) -> usize {
        self.active_seqs().count()
    }

    pub fn seq(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.iter().find(|seq| seq.id == id)
    }

    pub fn seq_mut(&mut self, id: SeqId) -> Option<&mut Sequence> {
        self.seqs.iter_mut().find(|seq| seq.id == id)
    }

    /// The most tokens any active sequence has (what a recompute must prefill).
    pub fn max_len(&self) -> usize {
        self.active_seqs().map(Sequence::len).max().unwrap_or(0)
    }
}

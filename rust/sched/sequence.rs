//! Sequences (one stream of tokens with a block table) and sequence groups (one request: a prompt
//! and its samples or beams, admitted, preempted and resumed as a whole).

use std::sync::Arc;

use smallvec::SmallVec;

use crate::kv::block_manager::SeqId;

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
    /// Set while a group preempted by recompute is rebuilt: this sequence has no block table yet.
    pub pending: Option<PendingTable>,
    /// Its persistent-batch row while on the device (see `ScheduledSequence::row`).
    pub row: Option<u32>,
}

/// How a sequence of a group being rebuilt gets its block table back, keeping the sharing the
/// group had: by forking a sibling once that sibling's KV covers their common prefix (vLLM V0
/// kept this sharing by swapping such groups; pagedkv rebuilds it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingTable {
    /// The sibling to fork; None: a table of its own (prefix-cache hits, then a prefill).
    pub parent: Option<SeqId>,
    /// Leading tokens taken from the parent's table (less than this sequence's length, so its
    /// last token is computed again and yields the next one).
    pub shared_len: usize,
}

impl Sequence {
    pub fn new(id: SeqId, tokens: Vec<u32>) -> Self {
        let prefill_len = tokens.len();
        Sequence {
            id,
            tokens,
            num_computed: 0,
            prefill_len,
            num_draft: 0,
            status: SeqStatus::Active,
            pending: None,
            row: None,
        }
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

    /// Active and holding a block table (unless its group is waiting).
    pub fn is_scheduled(&self) -> bool {
        self.is_active() && self.pending.is_none()
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
    /// Preempted by recompute with several sequences and not yet rebuilt (see `PendingTable`):
    /// no sequence computes its last token, the one that samples, until every one can, so the
    /// group samples in one step as it did before.
    pub rebuilding: bool,
}

impl SequenceGroup {
    /// Where the group stands in every queue: served in ascending order, preempted from the end.
    pub fn order(&self) -> (i64, u64) {
        (self.priority, self.arrival)
    }

    pub fn active_seqs(&self) -> impl Iterator<Item = &Sequence> {
        self.seqs.iter().filter(|seq| seq.is_active())
    }

    /// Active sequences that hold (or, waiting, are admitted with) a block table.
    pub fn scheduled_seqs(&self) -> impl Iterator<Item = &Sequence> {
        self.seqs.iter().filter(|seq| seq.is_scheduled())
    }

    pub fn scheduled_seq_ids(&self) -> Vec<SeqId> {
        self.scheduled_seqs().map(|seq| seq.id).collect()
    }

    /// Plans the rebuild of a group preempted by recompute: every active sequence but the first
    /// forks the earlier sibling it shares the longest prefix with, at that prefix.
    pub fn plan_rebuild(&mut self) {
        let active: Vec<usize> = (0..self.seqs.len()).filter(|&index| self.seqs[index].is_active()).collect();
        self.rebuilding = active.len() > 1;
        for (rank, &index) in active.iter().enumerate() {
            let seq = &self.seqs[index];
            // Both recompute their last token (it yields the next one): the shared prefix ends before.
            let best = active[..rank]
                .iter()
                .map(|&earlier| {
                    let parent = &self.seqs[earlier];
                    let shared_len =
                        common_prefix_len(&parent.tokens, &seq.tokens).min(parent.len() - 1).min(seq.len() - 1);
                    (shared_len, parent.id)
                })
                .max_by_key(|&(shared_len, _)| shared_len);
            self.seqs[index].pending =
                best.map(|(shared_len, parent)| PendingTable { parent: Some(parent), shared_len });
        }
    }

    /// (tokens, tokens shared with the parent) of each active sequence, in order: what
    /// `BlockManager::blocks_to_rebuild` counts.
    pub fn rebuild_shape(&self) -> Vec<(usize, usize)> {
        self.active_seqs().map(|seq| (seq.len(), seq.pending.map_or(0, |pending| pending.shared_len))).collect()
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

fn common_prefix_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

//! Liveness under pressure, model-checked by seeded random workloads: tiny pools (4-32 blocks of
//! 1-16 tokens per KV-cache group), one group or a hybrid model's full and windowed groups, swap /
//! recompute / auto preemption, prefix caching on and off, requests that fork samples or beams and
//! free siblings, aborts at any point. After every step the oracle
//! checks the bookkeeping and that every sequence reads back its own tokens through all the
//! copies; that some token is scheduled within a few steps whenever anything is unfinished; and
//! that a request is dropped only when the oracle agrees it cannot run alone on the empty pool.

use std::collections::HashMap;

use crate::sched::config::{SchedulerConfig, SchedulingPolicy};
use crate::sched::preemption::PreemptionMode;
use crate::sched::scheduler::Scheduler;
use crate::sched::scheduler_tests::SimulatedCache;

/// Steps without any scheduled token that a scheduler with unfinished work may take (a step
/// that preempts admits nothing; the next one must run something).
const MAX_IDLE_STEPS: usize = 2;

struct Rng(u64);

impl Rng {
    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

fn random_config(rng: &mut Rng) -> SchedulerConfig {
    let block_size = rng.pick(&[1, 2, 4, 8, 16]);
    let num_device_blocks = 4 + rng.below(29) as usize;
    let enable_chunked_prefill = rng.below(4) != 0;
    let max_model_len = 8 + rng.below(120) as usize;
    let max_num_batched_tokens = if enable_chunked_prefill { rng.pick(&[4, 8, 16, 64]) } else { max_model_len };
    // A third of the workloads: a hybrid model's KV-cache groups (a full one among windowed ones).
    let num_groups = rng.pick(&[1, 1, 1, 1, 2, 3]);
    let kv_group_windows: Vec<usize> = match num_groups {
        1 => Vec::new(),
        _ => (0..num_groups).map(|group| if group == 1 { 0 } else { rng.pick(&[2, 5, 9]) }).collect(),
    };
    SchedulerConfig {
        block_size,
        num_device_blocks: num_device_blocks * num_groups,
        num_cpu_blocks: rng.pick(&[0, 4, 16, 64]) * num_groups,
        kv_group_windows,
        max_num_seqs: rng.pick(&[2, 4, 8]),
        max_num_batched_tokens,
        max_model_len,
        max_waiting_requests: 64,
        enable_prefix_caching: rng.below(2) == 0,
        enable_cpu_prefix_cache: false,
        enable_chunked_prefill,
        long_prefill_token_threshold: 0,
        sliding_window: 0,
        prefix_caching_hash_seed: 0,
        enable_kv_events: false,
        preemption_mode: rng.pick(&[PreemptionMode::Swap, PreemptionMode::Recompute, PreemptionMode::Auto]),
        scheduling_policy: SchedulingPolicy::Fcfs,
        watermark: rng.pick(&[0.0, 0.01, 0.2]),
        ..SchedulerConfig::default()
    }
}

/// What the oracle knows of a request, from the calls it made.
struct Request {
    prompt_len: usize,
    seqs: Vec<u64>,
}

/// An upper bound of the device blocks a request needs to take its next step alone, over its
/// KV-cache groups: in each, every sequence holds all its tokens, sharing only its prompt's full
/// blocks with its siblings (forks happen after the prompt is computed, and rebuilding a group
/// keeps at least that); in a windowed group, also at most its window and one step's chunk each.
fn blocks_alone(cfg: &SchedulerConfig, request: &Request, tokens: &HashMap<u64, Vec<u32>>) -> usize {
    let shared = request.prompt_len / cfg.block_size;
    let all =
        shared + request.seqs.iter().map(|seq| tokens[seq].len().div_ceil(cfg.block_size) - shared).sum::<usize>();
    let chunk = if cfg.enable_chunked_prefill { cfg.max_num_batched_tokens } else { cfg.max_model_len };
    cfg.group_windows()
        .iter()
        .map(|&window| match window {
            0 => all,
            _ => all.min(request.seqs.len() * ((window - 1 + chunk).div_ceil(cfg.block_size) + 1)),
        })
        .sum()
}

/// What a workload went through, summed over workloads to show the check covered it.
#[derive(Default)]
struct Coverage {
    steps: usize,
    swaps: u64,
    recomputes: u64,
    /// Preemptions of groups with several sequences.
    group_preemptions: usize,
    drops: usize,
    /// Workloads of hybrid models (several KV-cache groups).
    hybrid_workloads: usize,
}

/// Runs one random workload to its end.
fn run_workload(seed: u64, coverage: &mut Coverage) {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let cfg = random_config(&mut rng);
    let mut cache = SimulatedCache::new(&cfg);
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let pool_tokens = cfg.num_device_blocks / cfg.group_windows().len() * cfg.block_size;
    coverage.hybrid_workloads += (cfg.group_windows().len() > 1) as usize;
    let fork_limit = cfg.max_num_seqs.min(cfg.max_num_batched_tokens);
    let num_requests = 4 + rng.below(10) as usize;
    let mut tokens: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut requests: HashMap<String, Request> = HashMap::new();
    let mut targets: HashMap<String, usize> = HashMap::new();
    let (mut added, mut steps, mut idle_steps) = (0, 0, 0);
    while added < num_requests || s.has_unfinished() {
        while added < num_requests && (s.num_unfinished() < 2 || rng.below(4) == 0) {
            let request_id = format!("r{added}");
            added += 1;
            let prompt: Vec<u32> =
                (0..1 + rng.below(pool_tokens as u64) as u32).map(|i| rng.pick(&[0, 1]) * 1000 + i).collect();
            let Ok(seq) = s.add_request(&request_id, prompt.clone(), None) else {
                continue;
            }; // (too long: rejected)
            targets.insert(request_id.clone(), prompt.len() + 1 + rng.below(2 * pool_tokens as u64) as usize);
            requests.insert(request_id, Request { prompt_len: prompt.len(), seqs: vec![seq] });
            tokens.insert(seq, prompt);
        }
        steps += 1;
        assert!(steps < 20_000, "seed {seed}: {cfg:?} did not finish");
        let out = s.schedule();
        coverage.group_preemptions += out.preempted.iter().filter(|id| requests[&***id].seqs.len() > 1).count();
        coverage.drops += out.aborted.len();
        s.block_manager().check_invariants().unwrap_or_else(|error| panic!("seed {seed}: {error}"));
        for (request_id, reason) in out.aborted.iter().zip(&out.abort_reasons) {
            let request = requests.remove(&**request_id).unwrap();
            let needed = blocks_alone(&cfg, &request, &tokens);
            assert!(
                needed > cfg.num_device_blocks || request.seqs.len() > cfg.max_num_seqs,
                "seed {seed}: {request_id} dropped ({reason}) but {} sequences fit {needed} blocks of {}: {cfg:?}",
                request.seqs.len(),
                cfg.num_device_blocks
            );
            for seq in request.seqs {
                tokens.remove(&seq);
            }
        }
        cache.run(&s, &out, &tokens);
        idle_steps = if out.scheduled.is_empty() && s.has_unfinished() { idle_steps + 1 } else { 0 };
        assert!(
            idle_steps <= MAX_IDLE_STEPS,
            "seed {seed}: stalled with {:?}: {cfg:?}\n{}",
            s.stats(),
            s.describe_groups()
        );

        for seq in out.scheduled.iter().filter(|seq| seq.sample) {
            let request_id = s.request_id(seq.seq_id).unwrap().to_string();
            let Some(request) = requests.get_mut(&request_id) else {
                continue;
            };
            let len = tokens[&seq.seq_id].len();
            if len >= targets[&request_id].min(s.max_model_len()) || rng.below(16) == 0 {
                s.finish_sequence(seq.seq_id).unwrap();
                request.seqs.retain(|&other| other != seq.seq_id);
                tokens.remove(&seq.seq_id);
                if request.seqs.is_empty() {
                    requests.remove(&request_id);
                }
                continue;
            }
            let token = 500 + rng.below(3) as u32;
            s.append_token(seq.seq_id, token).unwrap();
            tokens.get_mut(&seq.seq_id).unwrap().push(token);
            if request.seqs.len() < fork_limit && rng.below(4) == 0 {
                let child = s.fork(seq.seq_id).unwrap();
                request.seqs.push(child);
                tokens.insert(child, tokens[&seq.seq_id].clone());
            }
        }
        if rng.below(40) == 0 {
            if let Some(request_id) = requests.keys().min().cloned() {
                s.abort(&request_id).unwrap();
                for seq in requests.remove(&request_id).unwrap().seqs {
                    tokens.remove(&seq);
                }
            }
        }
        assert_eq!(s.num_unfinished(), requests.len(), "seed {seed}: the scheduler holds exactly the live requests");
    }
    s.schedule();
    let stats = s.stats();
    assert_eq!(
        (stats.num_free_device_blocks, stats.num_free_cpu_blocks),
        (cfg.num_device_blocks, cfg.num_cpu_blocks),
        "seed {seed}"
    );
    coverage.steps += steps;
    coverage.swaps += stats.num_preemptions_swap;
    coverage.recomputes += stats.num_preemptions_recompute;
}

#[test]
fn random_workloads_never_stall_and_drop_only_what_cannot_fit_alone() {
    let mut coverage = Coverage::default();
    for seed in 0..600 {
        run_workload(seed, &mut coverage);
    }
    let Coverage { steps, swaps, recomputes, group_preemptions, drops, hybrid_workloads } = coverage;
    eprintln!(
        "{steps} steps, {swaps} swaps, {recomputes} recomputes, {group_preemptions} group preemptions, {drops} drops, \
         {hybrid_workloads} hybrid workloads"
    );
    assert!(steps >= 20_000 && swaps > 100 && recomputes > 100 && group_preemptions > 100 && drops > 0);
    assert!(hybrid_workloads > 100);
}

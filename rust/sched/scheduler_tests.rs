//! Scheduler behaviour: batching, chunking, preemption, admission errors, sharing.

use crate::errors::Error;
use crate::sched::config::{SchedulerConfig, SchedulingPolicy};
use crate::sched::preemption::PreemptionMode;
use crate::sched::scheduler::{Fork, Scheduler, SchedulerOutput, StepUpdate};

fn config(num_device_blocks: usize, num_cpu_blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_device_blocks,
        num_cpu_blocks,
        max_num_seqs: 16,
        max_num_batched_tokens: 64,
        max_model_len: 64,
        max_waiting_requests: 8,
        enable_prefix_caching: false,
        enable_cpu_prefix_cache: false,
        enable_chunked_prefill: true,
        long_prefill_token_threshold: 0,
        sliding_window: 0,
        prefix_caching_hash_seed: 0,
        enable_kv_events: false,
        preemption_mode: PreemptionMode::Swap,
        scheduling_policy: SchedulingPolicy::Fcfs,
        watermark: 0.0,
        ..SchedulerConfig::default()
    }
}

/// A seeded xorshift generator: `next(bound)` is in 0..bound (the random workloads' choices).
fn xorshift(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut rng = seed;
    move |bound| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % bound
    }
}

fn prompt(len: u32, seed: u32) -> Vec<u32> {
    (0..len).map(|i| seed * 1000 + i).collect()
}

/// Plays the engine: appends token 7 to every sequence that was sampled.
fn sample_all(scheduler: &mut Scheduler, out: &SchedulerOutput) {
    for seq in out.scheduled.iter().filter(|seq| seq.sample) {
        scheduler.append_token(seq.seq_id, 7).unwrap();
    }
}

fn check(scheduler: &Scheduler) {
    scheduler.block_manager().check_invariants().unwrap();
}

#[test]
fn prefill_then_decode() {
    let mut s = Scheduler::new(config(16, 0)).unwrap();
    let seq = s.add_request("a", prompt(6, 1), None).unwrap();
    let out = s.schedule();
    assert_eq!(out.scheduled.len(), 1);
    let step = &out.scheduled[0];
    assert!(step.is_prefill && step.sample);
    assert_eq!((step.start, step.end), (0, 6));
    assert_eq!(out.token_ids(step), prompt(6, 1));
    let table = out.block_table_update(step).to_vec();
    assert_eq!((step.block_table_from, step.num_blocks), (0, 2), "a new sequence reports its whole table");
    assert_eq!(table, s.block_table(seq).unwrap());
    assert_eq!(out.slot_mapping(step, 0)[5], (table[1] * 4 + 1) as i64);
    s.append_token(seq, 42).unwrap();
    let out = s.schedule();
    let step = &out.scheduled[0];
    assert!(!step.is_prefill && step.sample);
    assert_eq!((step.start, step.end, out.token_ids(step).to_vec()), (6, 7, vec![42]));
    assert_eq!((step.block_table_from, step.num_blocks), (2, 2), "position 6 fits the last block");
    assert!(out.block_table_update(step).is_empty());
    assert!(matches!(s.append_token(seq, 1), Ok(())));
    assert!(matches!(s.append_token(seq, 1), Err(Error::InvalidState(_))), "KV of the last token not computed yet");
    check(&s);
}

#[test]
fn long_prompts_are_chunked_into_the_budget() {
    let mut cfg = config(32, 0);
    cfg.max_num_batched_tokens = 8;
    cfg.max_model_len = 32;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request("a", prompt(20, 1), None).unwrap();
    let mut chunks = Vec::new();
    loop {
        let out = s.schedule();
        let step = &out.scheduled[0];
        chunks.push((step.start, step.end, step.sample));
        if step.sample {
            break;
        }
    }
    assert_eq!(chunks, vec![(0, 8, false), (8, 16, false), (16, 20, true)]);
}

#[test]
fn chunking_off_requires_a_budget_of_max_model_len() {
    let mut cfg = config(32, 0);
    cfg.enable_chunked_prefill = false;
    cfg.max_num_batched_tokens = 8;
    assert!(matches!(Scheduler::new(cfg), Err(Error::InvalidConfig { field: "max_num_batched_tokens", .. })));
}

#[test]
fn decodes_come_first_and_prefill_takes_what_is_left() {
    let mut cfg = config(64, 0);
    cfg.max_num_batched_tokens = 10;
    let mut s = Scheduler::new(cfg).unwrap();
    for (i, id) in ["a", "b", "c"].iter().enumerate() {
        s.add_request(id, prompt(3, i as u32), None).unwrap();
    }
    let out = s.schedule();
    assert_eq!(out.num_batched_tokens, 9);
    sample_all(&mut s, &out);
    s.add_request("d", prompt(30, 9), None).unwrap();
    let out = s.schedule();
    // 3 decodes (1 token each) and a 7-token chunk of d; prefills are listed first.
    assert_eq!(out.num_batched_tokens, 10);
    assert_eq!(s.request_id(out.scheduled[0].seq_id).unwrap(), "d");
    assert_eq!(out.scheduled[0].end, 7);
    assert!(out.scheduled[1..].iter().all(|seq| !seq.is_prefill && seq.end - seq.start == 1));
}

#[test]
fn a_long_prefill_threshold_leaves_room_for_a_short_prompt_behind_a_long_one() {
    for (threshold, expected) in [(0, vec![("long", 0, 64)]), (16, vec![("long", 0, 16), ("short", 0, 5)])] {
        let mut cfg = config(64, 0);
        cfg.max_model_len = 128;
        cfg.max_num_batched_tokens = 64;
        cfg.long_prefill_token_threshold = threshold;
        let mut s = Scheduler::new(cfg).unwrap();
        s.add_request("long", prompt(100, 1), None).unwrap();
        s.add_request("short", prompt(5, 2), None).unwrap();
        let out = s.schedule();
        let chunks: Vec<(&str, usize, usize)> =
            out.scheduled.iter().map(|seq| (s.request_id(seq.seq_id).unwrap(), seq.start, seq.end)).collect();
        assert_eq!(chunks, expected, "threshold {threshold}");
        sample_all(&mut s, &out);
        check(&s);
        if threshold > 0 {
            // the next step: the short one decodes, the long one takes its next capped chunk
            let out = s.schedule();
            let long = out.scheduled.iter().find(|seq| s.request_id(seq.seq_id).unwrap() == "long").unwrap();
            assert_eq!((long.start, long.end), (16, 32));
            assert_eq!(out.num_batched_tokens, 17);
        }
    }
}

#[test]
fn max_num_seqs_limits_admission() {
    let mut cfg = config(64, 0);
    cfg.max_num_seqs = 2;
    let mut s = Scheduler::new(cfg).unwrap();
    for id in ["a", "b", "c"] {
        s.add_request(id, prompt(3, 1), None).unwrap();
    }
    let out = s.schedule();
    assert_eq!(out.scheduled.len(), 2);
    assert_eq!(s.stats().num_waiting, 1);
}

#[test]
fn admission_errors_name_the_limit_and_change_nothing() {
    let mut cfg = config(4, 0);
    cfg.max_waiting_requests = 1;
    let mut s = Scheduler::new(cfg).unwrap();
    assert_eq!(
        s.add_request("long", prompt(65, 1), None),
        Err(Error::PromptTooLong { prompt_len: 65, max_model_len: 64 })
    );
    // 17 tokens fit max_model_len but not 4 blocks of 4.
    let err = s.add_request("big", prompt(17, 1), None).unwrap_err();
    assert_eq!(err, Error::PromptExceedsPool { blocks_needed: 5, num_device_blocks: 4, block_size: 4 });
    assert!(err.to_string().contains("num_device_blocks=4"));
    s.add_request("a", prompt(3, 1), None).unwrap();
    assert!(matches!(
        s.add_request("b", prompt(3, 1), None),
        Err(Error::Overloaded { num_waiting: 1, max_waiting_requests: 1 })
    ));
    assert!(matches!(s.add_request("a", prompt(3, 1), None), Err(Error::DuplicateRequest(_))));
    assert_eq!(s.num_unfinished(), 1);
}

/// Two requests filling a 4-block pool: growing the first forces the second out.
fn run_until_preemption(mode: PreemptionMode, num_cpu_blocks: usize) -> (Scheduler, SchedulerOutput) {
    let mut cfg = config(4, num_cpu_blocks);
    cfg.preemption_mode = mode;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request("old", prompt(8, 1), None).unwrap();
    s.add_request("new", prompt(8, 2), None).unwrap();
    let out = s.schedule();
    assert_eq!(out.scheduled.len(), 2);
    sample_all(&mut s, &out);
    let out = s.schedule();
    (s, out)
}

#[test]
fn preemption_by_swap_moves_the_newest_group_and_brings_it_back() {
    let (mut s, out) = run_until_preemption(PreemptionMode::Swap, 8);
    assert_eq!(out.preempted, vec![std::sync::Arc::from("new")]);
    assert_eq!(out.blocks_to_swap_out.len(), 2);
    assert_eq!(out.scheduled.len(), 1);
    assert_eq!(s.request_id(out.scheduled[0].seq_id).unwrap(), "old");
    let stats = s.stats();
    assert_eq!((stats.num_swapped, stats.num_preemptions_swap, stats.num_blocks_swapped_out), (1, 1, 2));
    check(&s);
    // Once "old" finishes, "new" is swapped back in and continues its decode.
    s.finish_sequence(out.scheduled[0].seq_id).unwrap();
    let out = s.schedule();
    assert_eq!(out.blocks_to_swap_in.len(), 2);
    assert_eq!(out.scheduled.len(), 1);
    assert_eq!((s.request_id(out.scheduled[0].seq_id).unwrap(), out.scheduled[0].start), ("new", 8));
    assert_eq!(s.stats().num_blocks_swapped_in, 2);
    check(&s);
}

#[test]
fn preemption_by_recompute_requeues_at_the_front_with_all_tokens() {
    let (mut s, out) = run_until_preemption(PreemptionMode::Recompute, 8);
    assert_eq!(out.preempted, vec![std::sync::Arc::from("new")]);
    assert!(out.blocks_to_swap_out.is_empty());
    assert_eq!(s.stats().num_preemptions_recompute, 1);
    s.add_request("later", prompt(2, 3), None).unwrap();
    s.finish_sequence(out.scheduled[0].seq_id).unwrap();
    let out = s.schedule();
    // "new" comes back before "later", prefilling its prompt and its sampled token.
    assert_eq!(s.request_id(out.scheduled[0].seq_id).unwrap(), "new");
    assert_eq!((out.scheduled[0].start, out.scheduled[0].end), (0, 9));
    assert!(out.scheduled[0].is_prefill && out.scheduled[0].sample);
    check(&s);
}

#[test]
fn swap_without_cpu_room_falls_back_to_recompute() {
    let (s, out) = run_until_preemption(PreemptionMode::Swap, 0);
    assert_eq!(out.preempted.len(), 1);
    assert_eq!(s.stats().num_preemptions_recompute, 1);
}

#[test]
fn auto_mode_recomputes_cheap_groups() {
    let (s, _) = run_until_preemption(PreemptionMode::Auto, 8);
    // 9 tokens of a 7B-class model: recompute is cheaper than two PCIe transfers.
    assert_eq!(s.stats().num_preemptions_recompute, 1);
}

#[test]
fn abort_frees_everything_in_every_state() {
    let (mut s, out) = run_until_preemption(PreemptionMode::Swap, 8);
    s.add_request("waiting", prompt(3, 5), None).unwrap();
    s.abort("new").unwrap(); // swapped
    s.abort("waiting").unwrap(); // waiting
    let running = s.request_id(out.scheduled[0].seq_id).unwrap().to_string();
    s.abort(&running).unwrap(); // running
    assert!(matches!(s.abort("nobody"), Err(Error::UnknownRequest(_))));
    let stats = s.stats();
    assert_eq!((stats.num_free_device_blocks, stats.num_free_cpu_blocks), (4, 8));
    assert!(!s.has_unfinished());
    check(&s);
}

#[test]
fn forked_samples_share_blocks_and_copy_on_write_is_reported() {
    let mut s = Scheduler::new(config(16, 0)).unwrap();
    let parent = s.add_request("a", prompt(6, 1), None).unwrap();
    s.schedule();
    let child = s.fork(parent).unwrap();
    assert_eq!(s.stats().num_free_device_blocks, 14, "fork allocates nothing");
    s.append_token(parent, 1).unwrap();
    s.append_token(child, 2).unwrap();
    let out = s.schedule();
    assert_eq!(out.scheduled.len(), 2);
    assert_eq!(out.blocks_to_copy.len(), 1, "the shared partial block is copied once");
    let (src, dst) = out.blocks_to_copy[0];
    let tables: Vec<_> = out.scheduled.iter().map(|seq| s.block_table(seq.seq_id).unwrap().to_vec()).collect();
    let parent_step = out.scheduled.iter().find(|seq| seq.seq_id == parent).unwrap();
    let child_step = out.scheduled.iter().find(|seq| seq.seq_id == child).unwrap();
    assert_eq!(child_step.block_table_from, 0, "a fork reports its whole table");
    // The first writer (the parent) gets the copy; the child keeps the original, now unshared.
    assert_eq!(s.block_table(parent).unwrap()[1], dst);
    assert_eq!(s.block_table(child).unwrap()[1], src);
    assert_eq!(parent_step.block_table_from, 1, "copy-on-write reports the remapped last block");
    assert_eq!(out.block_table_update(parent_step), &[dst]);
    assert_eq!(tables[0][0], tables[1][0], "the full first block stays shared");
    assert!(tables.iter().any(|t| t[1] == src) && tables.iter().any(|t| t[1] == dst));
    s.finish_sequence(parent).unwrap();
    assert!(s.has_unfinished());
    s.finish_sequence(child).unwrap();
    assert!(!s.has_unfinished());
    assert_eq!(s.stats().num_free_device_blocks, 16);
}

#[test]
fn shared_prompts_hit_the_prefix_cache() {
    let mut cfg = config(16, 0);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request("a", prompt(10, 1), None).unwrap();
    s.schedule();
    s.add_request("b", prompt(10, 1), None).unwrap();
    let out = s.schedule();
    assert_eq!(out.num_prefix_hit_tokens, 8);
    let b = out.scheduled.iter().find(|seq| s.request_id(seq.seq_id).unwrap() == "b").unwrap();
    assert_eq!((b.start, b.end), (8, 10));
    assert_eq!(s.stats().prefix_cache_hits, 2);
}

#[test]
fn a_group_that_can_never_fit_is_dropped_not_looped() {
    let mut cfg = config(4, 0);
    cfg.preemption_mode = PreemptionMode::Recompute;
    let mut s = Scheduler::new(cfg).unwrap();
    let parent = s.add_request("beams", prompt(7, 1), None).unwrap();
    s.schedule();
    let children: Vec<_> = (0..3).map(|_| s.fork(parent).unwrap()).collect();
    for seq in std::iter::once(parent).chain(children) {
        s.append_token(seq, 1).unwrap();
    }
    // 4 sequences each need their own copy of the partial block plus the shared one: 5 > 4.
    let out = s.schedule();
    assert_eq!(out.aborted, vec![std::sync::Arc::from("beams")]);
    assert!(!s.has_unfinished());
    assert_eq!(s.stats().num_free_device_blocks, 4);
}

/// Issue reproduction: a swapped group whose next token fits its partial last block needs no new
/// block, and with nothing running the watermark does not hold it back: it resumes at once.
#[test]
fn a_swapped_group_resumes_on_an_empty_pool_and_later_requests_start() {
    let mut cfg = config(100, 200);
    (cfg.block_size, cfg.max_model_len, cfg.max_num_batched_tokens, cfg.watermark) = (16, 2048, 2048, 0.01);
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request("A", vec![1], None).unwrap();
    s.add_request("B", vec![2; 98 * 16], None).unwrap();
    let mut swapped_in_at_once = false;
    for _ in 0..60 {
        let swapped_before = s.stats().num_swapped;
        let out = s.schedule();
        swapped_in_at_once |= swapped_before == 1 && !out.blocks_to_swap_in.is_empty();
        for seq in out.scheduled.iter().filter(|seq| seq.sample) {
            let finished = (s.request_id(seq.seq_id).unwrap() == "A" && seq.end >= 20) || seq.end >= s.max_model_len();
            if finished {
                s.finish_sequence(seq.seq_id).unwrap();
            } else {
                s.append_token(seq.seq_id, 7).unwrap();
            }
        }
    }
    assert!(s.stats().num_preemptions_swap > 0 && swapped_in_at_once, "{:?}", s.stats());
    s.add_request("C", vec![3, 3, 3], None).unwrap();
    let out = s.schedule();
    assert_eq!(scheduled_requests(&s, &out), ["C"]);
    check(&s);
}

/// Issue reproduction: n sharers of a partial last block need n - 1 copies, not n.
#[test]
fn sharers_of_a_partial_block_copy_it_once_each_but_the_last() {
    let mut cfg = config(8, 0);
    (cfg.max_model_len, cfg.enable_prefix_caching) = (32, false);
    let mut s = Scheduler::new(cfg).unwrap();
    let g = s.add_request("g", (0..25).collect(), None).unwrap(); // 7 blocks, 1 free
    s.schedule();
    s.append_token(g, 1).unwrap();
    s.fork(g).unwrap();
    let out = s.schedule();
    assert!(out.aborted.is_empty());
    assert_eq!((out.scheduled.len(), out.blocks_to_copy.len()), (2, 1));
    assert_eq!(s.stats().num_free_device_blocks, 0);
    check(&s);
}

/// Plays the engine: appends to every sampled sequence its own id, so siblings diverge.
fn sample_all_apart(scheduler: &mut Scheduler, out: &SchedulerOutput) {
    for seq in out.scheduled.iter().filter(|seq| seq.sample) {
        scheduler.append_token(seq.seq_id, 100 + seq.seq_id as u32).unwrap();
    }
}

/// Runs "old" (2 blocks) and a forked "pair" (5 shared blocks and one each) in a 10-block pool
/// until "old" grows and "pair" is preempted by recompute.
fn preempt_a_forked_group(enable_prefix_caching: bool) -> Scheduler {
    let mut cfg = config(10, 0);
    (cfg.preemption_mode, cfg.enable_prefix_caching) = (PreemptionMode::Recompute, enable_prefix_caching);
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request("old", prompt(7, 1), None).unwrap();
    let pair = s.add_request("pair", prompt(20, 2), None).unwrap();
    let out = s.schedule();
    sample_all_apart(&mut s, &out);
    s.fork(pair).unwrap();
    for _ in 0..8 {
        let out = s.schedule();
        sample_all_apart(&mut s, &out);
        if !out.preempted.is_empty() {
            assert_eq!(out.preempted, vec![std::sync::Arc::from("pair")]);
            return s;
        }
    }
    panic!("no preemption: {:?}", s.stats());
}

/// Issue reproduction: a forked group preempted by recompute comes back with its sharing (7
/// blocks for both sequences, not 7 each) and samples both sequences in one step, as before.
#[test]
fn a_forked_group_recomputed_keeps_its_sharing_and_samples_as_one() {
    for enable_prefix_caching in [false, true] {
        let mut s = preempt_a_forked_group(enable_prefix_caching);
        let old = s.block_manager().tables().map(|(seq, _)| *seq).next().unwrap();
        s.finish_sequence(old).unwrap();
        let mut sampled_steps = Vec::new();
        for _ in 0..4 {
            let out = s.schedule();
            assert!(out.aborted.is_empty(), "{enable_prefix_caching}: {:?}", out.abort_reasons);
            check(&s);
            let sampled: Vec<_> = out.scheduled.iter().filter(|seq| seq.sample).map(|seq| seq.seq_id).collect();
            if !sampled.is_empty() {
                sampled_steps.push(sampled.len());
            }
            sample_all_apart(&mut s, &out);
        }
        assert_eq!(sampled_steps.first(), Some(&2), "{enable_prefix_caching}: both sequences sample in one step");
        let blocks: std::collections::HashSet<u32> =
            s.block_manager().tables().flat_map(|(_, table)| table.blocks.clone()).collect();
        let longest = s.block_manager().tables().map(|(_, table)| table.num_tokens).max().unwrap();
        assert_eq!(
            blocks.len(),
            2 * longest.div_ceil(4) - 5,
            "{enable_prefix_caching}: the 5 prompt blocks are shared"
        );
    }
}

/// A seeded random workload with preemptions: invariants after every step, nothing leaked.
#[test]
fn random_workload_keeps_invariants_and_frees_everything() {
    let cases = [
        (PreemptionMode::Swap, SchedulingPolicy::Fcfs),
        (PreemptionMode::Recompute, SchedulingPolicy::Fcfs),
        (PreemptionMode::Auto, SchedulingPolicy::Fcfs),
        (PreemptionMode::Swap, SchedulingPolicy::Priority),
        (PreemptionMode::Recompute, SchedulingPolicy::Priority),
    ];
    for (mode, policy) in cases {
        let mut cfg = config(24, 12);
        cfg.preemption_mode = mode;
        cfg.scheduling_policy = policy;
        cfg.enable_prefix_caching = true;
        cfg.max_num_batched_tokens = 16;
        cfg.max_waiting_requests = 64;
        let mut s = Scheduler::new(cfg).unwrap();
        let mut next = xorshift(12345u64);
        let mut targets = std::collections::HashMap::new();
        let mut consumer_tables = std::collections::HashMap::<u32, Vec<u32>>::new();
        const WIDTH: usize = 16;
        let mut flat_tables = vec![-1i32; 256 * WIDTH]; // (written by write_block_tables)
        for i in 0..40u32 {
            let len = 1 + next(20) as u32;
            let priority = if policy == SchedulingPolicy::Priority { next(4) as i64 - 1 } else { 0 };
            let seq =
                s.add_request_with_priority(&format!("r{i}"), prompt(len, next(3) as u32), None, priority).unwrap();
            targets.insert(seq, len as usize + 1 + next(20) as usize);
        }
        let mut steps = 0;
        while s.has_unfinished() {
            steps += 1;
            assert!(steps < 5000, "no progress");
            let out = s.schedule();
            check(&s);
            // A persistent-batch consumer keeping one table per row and applying only the reported
            // changes sees every table; no two sequences of a step share a row.
            let rows: std::collections::HashSet<u32> = out.scheduled.iter().map(|seq| seq.row).collect();
            assert_eq!(rows.len(), out.scheduled.len(), "{mode:?} {policy:?} step {steps}: rows shared");
            for seq in &out.scheduled {
                let table = consumer_tables.entry(seq.row).or_default();
                table.truncate(seq.block_table_from);
                table.extend_from_slice(out.block_table_update(seq));
                assert_eq!(table.as_slice(), s.block_table(seq.seq_id).unwrap(), "{mode:?} {policy:?} step {steps}");
            }
            out.write_block_tables(&mut flat_tables, WIDTH).unwrap();
            let num_blocks = out.scheduled.iter().map(|seq| seq.num_blocks).max().unwrap_or(0);
            let mut gathered = vec![0i32; out.scheduled.len() * num_blocks];
            out.gather_block_tables(&flat_tables, WIDTH, &mut gathered, num_blocks).unwrap();
            for (i, seq) in out.scheduled.iter().enumerate() {
                let want: Vec<i32> = s.block_table(seq.seq_id).unwrap().iter().map(|&b| b as i32).collect();
                assert_eq!(&gathered[i * num_blocks..i * num_blocks + want.len()], want.as_slice(), "step {steps}");
            }
            for seq in out.scheduled.iter().filter(|seq| seq.sample) {
                if s.sequence_len(seq.seq_id).unwrap() >= targets[&seq.seq_id] {
                    s.finish_sequence(seq.seq_id).unwrap();
                    continue;
                }
                s.append_token(seq.seq_id, 3).unwrap();
                if next(8) == 0 {
                    let child = s.fork(seq.seq_id).unwrap();
                    targets.insert(child, targets[&seq.seq_id]);
                }
            }
        }
        let stats = s.stats();
        assert_eq!(stats.num_free_device_blocks, 24, "{mode:?} {policy:?}");
        assert_eq!(stats.num_free_cpu_blocks, 12, "{mode:?} {policy:?}");
        assert!(
            stats.num_preemptions_swap + stats.num_preemptions_recompute > 0,
            "{mode:?}: the workload must preempt"
        );
        assert!(stats.num_blocks_copied > 0, "{mode:?}: forks must copy on write");
    }
}

fn priority_config(num_device_blocks: usize, num_cpu_blocks: usize) -> SchedulerConfig {
    SchedulerConfig { scheduling_policy: SchedulingPolicy::Priority, ..config(num_device_blocks, num_cpu_blocks) }
}

fn scheduled_requests(s: &Scheduler, out: &SchedulerOutput) -> Vec<String> {
    out.scheduled.iter().map(|seq| s.request_id(seq.seq_id).unwrap().to_string()).collect()
}

#[test]
fn fcfs_rejects_priorities_and_changes_nothing() {
    let mut s = Scheduler::new(config(16, 0)).unwrap();
    let err = s.add_request_with_priority("a", prompt(3, 1), None, 2).unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { field: "priority", .. }));
    assert!(err.to_string().contains("scheduling_policy='priority'"), "{err}");
    assert!(!s.has_unfinished());
    s.add_request_with_priority("a", prompt(3, 1), None, 0).unwrap();
    assert!(matches!("lifo".parse::<SchedulingPolicy>(), Err(Error::InvalidConfig { field: "scheduling_policy", .. })));
}

#[test]
fn priority_orders_admission_then_arrival() {
    let mut cfg = priority_config(64, 0);
    cfg.max_num_seqs = 1;
    let mut s = Scheduler::new(cfg).unwrap();
    for (id, priority) in [("late-low", 5), ("high", -1), ("mid-1", 1), ("mid-2", 1)] {
        s.add_request_with_priority(id, prompt(3, 1), None, priority).unwrap();
    }
    let mut order = Vec::new();
    while s.has_unfinished() {
        let out = s.schedule();
        for seq in &out.scheduled {
            order.push(s.request_id(seq.seq_id).unwrap().to_string());
            s.finish_sequence(seq.seq_id).unwrap();
        }
    }
    assert_eq!(order, ["high", "mid-1", "mid-2", "late-low"]);
}

#[test]
fn a_higher_priority_request_preempts_lower_priority_running_ones() {
    for mode in [PreemptionMode::Swap, PreemptionMode::Recompute] {
        // 6 blocks of 4 tokens: "low" and "lower" hold 2 each; "urgent" needs 3.
        let mut cfg = priority_config(6, 8);
        cfg.preemption_mode = mode;
        let mut s = Scheduler::new(cfg).unwrap();
        s.add_request_with_priority("low", prompt(8, 1), None, 1).unwrap();
        s.add_request_with_priority("lower", prompt(8, 2), None, 2).unwrap();
        let out = s.schedule();
        sample_all(&mut s, &out);
        s.add_request_with_priority("urgent", prompt(12, 3), None, 0).unwrap();
        let out = s.schedule();
        // Only the lowest priority is displaced, and "urgent" starts in the same step.
        assert_eq!(out.preempted, vec![std::sync::Arc::from("lower")], "{mode:?}");
        assert_eq!(scheduled_requests(&s, &out), ["urgent", "low"], "{mode:?}: prefills first");
        assert_eq!(out.blocks_to_swap_out.len(), if mode == PreemptionMode::Swap { 2 } else { 0 });
        check(&s);
        // "lower" comes back once there is room again, where it left off.
        sample_all(&mut s, &out);
        for seq in out.scheduled.clone() {
            s.finish_sequence(seq.seq_id).unwrap();
        }
        let out = s.schedule();
        assert_eq!(scheduled_requests(&s, &out), ["lower"], "{mode:?}");
        let (start, end) = (out.scheduled[0].start, out.scheduled[0].end);
        assert_eq!((start, end), if mode == PreemptionMode::Swap { (8, 9) } else { (0, 9) }, "{mode:?}");
        check(&s);
    }
}

#[test]
fn equal_or_lower_priorities_never_preempt() {
    for (newcomer, priority) in [("same", 1), ("lower", 2)] {
        let mut s = Scheduler::new(priority_config(4, 8)).unwrap();
        s.add_request_with_priority("running", prompt(12, 1), None, 1).unwrap();
        let out = s.schedule();
        sample_all(&mut s, &out);
        s.add_request_with_priority(newcomer, prompt(8, 2), None, priority).unwrap();
        let out = s.schedule();
        assert!(out.preempted.is_empty(), "{newcomer}");
        assert_eq!(scheduled_requests(&s, &out), ["running"]);
        assert_eq!(s.stats().num_waiting, 1);
    }
}

#[test]
fn max_num_seqs_is_a_reason_to_preempt_for_priority() {
    let mut cfg = priority_config(64, 64);
    cfg.max_num_seqs = 2;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request_with_priority("a", prompt(3, 1), None, 3).unwrap();
    s.add_request_with_priority("b", prompt(3, 2), None, 4).unwrap();
    let out = s.schedule();
    sample_all(&mut s, &out);
    s.add_request_with_priority("vip", prompt(3, 3), None, 0).unwrap();
    let out = s.schedule();
    assert_eq!(out.preempted, vec![std::sync::Arc::from("b")]);
    assert_eq!(scheduled_requests(&s, &out), ["vip", "a"]);
}

#[test]
fn a_newcomer_of_higher_priority_goes_before_a_swapped_group() {
    let mut cfg = priority_config(6, 16);
    cfg.max_num_seqs = 2;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request_with_priority("mid", prompt(12, 1), None, 1).unwrap();
    let out = s.schedule();
    sample_all(&mut s, &out);
    // 12 tokens + 1 need a 4th block: with "top" (3 blocks) that is 7 > 6, so "mid" is swapped out.
    s.add_request_with_priority("top", prompt(12, 2), None, 0).unwrap();
    let out = s.schedule();
    assert_eq!(out.preempted, vec![std::sync::Arc::from("mid")]);
    assert_eq!((s.stats().num_swapped, out.blocks_to_swap_out.len()), (1, 3));
    assert_eq!(scheduled_requests(&s, &out), ["top"]);
    sample_all(&mut s, &out);
    s.add_request_with_priority("top-2", prompt(12, 3), None, 0).unwrap();
    let top = out.scheduled[0].seq_id;
    let out = s.schedule();
    assert!(out.preempted.is_empty(), "equal priority: no preemption");
    assert_eq!(scheduled_requests(&s, &out), ["top"]);
    s.finish_sequence(top).unwrap();
    let out = s.schedule();
    assert_eq!(scheduled_requests(&s, &out), ["top-2"], "the newcomer outranks the swapped group");
    assert!(out.blocks_to_swap_in.is_empty());
    s.finish_sequence(out.scheduled[0].seq_id).unwrap();
    let out = s.schedule();
    assert_eq!(scheduled_requests(&s, &out), ["mid"]);
    assert_eq!((out.blocks_to_swap_in.len(), out.scheduled[0].start), (3, 12));
    check(&s);
}

/// The KV cache as the engine keeps it, one token id per slot, moved by the step's copies in the
/// engine's order (swap-outs, swap-ins, copy-on-write), then written at the slot mapping of each
/// KV-cache group (whose layers share the pool's blocks: a block belongs to one group at a time).
pub(crate) struct SimulatedCache {
    block_size: usize,
    windows: Vec<usize>,
    device: Vec<Vec<Option<u32>>>,
    cpu: Vec<Vec<Option<u32>>>,
}

impl SimulatedCache {
    pub(crate) fn new(cfg: &SchedulerConfig) -> Self {
        let blocks = |n| vec![vec![None; cfg.block_size]; n];
        SimulatedCache {
            block_size: cfg.block_size,
            windows: cfg.group_windows(),
            device: blocks(cfg.num_device_blocks),
            cpu: blocks(cfg.num_cpu_blocks),
        }
    }

    /// Runs one step and checks that every scheduled sequence reads its own tokens back in every
    /// KV-cache group (those its new tokens attend to, in a windowed group).
    pub(crate) fn run(
        &mut self,
        s: &Scheduler,
        out: &SchedulerOutput,
        tokens: &std::collections::HashMap<u64, Vec<u32>>,
    ) {
        for &(device, cpu) in &out.blocks_to_swap_out {
            self.cpu[cpu as usize] = self.device[device as usize].clone();
        }
        for &(cpu, device) in &out.blocks_to_swap_in {
            self.device[device as usize] = self.cpu[cpu as usize].clone();
        }
        for &(src, dst) in &out.blocks_to_copy {
            self.device[dst as usize] = self.device[src as usize].clone();
        }
        assert_eq!(out.num_kv_groups, self.windows.len());
        for group in 0..self.windows.len() {
            for seq in &out.scheduled {
                for (position, &slot) in (seq.start..seq.end).zip(out.slot_mapping(seq, group)) {
                    let slot = slot as usize;
                    self.device[slot / self.block_size][slot % self.block_size] = Some(tokens[&seq.seq_id][position]);
                }
            }
        }
        for (group, &window) in self.windows.iter().enumerate() {
            for seq in &out.scheduled {
                let table = &s.block_manager().seq_tables(seq.seq_id).unwrap()[group].blocks;
                let first_read = if window > 0 { (seq.start + 1).saturating_sub(window) } else { 0 };
                for position in first_read..seq.end {
                    let read = self.device[table[position / self.block_size] as usize][position % self.block_size];
                    assert_eq!(
                        read,
                        Some(tokens[&seq.seq_id][position]),
                        "seq {} position {position} group {group}",
                        seq.seq_id
                    );
                }
            }
        }
    }
}

/// Random requests sharing prefixes, forks, swaps, recomputes, (with the CPU tier) offloads and
/// reloads, and (speculating) drafts partly accepted: every step each sequence must read back
/// exactly the tokens it holds in every KV-cache group (in a windowed group, those in its window,
/// the rest released).
#[test]
fn random_workload_reads_back_every_token_through_all_the_copies() {
    let cases: [(PreemptionMode, bool, bool, &[usize]); 13] = [
        (PreemptionMode::Swap, false, false, &[0]),
        (PreemptionMode::Swap, true, false, &[0]),
        (PreemptionMode::Recompute, true, false, &[0]),
        (PreemptionMode::Auto, true, false, &[0]),
        (PreemptionMode::Swap, true, true, &[0]),
        (PreemptionMode::Recompute, false, true, &[0]),
        (PreemptionMode::Swap, true, false, &[6]),
        (PreemptionMode::Recompute, true, true, &[6]),
        (PreemptionMode::Auto, false, true, &[9]),
        // Hybrid models: full and windowed groups over one pool.
        (PreemptionMode::Swap, true, false, &[0, 6]),
        (PreemptionMode::Recompute, true, true, &[6, 0, 6]),
        (PreemptionMode::Auto, false, true, &[0, 9]),
        (PreemptionMode::Auto, true, false, &[5, 0]),
    ];
    for (mode, cpu_tier, speculate, windows) in cases {
        let mut cfg = config(20, 16);
        if windows.len() == 1 {
            cfg.sliding_window = windows[0];
        } else {
            cfg.kv_group_windows = windows.to_vec();
            cfg.num_device_blocks *= windows.len();
            cfg.num_cpu_blocks *= windows.len();
        }
        let (num_device_blocks, num_cpu_blocks) = (cfg.num_device_blocks, cfg.num_cpu_blocks);
        cfg.preemption_mode = mode;
        cfg.enable_prefix_caching = true;
        cfg.enable_cpu_prefix_cache = cpu_tier;
        cfg.max_num_batched_tokens = 16;
        cfg.max_waiting_requests = 128;
        let mut cache = SimulatedCache::new(&cfg);
        let mut s = Scheduler::new(cfg).unwrap();
        let mut next = xorshift(987654321u64);
        let mut tokens = std::collections::HashMap::<u64, Vec<u32>>::new();
        let mut drafts = std::collections::HashMap::<u64, usize>::new();
        let (mut num_drafted, mut num_rejected) = (0, 0);
        let mut released_any = false;
        let mut targets = std::collections::HashMap::new();
        let mut added = 0;
        let mut steps = 0;
        while added < 60 || s.has_unfinished() {
            // Requests trickle in, so cached prefixes get evicted and asked for again later.
            while added < 60 && (s.num_unfinished() < 4 || next(3) == 0) {
                let prompt = prompt(4 + next(24) as u32, next(4) as u32);
                let seq = s.add_request(&format!("r{added}"), prompt.clone(), None).unwrap();
                targets.insert(seq, prompt.len() + 1 + next(12) as usize);
                tokens.insert(seq, prompt);
                added += 1;
            }
            steps += 1;
            assert!(steps < 10_000, "no progress");
            let out = s.schedule();
            check(&s);
            // A recompute drops unverified drafts.
            for (seq, pending) in drafts.iter_mut() {
                let len = s.sequence_len(*seq).unwrap();
                if len < tokens[seq].len() {
                    tokens.get_mut(seq).unwrap().truncate(len);
                    *pending = 0;
                }
            }
            cache.run(&s, &out, &tokens);
            for seq in &out.scheduled {
                let tables = s.block_manager().seq_tables(seq.seq_id).unwrap();
                for (table, &window) in tables.iter().zip(windows) {
                    let live = table.live_blocks().len();
                    if window == 0 {
                        assert_eq!(live, table.num_tokens.div_ceil(4), "a full group's table keeps every block");
                    } else {
                        // (the window before the first new token, plus this step's chunk of at most 16)
                        assert!(live <= (window - 1 + 16).div_ceil(4) + 1, "{live} blocks under a window of {window}");
                    }
                }
            }
            released_any |= out.scheduled.iter().any(|seq| {
                s.block_manager().seq_tables(seq.seq_id).unwrap().iter().any(|table| table.num_released > 0)
            });
            for seq in out.scheduled.iter().filter(|seq| seq.sample) {
                let pending = drafts.remove(&seq.seq_id).unwrap_or(0);
                if pending > 0 {
                    assert!(!seq.is_prefill && seq.end - seq.start == pending + 1, "drafts are verified in one piece");
                    let accepted = next(pending as u64 + 1) as usize;
                    s.accept_drafts(seq.seq_id, accepted).unwrap();
                    let kept = tokens[&seq.seq_id].len() - (pending - accepted);
                    tokens.get_mut(&seq.seq_id).unwrap().truncate(kept);
                    num_rejected += pending - accepted;
                    check(&s);
                }
                if s.sequence_len(seq.seq_id).unwrap() >= targets[&seq.seq_id] {
                    s.finish_sequence(seq.seq_id).unwrap();
                    continue;
                }
                let token = 500 + next(3) as u32;
                let room = targets[&seq.seq_id] - s.sequence_len(seq.seq_id).unwrap() - 1;
                let num_drafts = if speculate { (next(4) as usize).min(room) } else { 0 };
                let new_drafts: Vec<u32> = (0..num_drafts).map(|_| 500 + next(3) as u32).collect();
                s.append_token_with_drafts(seq.seq_id, token, &new_drafts).unwrap();
                tokens.get_mut(&seq.seq_id).unwrap().push(token);
                tokens.get_mut(&seq.seq_id).unwrap().extend_from_slice(&new_drafts);
                if num_drafts > 0 {
                    drafts.insert(seq.seq_id, num_drafts);
                    num_drafted += num_drafts;
                    continue; // (no fork of a sequence with drafts)
                }
                if next(10) == 0 {
                    let child = s.fork(seq.seq_id).unwrap();
                    tokens.insert(child, tokens[&seq.seq_id].clone());
                    targets.insert(child, targets[&seq.seq_id]);
                }
            }
        }
        s.schedule(); // the last step's pins are released when the next one is planned
        let stats = s.stats();
        assert_eq!(
            (stats.num_free_device_blocks, stats.num_free_cpu_blocks),
            (num_device_blocks, num_cpu_blocks),
            "{mode:?} {cpu_tier} {windows:?}"
        );
        assert!(stats.prefix_cache_hits > 0, "{mode:?} {cpu_tier} {windows:?}");
        assert_eq!(released_any, windows.iter().any(|&window| window > 0), "blocks are released under a window only");
        if speculate {
            assert!(num_drafted > 0 && num_rejected > 0 && num_rejected < num_drafted);
        }
        if cpu_tier {
            assert!(stats.num_blocks_offloaded > 0 && stats.cpu_prefix_cache_hits > 0, "{mode:?}: {stats:?}");
        } else {
            assert_eq!((stats.num_blocks_offloaded, stats.cpu_prefix_cache_hits), (0, 0));
        }
        check(&s);
    }
}

/// Under a sliding window a sequence holds only its window and one step's chunk, so a pool of 6
/// blocks of 4 serves a 60-token sequence.
#[test]
fn a_windowed_model_serves_sequences_longer_than_the_pool() {
    let mut cfg = config(6, 0);
    cfg.max_num_batched_tokens = 4;
    assert_eq!(Scheduler::new(cfg.clone()).unwrap().max_model_len(), 24, "without a window the pool is the limit");
    cfg.sliding_window = 5;
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    assert_eq!(s.max_model_len(), 64);
    let seq = s.add_request("long", prompt(30, 1), None).unwrap();
    while s.sequence_len(seq).unwrap() < 60 {
        let out = s.schedule();
        assert!(out.preempted.is_empty() && out.aborted.is_empty());
        check(&s);
        let live = s.block_manager().table(seq).unwrap().live_blocks().len();
        assert!(live <= 3, "window 5 + a chunk of 4 span at most 3 blocks of 4, held {live}");
        if out.scheduled[0].sample {
            s.append_token(seq, 7).unwrap();
        }
    }
    s.finish_sequence(seq).unwrap();
    assert_eq!(s.stats().num_free_device_blocks, 6);
    // Without chunked prefill a whole prompt is computed at once: the pool stays the limit.
    cfg.enable_chunked_prefill = false;
    cfg.max_num_batched_tokens = 64;
    assert_eq!(Scheduler::new(cfg).unwrap().max_model_len(), 24);
}

/// The closing call appends and finishes in one go, or, given anything it cannot do, nothing.
#[test]
fn update_closes_a_step_in_one_call_or_changes_nothing() {
    let mut s = Scheduler::new(config(16, 0)).unwrap();
    let a = s.add_request("a", prompt(3, 1), None).unwrap();
    let b = s.add_request("b", prompt(3, 2), None).unwrap();
    let c = s.add_request("c", prompt(3, 3), None).unwrap();
    s.schedule();
    let before = s.stats();
    for bad in [
        (vec![(a, 1), (a, 2)], vec![]),  // twice
        (vec![(a, 1), (99, 2)], vec![]), // unknown
        (vec![(a, 1)], vec![a]),         // appended and finished
        (vec![(a, 1)], vec![77]),        // unknown finish
    ] {
        assert!(s.update(&bad.0, &bad.1).is_err(), "{bad:?}");
        assert_eq!((s.sequence_len(a).unwrap(), s.stats()), (3, before.clone()), "{bad:?} changed something");
    }
    s.update(&[(a, 7), (b, 8)], &[c]).unwrap();
    assert_eq!((s.sequence_len(a).unwrap(), s.sequence_len(b).unwrap(), s.num_unfinished()), (4, 4, 2));
    assert!(s.update(&[(a, 9)], &[]).is_err(), "a's token 7 has no KV yet: it was not sampled again");
    let out = s.schedule();
    assert_eq!(out.scheduled.iter().map(|seq| (seq.start, seq.end)).collect::<Vec<_>>(), [(3, 4), (3, 4)]);
    check(&s);
}

/// The closing call's other parts (drafts kept, forks, drafts after a token, finishes) are as
/// atomic as its appends: given anything it cannot do, it changes nothing; else forks share the
/// parent's blocks as it stood before its own token, and it returns the children's ids.
#[test]
fn close_step_takes_drafts_forks_and_finishes_in_one_call_or_changes_nothing() {
    let mut s = Scheduler::new(config(16, 0)).unwrap();
    let a = s.add_request("a", prompt(6, 1), None).unwrap();
    let b = s.add_request("b", prompt(3, 2), None).unwrap();
    let c = s.add_request("c", prompt(3, 3), None).unwrap();
    s.schedule();
    s.append_token_with_drafts(b, 9, &[10, 11]).unwrap();
    s.append_token(c, 5).unwrap();
    s.schedule(); // b computes its drafts, c its token
    let before = (s.stats(), (s.sequence_len(a).unwrap(), s.sequence_len(b).unwrap(), s.sequence_len(c).unwrap()));
    let fork = |parent, token, finished| Fork { parent, token, finished };
    let drafts = [(b, vec![12, 13])];
    let (fork_a, fork_unknown) = ([fork(a, 2, false)], [fork(99, 1, false)]);
    let (c_drafts, too_many_drafts) = ([(c, vec![1])], [(c, (0..64).collect::<Vec<u32>>())]);
    let refused = |s: &mut Scheduler, update: StepUpdate| {
        assert!(s.close_step(&update).is_err(), "{update:?}");
        let now = (s.stats(), (s.sequence_len(a).unwrap(), s.sequence_len(b).unwrap(), s.sequence_len(c).unwrap()));
        assert_eq!(now, before, "{update:?} changed something");
    };
    refused(&mut s, StepUpdate { accepted: &[(b, 3)], ..Default::default() }); // more than drafted
    refused(&mut s, StepUpdate { accepted: &[(b, 1), (b, 1)], ..Default::default() }); // twice
    refused(&mut s, StepUpdate { forks: &fork_unknown, ..Default::default() });
    refused(&mut s, StepUpdate { forks: &fork_a, finished: &[77], ..Default::default() }); // unknown finish
    refused(&mut s, StepUpdate { appends: &[(a, 1)], drafts: &c_drafts, ..Default::default() }); // c not appended
    refused(&mut s, StepUpdate { appends: &[(a, 1)], finished: &[a], forks: &fork_a, ..Default::default() });
    refused(&mut s, StepUpdate { finished: &[c, c], ..Default::default() }); // twice
    refused(&mut s, StepUpdate { appends: &[(a, 1), (a, 2)], forks: &fork_a, ..Default::default() }); // twice
    refused(&mut s, StepUpdate { fills: &[(a, 4)], forks: &fork_a, ..Default::default() }); // no placeholder
    let drafts_too_many =
        StepUpdate { appends: &[(a, 1), (c, 2)], drafts: &too_many_drafts, forks: &fork_a, ..Default::default() };
    refused(&mut s, drafts_too_many);
    let mut limited = config(16, 0);
    limited.max_num_seqs = 2;
    let mut small = Scheduler::new(limited).unwrap();
    let p = small.add_request("p", prompt(3, 1), None).unwrap();
    small.schedule();
    let two_forks = [fork(p, 1, false), fork(p, 2, false)];
    assert!(small.close_step(&StepUpdate { forks: &two_forks, ..Default::default() }).is_err(), "3 > max_num_seqs");
    // (a parent that ends in the same call leaves room for its children)
    let children = small.close_step(&StepUpdate { forks: &two_forks, finished: &[p], ..Default::default() }).unwrap();
    assert_eq!(children.len(), 2);

    let forks = [fork(a, 7, false), fork(a, 8, true)];
    let children = s
        .close_step(&StepUpdate {
            accepted: &[(b, 1)], // keeps 9, 10
            forks: &forks,       // from a's 6 prompt tokens
            appends: &[(a, 6), (b, 14)],
            drafts: &drafts, // b: 14 then drafts 12, 13
            finished: &[c],
            ..Default::default()
        })
        .unwrap();
    let (kept, ended) = (children[0], children[1]);
    assert_eq!(s.sequence_len(a).unwrap(), 7);
    assert_eq!(s.sequence_len(kept).unwrap(), 7, "the child forked before a's token, then got its own");
    assert!(s.append_token(ended, 1).is_err(), "a child ending with its first token is finished");
    assert_eq!(s.sequence_len(b).unwrap(), 3 + 2 + 1 + 2);
    assert!(s.sequence_len(c).is_err());
    let out = s.schedule();
    let kept_step = out.scheduled.iter().find(|seq| seq.seq_id == kept).unwrap();
    assert_eq!(out.token_ids(kept_step), [7]);
    assert_eq!(out.blocks_to_copy.len(), 1, "the shared partial block is copied on write, as after `fork`");
    check(&s);
}

/// Asynchronous scheduling's protocol: a placeholder stands for the token the last step is still
/// sampling, the next step is planned with it, then the real token is filled in.
#[test]
fn placeholders_plan_the_next_step_and_are_filled_in() {
    use crate::sched::scheduler::PLACEHOLDER_TOKEN;
    let mut s = Scheduler::new(config(16, 0)).unwrap();
    let (a, b) = (s.add_request("a", prompt(6, 1), None).unwrap(), s.add_request("b", prompt(3, 2), None).unwrap());
    s.schedule();
    s.append_placeholders(&[a, b]).unwrap();
    let out = s.schedule();
    for step in &out.scheduled {
        assert_eq!(out.token_ids(step), [PLACEHOLDER_TOKEN], "the decode's input is the placeholder");
    }
    assert!(matches!(s.fill_placeholders(&[a, b], &[5]), Err(Error::InvalidState(_))), "lengths differ");
    assert!(matches!(s.fill_placeholders(&[a, a], &[5, 6]), Err(Error::InvalidState(_))), "twice");
    assert!(matches!(s.fill_placeholders(&[a, b], &[5, PLACEHOLDER_TOKEN]), Err(Error::InvalidState(_))));
    assert!(matches!(s.fill_placeholders(&[a, 99], &[5, 6]), Err(Error::UnknownSequence(99))));
    assert_eq!(s.sequence_len(a).unwrap(), 7, "a failed fill changes nothing");
    s.fill_placeholders(&[a, b], &[5, 6]).unwrap();
    assert!(matches!(s.fill_placeholders(&[a], &[5]), Err(Error::InvalidState(_))), "no placeholder left");
    s.append_placeholders(&[a]).unwrap();
    let out = s.schedule();
    let step = out.scheduled.iter().find(|step| step.seq_id == a).unwrap();
    assert_eq!(out.token_ids(step), [PLACEHOLDER_TOKEN]);
    assert!(matches!(s.add_request("c", vec![1, PLACEHOLDER_TOKEN], None), Err(Error::InvalidState(_))));
    check(&s);
}

/// Blocks filled while a placeholder stood in them are cached under their real content: a later
/// prompt repeating the sequence hits the same blocks as after a synchronous run.
#[test]
fn filled_placeholders_leave_the_prefix_cache_as_synchronous_steps_do() {
    let mut cfg = config(32, 0);
    cfg.enable_prefix_caching = true;
    let mut hits = Vec::new();
    for asynchronous in [false, true] {
        let mut s = Scheduler::new(cfg.clone()).unwrap();
        let a = s.add_request("a", prompt(6, 1), None).unwrap();
        s.schedule();
        let mut tokens = prompt(6, 1);
        for step in 0..10u32 {
            let token = 100 + step;
            tokens.push(token);
            if asynchronous {
                s.append_placeholders(&[a]).unwrap();
                s.schedule(); // (plans the step whose input is the placeholder, filling blocks 2 and 3 with it)
                s.fill_placeholders(&[a], &[token]).unwrap();
            } else {
                s.append_token(a, token).unwrap();
                s.schedule();
            }
            check(&s);
        }
        s.finish_sequence(a).unwrap();
        tokens.push(1);
        s.add_request("b", tokens.clone(), None).unwrap();
        hits.push(s.schedule().num_prefix_hit_tokens);
        check(&s);
    }
    assert_eq!(hits[0], 16, "the four full blocks of the finished sequence");
    assert_eq!(hits[1], hits[0]);
}

#[test]
fn block_tables_that_do_not_fit_are_refused_unwritten() {
    let mut s = Scheduler::new(config(16, 0)).unwrap();
    s.add_request("a", prompt(10, 1), None).unwrap(); // 3 blocks of 4
    let out = s.schedule();
    let mut tables = vec![-1i32; 4 * 2]; // rows of 2 blocks: too narrow
    assert!(matches!(out.write_block_tables(&mut tables, 2), Err(Error::InvalidState(_))));
    assert!(tables.iter().all(|&b| b == -1));
    let mut tables = vec![-1i32; 4 * 4];
    out.write_block_tables(&mut tables, 4).unwrap();
    assert_eq!(
        &tables[..3],
        s.block_table(out.scheduled[0].seq_id).unwrap().iter().map(|&b| b as i32).collect::<Vec<_>>()
    );
    let mut gathered = vec![0i32; 3];
    assert!(out.gather_block_tables(&tables, 4, &mut gathered, 5).is_err()); // wider than the rows
    assert!(out.gather_block_tables(&tables, 4, &mut gathered[..2], 3).is_err()); // output too short
    assert!(out.gather_block_tables(&tables[..0], 4, &mut gathered, 3).is_err()); // no row for it
    out.gather_block_tables(&tables, 4, &mut gathered, 3).unwrap();
    assert_eq!(gathered, tables[..3]);
}

/// Every step's output of a seeded workload with forks and preemptions (swap, then recompute once
/// the CPU pool is full), sampling a token for each sampling sequence; for checks of the outputs.
pub(crate) fn random_workload_outputs(seed: u64, num_requests: u32) -> Vec<SchedulerOutput> {
    let mut cfg = config(16, 6);
    cfg.max_num_batched_tokens = 16;
    cfg.max_waiting_requests = 64;
    cfg.preemption_mode = PreemptionMode::Auto;
    let mut s = Scheduler::new(cfg).unwrap();
    let mut next = xorshift(seed | 1);
    let mut targets = std::collections::HashMap::new();
    for i in 0..num_requests {
        let len = 1 + next(20) as u32;
        let seq = s.add_request(&format!("r{i}"), prompt(len, next(3) as u32), None).unwrap();
        targets.insert(seq, len as usize + 1 + next(20) as usize);
    }
    let mut outputs = Vec::new();
    while s.has_unfinished() {
        assert!(outputs.len() < 5000, "no progress");
        let out = s.schedule();
        for seq in out.scheduled.iter().filter(|seq| seq.sample) {
            if s.sequence_len(seq.seq_id).unwrap() >= targets[&seq.seq_id] {
                s.finish_sequence(seq.seq_id).unwrap();
                continue;
            }
            s.append_token(seq.seq_id, next(100) as u32).unwrap();
            if next(8) == 0 {
                let child = s.fork(seq.seq_id).unwrap();
                targets.insert(child, targets[&seq.seq_id]);
            }
        }
        outputs.push(out);
    }
    outputs
}

//! Profiling aid: `perf record ./target/release/examples/profile_schedule` (decode steps of 256
//! sequences from a 512-token context, the criterion bench's set-up; set-up is not timed).
use pagedkv::{Scheduler, SchedulerConfig};

const STEPS: usize = 1000;

fn decoding_scheduler(num_seqs: usize) -> Scheduler {
    let config = SchedulerConfig {
        num_device_blocks: num_seqs * (512 + STEPS).div_ceil(16) + num_seqs,
        num_cpu_blocks: 0,
        max_num_seqs: num_seqs,
        max_num_batched_tokens: num_seqs * 512,
        max_model_len: 1 << 20,
        max_waiting_requests: num_seqs,
        enable_prefix_caching: false,
        watermark: 0.0,
        ..SchedulerConfig::default()
    };
    let mut scheduler = Scheduler::new(config).unwrap();
    for i in 0..num_seqs {
        scheduler.add_request(&i.to_string(), (0..512).collect(), None).unwrap();
    }
    let out = scheduler.schedule();
    for seq in &out.scheduled {
        scheduler.append_token(seq.seq_id, 1).unwrap();
    }
    scheduler
}

fn main() {
    let rounds: usize = std::env::args().nth(1).map_or(20, |arg| arg.parse().unwrap());
    let seqs: usize = std::env::args().nth(2).map_or(256, |arg| arg.parse().unwrap());
    let mut timed = std::time::Duration::ZERO;
    let mut in_schedule = std::time::Duration::ZERO;
    let mut best_round = std::time::Duration::MAX;
    for _ in 0..rounds {
        let mut scheduler = decoding_scheduler(seqs);
        let started = std::time::Instant::now();
        for _ in 0..STEPS {
            let before = std::time::Instant::now();
            let out = scheduler.schedule();
            in_schedule += before.elapsed();
            for seq in &out.scheduled {
                scheduler.append_token(seq.seq_id, 1).unwrap();
            }
            std::hint::black_box(&out);
        }
        timed += started.elapsed();
        best_round = best_round.min(started.elapsed());
    }
    let steps = (rounds * STEPS) as f64;
    println!(
        "{seqs} seqs: {:.1} us/step ({:.1} in schedule()), best round {:.1} us/step",
        timed.as_secs_f64() * 1e6 / steps,
        in_schedule.as_secs_f64() * 1e6 / steps,
        best_round.as_secs_f64() * 1e6 / STEPS as f64
    );
}

//! Profiling aid: `perf record ./target/release/examples/profile_schedule` (decode steps of 256
//! sequences at a 512-576-token context, the criterion bench's set-up).
use pagedkv::{Scheduler, SchedulerConfig};

fn decoding_scheduler(num_seqs: usize) -> Scheduler {
    let config = SchedulerConfig {
        num_device_blocks: num_seqs * 64,
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
    let mut timed = std::time::Duration::ZERO;
    let mut in_schedule = std::time::Duration::ZERO;
    let rounds = 200;
    for _ in 0..rounds {
        let mut scheduler = decoding_scheduler(256);
        let started = std::time::Instant::now();
        for _ in 0..64 {
            let before = std::time::Instant::now();
            let out = scheduler.schedule();
            in_schedule += before.elapsed();
            for seq in &out.scheduled {
                scheduler.append_token(seq.seq_id, 1).unwrap();
            }
            std::hint::black_box(&out);
        }
        timed += started.elapsed();
    }
    let steps = (rounds * 64) as f64;
    println!("{:.1} us/step ({:.1} in schedule())", timed.as_secs_f64() * 1e6 / steps, in_schedule.as_secs_f64() * 1e6 / steps);
}

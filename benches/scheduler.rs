//! schedule() latency with N running decode sequences, and allocate+free cost per block.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pagedkv::kv::block_pool::BlockPool;
use pagedkv::Device;
use pagedkv::{Scheduler, SchedulerConfig};

const CONTEXT: u32 = 512;
const STEPS_PER_SCHEDULER: u64 = 1000;

/// A scheduler with `num_seqs` sequences in steady decode, each with a 512-token context and
/// room to decode `STEPS_PER_SCHEDULER` more tokens.
fn decoding_scheduler(num_seqs: usize) -> Scheduler {
    let blocks_per_seq = (CONTEXT as usize + STEPS_PER_SCHEDULER as usize).div_ceil(16) + 1;
    let config = SchedulerConfig {
        num_device_blocks: num_seqs * blocks_per_seq,
        num_cpu_blocks: 0,
        max_num_seqs: num_seqs,
        max_num_batched_tokens: num_seqs * CONTEXT as usize,
        max_model_len: 1 << 20,
        max_waiting_requests: num_seqs,
        enable_prefix_caching: false,
        watermark: 0.0,
        ..SchedulerConfig::default()
    };
    let mut scheduler = Scheduler::new(config).unwrap();
    for i in 0..num_seqs {
        scheduler.add_request(&i.to_string(), (0..CONTEXT).collect(), None).unwrap();
    }
    let out = scheduler.schedule();
    assert_eq!(out.scheduled.len(), num_seqs);
    for seq in &out.scheduled {
        scheduler.append_token(seq.seq_id, 1).unwrap();
    }
    scheduler
}

/// One decode step: schedule() plus the engine reporting each sampled token.
fn schedule_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("schedule_decode_step");
    for num_seqs in [64, 256, 1024] {
        group.bench_with_input(BenchmarkId::from_parameter(num_seqs), &num_seqs, |b, &num_seqs| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut done = 0;
                while done < iters {
                    let mut scheduler = decoding_scheduler(num_seqs); // set-up, not timed
                    let steps = STEPS_PER_SCHEDULER.min(iters - done);
                    let started = Instant::now();
                    for _ in 0..steps {
                        let out = scheduler.schedule();
                        for seq in &out.scheduled {
                            scheduler.append_token(seq.seq_id, 1).unwrap();
                        }
                        black_box(&out);
                    }
                    total += started.elapsed();
                    done += steps;
                }
                total
            });
        });
    }
    group.finish();
}

fn allocate_free(c: &mut Criterion) {
    let mut pool = BlockPool::new(Device::Gpu, 4096);
    c.bench_function("block_pool_allocate_free", |b| {
        b.iter(|| {
            let block = pool.allocate().unwrap().block;
            pool.release(black_box(block));
        })
    });
}

criterion_group!(benches, schedule_step, allocate_free);
criterion_main!(benches);

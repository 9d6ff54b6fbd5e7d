//! Paged decode attention on the CPU (rust/cpu_attention.rs), SmolLM2's shape (9 query heads,
//! 3 KV heads, head dim 64, 16-token blocks in the block-major cache), 64 sequences, one layer:
//! time per call with float32 and bfloat16 caches, on the CPU's widest instruction set and on
//! the portable build (the baseline, same run), and the K/V bytes read per second; beside it
//! the ceiling: two threads summing a contiguous buffer of the float32 cache's size (the
//! machine's read bandwidth, same run).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pagedkv::cpu_kernels::decode_attention::{paged_decode_attention_with, DecodeShape};
use pagedkv::cpu_kernels::simd::{Bf16, Element, Isa};

const BATCH: usize = 64;
const NUM_HEADS: usize = 9;
const NUM_KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const BLOCK_SIZE: usize = 16;

fn decode_attention(c: &mut Criterion) {
    let mut group = c.benchmark_group("cpu_decode_attention");
    for context in [128usize, 512, 2048] {
        let blocks_per_seq = context.div_ceil(BLOCK_SIZE);
        let block_floats = NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM;
        // K then V of one layer inside each block; other layers' halves sit between blocks.
        let shape = DecodeShape {
            batch: BATCH,
            num_heads: NUM_HEADS,
            num_kv_heads: NUM_KV_HEADS,
            head_dim: HEAD_DIM,
            block_size: BLOCK_SIZE,
            num_blocks: BATCH * blocks_per_seq,
            block_stride: 4 * block_floats,
            table_width: blocks_per_seq,
            sliding_window: 0,
            logit_softcap: 0.0,
        };
        let cache: Vec<f32> =
            (0..shape.num_blocks * shape.block_stride).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let cache_bf16: Vec<Bf16> = cache.iter().map(|&x| Bf16::from_f32(x)).collect();
        let query: Vec<f32> =
            (0..BATCH * NUM_HEADS * HEAD_DIM).map(|i| ((i * 104729) % 1000) as f32 / 1000.0 - 0.5).collect();
        let query_bf16: Vec<Bf16> = query.iter().map(|&x| Bf16::from_f32(x)).collect();
        // Blocks scattered over the pool, as after a while of serving.
        let tables: Vec<i32> = (0..shape.num_blocks).map(|i| ((i * 7) % shape.num_blocks) as i32).collect();
        let contexts = vec![context as i32; BATCH];
        let mut out = vec![0.0f32; query.len()];
        let mut out_bf16 = vec![Bf16::default(); query.len()];
        let bytes = 2 * BATCH * context * NUM_KV_HEADS * HEAD_DIM * 4;
        group.throughput(Throughput::Bytes(bytes as u64));
        let contiguous = vec![1.0f32; bytes / 4];
        group.bench_with_input(BenchmarkId::new("read ceiling, context", context), &context, |b, _| {
            b.iter(|| black_box(parallel_sum(&contiguous)))
        });
        for isa in [Isa::best(), Isa::Portable] {
            let inputs = Inputs { tables: &tables, contexts: &contexts, shape };
            group.throughput(Throughput::Bytes(bytes as u64));
            let id = BenchmarkId::new(format!("64 seqs f32 {isa:?}, context"), context);
            group.bench_with_input(id, &context, |b, _| {
                b.iter(|| inputs.run(isa, &mut out, &query, &cache, &cache[block_floats..]))
            });
            group.throughput(Throughput::Bytes(bytes as u64 / 2));
            let id = BenchmarkId::new(format!("64 seqs bf16 {isa:?}, context"), context);
            group.bench_with_input(id, &context, |b, _| {
                b.iter(|| inputs.run(isa, &mut out_bf16, &query_bf16, &cache_bf16, &cache_bf16[block_floats..]))
            });
        }
    }
    group.finish();
}

struct Inputs<'a> {
    tables: &'a [i32],
    contexts: &'a [i32],
    shape: DecodeShape,
}

impl Inputs<'_> {
    fn run<T: Element>(&self, isa: Isa, out: &mut [T], query: &[T], keys: &[T], values: &[T]) {
        let Inputs { tables, contexts, shape } = self;
        paged_decode_attention_with(isa, out, query, keys, values, tables, contexts, shape, 0.125, None, 2).unwrap();
        black_box(out);
    }
}

/// Sums `data` on two threads in 8 lanes each: a plain streaming read.
fn parallel_sum(data: &[f32]) -> f32 {
    let (left, right) = data.split_at(data.len() / 2);
    let sum = |part: &[f32]| {
        let mut lanes = [0.0f32; 8];
        for chunk in part.chunks_exact(8) {
            for lane in 0..8 {
                lanes[lane] += chunk[lane];
            }
        }
        lanes.iter().sum::<f32>()
    };
    std::thread::scope(|scope| {
        let other = scope.spawn(|| sum(right));
        sum(left) + other.join().unwrap()
    })
}

criterion_group!(benches, decode_attention);
criterion_main!(benches);

//! Paged prefill attention on the CPU (rust/cpu_prefill_attention.rs), one whole prompt of
//! SmolLM2's attention shape (9 query heads, 3 KV heads, head dim 64, 16-token blocks scattered
//! over a block-major cache), one layer, bfloat16: time per call on each instruction set this
//! CPU runs, the portable build being the baseline of the same run. Python's
//! benches/cpu_prefill_attention.py compares the widest build with torch's SDPA.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pagedkv::cpu_kernels::decode_attention::DecodeShape;
use pagedkv::cpu_kernels::prefill_attention::paged_prefill_attention;
use pagedkv::cpu_kernels::simd::{Bf16, Element, Isa};

const NUM_HEADS: usize = 9;
const NUM_KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const BLOCK_SIZE: usize = 16;

fn prefill_attention(c: &mut Criterion) {
    let mut group = c.benchmark_group("cpu_prefill_attention");
    group.sample_size(20);
    for prompt_len in [115usize, 400, 2048] {
        let table_width = prompt_len.div_ceil(BLOCK_SIZE);
        let block = NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM;
        let shape = DecodeShape {
            batch: 1,
            num_heads: NUM_HEADS,
            num_kv_heads: NUM_KV_HEADS,
            head_dim: HEAD_DIM,
            block_size: BLOCK_SIZE,
            num_blocks: 2 * table_width,
            block_stride: 4 * block,
            table_width,
            sliding_window: 0,
            logit_softcap: 0.0,
        };
        let values = |n: usize, seed: usize| -> Vec<Bf16> {
            (0..n).map(|i| Bf16::from_f32(((i * seed) % 1000) as f32 / 1000.0 - 0.5)).collect()
        };
        let cache = values(shape.num_blocks * shape.block_stride, 7919);
        let query = values(prompt_len * NUM_HEADS * HEAD_DIM, 104729);
        let tables: Vec<i32> = (0..table_width).map(|i| (2 * i + 1) as i32).collect();
        let (starts, contexts) = ([0, prompt_len as i32], [prompt_len as i32]);
        let mut out = vec![Bf16::default(); query.len()];
        for isa in [Isa::Avx512, Isa::Avx2Fma, Isa::Portable].into_iter().filter(|isa| isa.is_supported()) {
            let id = BenchmarkId::new(format!("bf16 {isa:?}, prompt"), prompt_len);
            group.bench_with_input(id, &prompt_len, |b, _| {
                b.iter(|| {
                    let (keys, values) = (&cache[..], &cache[block..]);
                    paged_prefill_attention(
                        isa, &mut out, &query, keys, values, &tables, &starts, &contexts, &shape, 0.125, None, 2,
                    )
                    .unwrap();
                    black_box(&out);
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, prefill_attention);
criterion_main!(benches);

//! Paged prefill (and extend) attention on the CPU: each sequence's new tokens attend causally
//! to its cached K/V (the prompt's own and any cached prefix), read in place through the block
//! table. Flash-attention style: a tile of query tokens walks the context 32 keys at a time
//! with an online softmax, so scores never leave the cache and the masked half is skipped.
//!
//! A work item is (sequence, kv head, tile of query tokens); its rows are the tile's tokens
//! times the query heads of the kv head's GQA group, so each K/V chunk is widened and
//! transposed once for all of them. Head dims 64, 128 and 256.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::cpu_kernels::decode_attention::{check_paged_inputs, check_sinks, DecodeShape};
use crate::cpu_kernels::openmp_team::run_on_team;
use crate::cpu_kernels::simd::{exp_nonpositive, with_isa, Element, Isa};
use crate::errors::{Error, Result};

/// Keys per step of the context walk: two AVX-512 vectors of scores per query row, which
/// spreads each step's softmax bookkeeping (maxima, sums, rescaling) over enough keys.
const KEYS: usize = 32;
/// Lanes of the per-chunk maxima and sums (one AVX-512 vector).
const LANES: usize = 16;
/// Query tokens per work item.
const QUERY_TILE: usize = 32;
/// Head dims with a compiled kernel.
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// out[t, h] = softmax(softcap(scale * q[t, h] . K)) V over positions 0..=pos(t) of token t's sequence
/// (the last `shape.sliding_window` of them where set).
///
/// `shape.batch` is the number of sequences. Sequence b's new tokens are query rows
/// `query_start_loc[b]..query_start_loc[b + 1]`, the last ones of its `context_lens[b]` cached
/// tokens (their K/V are already written). query/out are `[num_tokens, num_heads, head_dim]`, of
/// one element type, the caches of another or the same (math in float32, the output rounded once).
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill_attention<T: Element, C: Element>(
    isa: Isa,
    out: &mut [T],
    query: &[T],
    key_cache: &[C],
    value_cache: &[C],
    block_tables: &[i32],
    query_start_loc: &[i32],
    context_lens: &[i32],
    shape: &DecodeShape,
    scale: f32,
    sinks: Option<&[f32]>,
    num_threads: usize,
) -> Result<()> {
    check_paged_inputs(isa, shape, key_cache, value_cache, block_tables, context_lens, 0)?;
    check_sinks(shape, sinks)?;
    let invalid = |message: String| Err(Error::InvalidConfig { field: "inputs", message });
    if !HEAD_DIMS.contains(&shape.head_dim) {
        return invalid(format!("head_dim={} has no prefill kernel (supported: {HEAD_DIMS:?})", shape.head_dim));
    }
    let row = shape.num_heads * shape.head_dim;
    let num_tokens = query.len() / row;
    if query.len() != num_tokens * row || out.len() != query.len() {
        return invalid("out and query must be [num_tokens, num_heads, head_dim]".into());
    }
    if query_start_loc.len() != shape.batch + 1
        || query_start_loc[0] != 0
        || query_start_loc[shape.batch] as usize != num_tokens
    {
        return invalid(format!("query_start_loc must be [batch+1], running from 0 to num_tokens={num_tokens}"));
    }
    for b in 0..shape.batch {
        let (new_tokens, context) = (query_start_loc[b + 1] - query_start_loc[b], context_lens[b]);
        if new_tokens < 0 || new_tokens > context {
            return invalid(format!("sequence {b} has {new_tokens} new tokens but context_lens[{b}]={context}"));
        }
    }

    let items = work_items(query_start_loc, context_lens, shape.num_kv_heads);
    if items.is_empty() {
        return Ok(());
    }
    let output = Mutex::new(out);
    let next_item = AtomicUsize::new(0);
    let work = || {
        let mut scratch = Scratch::default();
        while let Some(item) = items.get(next_item.fetch_add(1, Ordering::Relaxed)) {
            let inputs = TileInputs {
                query,
                key_cache,
                value_cache,
                table: &block_tables[item.seq * shape.table_width..][..shape.table_width],
                item: *item,
                shape: *shape,
                scale,
                sinks,
            };
            let s = &mut scratch;
            match (isa, shape.head_dim) {
                (Isa::Avx512, 64) => with_isa(isa, || attend_tile::<T, C, 64, 8, AVX512>(&inputs, s)),
                (Isa::Avx512, 128) => with_isa(isa, || attend_tile::<T, C, 128, 8, AVX512>(&inputs, s)),
                (Isa::Avx512, _) => with_isa(isa, || attend_tile::<T, C, 256, 8, AVX512>(&inputs, s)),
                (Isa::Avx2Fma, 64) => with_isa(isa, || attend_tile::<T, C, 64, 2, AVX2>(&inputs, s)),
                (Isa::Avx2Fma, 128) => with_isa(isa, || attend_tile::<T, C, 128, 2, AVX2>(&inputs, s)),
                (Isa::Avx2Fma, _) => with_isa(isa, || attend_tile::<T, C, 256, 2, AVX2>(&inputs, s)),
                (Isa::Portable, 64) => attend_tile::<T, C, 64, 4, PORTABLE>(&inputs, s),
                (Isa::Portable, 128) => attend_tile::<T, C, 128, 4, PORTABLE>(&inputs, s),
                (Isa::Portable, _) => attend_tile::<T, C, 256, 4, PORTABLE>(&inputs, s),
            }
            let mut out = output.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            scratch.write_rows(&mut out, &inputs);
        }
    };
    run_on_team(num_threads.clamp(1, items.len()), &work);
    Ok(())
}

/// One tile of one sequence's new tokens and one kv head.
#[derive(Debug, Clone, Copy)]
struct WorkItem {
    seq: usize,
    kv_head: usize,
    /// Query row of the tile's first token.
    first_token: usize,
    num_tokens: usize,
    /// Context position of the tile's first token.
    first_position: usize,
}

/// Every (sequence, kv head, query tile), the most work first (a tile's work grows with its
/// last position), so the threads finish together.
fn work_items(query_start_loc: &[i32], context_lens: &[i32], num_kv_heads: usize) -> Vec<WorkItem> {
    let mut items = Vec::new();
    for (seq, &context) in context_lens.iter().enumerate() {
        let (start, end) = (query_start_loc[seq] as usize, query_start_loc[seq + 1] as usize);
        let first_new_position = context as usize - (end - start);
        for first_token in (start..end).step_by(QUERY_TILE) {
            let num_tokens = QUERY_TILE.min(end - first_token);
            let first_position = first_new_position + (first_token - start);
            items.extend((0..num_kv_heads).map(|kv_head| WorkItem {
                seq,
                kv_head,
                first_token,
                num_tokens,
                first_position,
            }));
        }
    }
    items.sort_by_key(|item| std::cmp::Reverse(item.first_position + item.num_tokens));
    items
}

/// What one work item reads.
struct TileInputs<'a, T, C> {
    query: &'a [T],
    key_cache: &'a [C],
    value_cache: &'a [C],
    table: &'a [i32],
    item: WorkItem,
    shape: DecodeShape,
    scale: f32,
    /// One logit per query head that joins every softmax with a zero value (GPT-OSS's sinks).
    sinks: Option<&'a [f32]>,
}

/// A thread's working memory, reused across items.
#[derive(Default)]
struct Scratch {
    /// The tile's query rows (token-major, then group head), scaled, padded to whole row blocks.
    queries: Vec<f32>,
    /// Running max, sum of exponentials and weighted V sum of each row.
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
    /// The current chunk of keys transposed ([head_dim][KEYS]) and of values ([KEYS][head_dim]).
    keys_t: Vec<f32>,
    values: Vec<f32>,
}

impl Scratch {
    /// out rows of the item's tokens and group heads = acc / sum.
    fn write_rows<T: Element, C>(&self, out: &mut [T], inputs: &TileInputs<T, C>) {
        let (shape, item) = (&inputs.shape, &inputs.item);
        let (dim, group) = (shape.head_dim, shape.num_heads / shape.num_kv_heads);
        for t in 0..item.num_tokens {
            let token_row = (item.first_token + t) * shape.num_heads + item.kv_head * group;
            for g in 0..group {
                let r = t * group + g;
                let inverse = 1.0 / self.sum[r];
                let out = &mut out[(token_row + g) * dim..][..dim];
                for (o, a) in out.iter_mut().zip(&self.acc[r * dim..][..dim]) {
                    *o = T::from_f32(a * inverse);
                }
            }
        }
    }
}

/// The online softmax over the item's visible context, leaving each row's max, sum and
/// unnormalized output in `scratch`. `D` is the head dim, `ROWS` the query rows whose scores
/// are accumulated together (sized to the vector registers of the instruction set); `ISA`
/// which instructions the caller enabled.
#[inline(always)]
fn attend_tile<T: Element, C: Element, const D: usize, const ROWS: usize, const ISA: u8>(
    inputs: &TileInputs<T, C>,
    scratch: &mut Scratch,
) {
    let (shape, item) = (&inputs.shape, &inputs.item);
    let group = shape.num_heads / shape.num_kv_heads;
    let num_rows = item.num_tokens * group;
    let padded_rows = num_rows.div_ceil(ROWS) * ROWS;
    scratch.queries.clear();
    scratch.queries.resize(padded_rows * D, 0.0);
    for t in 0..item.num_tokens {
        let heads = &inputs.query[((item.first_token + t) * shape.num_heads + item.kv_head * group) * D..][..group * D];
        for (q, &x) in scratch.queries[t * group * D..][..group * D].iter_mut().zip(heads) {
            *q = x.to_f32() * inputs.scale;
        }
    }
    scratch.max.clear();
    scratch.sum.clear();
    match inputs.sinks {
        // A sink is a key seen before all others: the running max starts at it, the sum at exp(0).
        Some(sinks) => {
            let group_sinks = &sinks[item.kv_head * group..][..group];
            scratch.max.extend((0..num_rows).map(|r| group_sinks[r % group]));
            scratch.sum.resize(num_rows, 1.0);
        }
        None => {
            scratch.max.resize(num_rows, f32::NEG_INFINITY);
            scratch.sum.resize(num_rows, 0.0);
        }
    }
    scratch.acc.clear();
    scratch.acc.resize(num_rows * D, 0.0);
    scratch.keys_t.resize(D * KEYS, 0.0);
    scratch.values.resize(KEYS * D, 0.0);

    // Keys first_key..=last_position; row r (token r / group, at position p) sees
    // shape.first_visible(p)..=p.
    let last_position = item.first_position + item.num_tokens - 1;
    let first_key = shape.first_visible(item.first_position) / KEYS * KEYS;
    for chunk_start in (first_key..=last_position).step_by(KEYS) {
        let chunk_len = KEYS.min(last_position + 1 - chunk_start);
        load_chunk::<T, C, D>(inputs, chunk_start, chunk_len, &mut scratch.keys_t, &mut scratch.values);
        // Tokens before first_token see nothing of this chunk (it lies in their future).
        let first_token = chunk_start.saturating_sub(item.first_position);
        for block in (first_token * group / ROWS * ROWS..num_rows).step_by(ROWS) {
            let mut scores = block_scores::<D, ROWS, ISA>(&scratch.queries[block * D..][..ROWS * D], &scratch.keys_t);
            scores.iter_mut().for_each(|row| shape.soft_cap(row));
            for (i, row_scores) in scores.iter().enumerate().take(num_rows - block) {
                let r = block + i;
                let position = item.first_position + r / group;
                let visible_end = (position + 1).saturating_sub(chunk_start).min(chunk_len);
                let visible_start = shape.first_visible(position).saturating_sub(chunk_start);
                if visible_start >= visible_end {
                    continue;
                }
                let acc: &mut [f32; D] = (&mut scratch.acc[r * D..][..D]).try_into().unwrap();
                let (max, sum) = (&mut scratch.max[r], &mut scratch.sum[r]);
                let visible = visible_start..visible_end;
                online_softmax_step::<D, ISA>(row_scores, visible, max, sum, acc, &scratch.values);
            }
        }
    }
}

/// Keys chunk_start..chunk_start + len of the item's sequence and kv head, widened to f32:
/// keys transposed into keys_t[d][j], values row by row; positions past len are zeros.
#[inline(always)]
fn load_chunk<T, C: Element, const D: usize>(
    inputs: &TileInputs<T, C>,
    chunk_start: usize,
    len: usize,
    keys_t: &mut [f32],
    values: &mut [f32],
) {
    let shape = &inputs.shape;
    let head_rows = inputs.item.kv_head * shape.block_size * D;
    for j in 0..KEYS {
        let value_row = &mut values[j * D..][..D];
        if j >= len {
            value_row.fill(0.0);
            (0..D).for_each(|d| keys_t[d * KEYS + j] = 0.0);
            continue;
        }
        let position = chunk_start + j;
        let block = inputs.table[position / shape.block_size] as usize;
        let offset = block * shape.block_stride + head_rows + (position % shape.block_size) * D;
        let (key, value) = (&inputs.key_cache[offset..][..D], &inputs.value_cache[offset..][..D]);
        // Separate loops: the value row is a contiguous widening (vectorized), the key a scatter.
        for (v, x) in value_row.iter_mut().zip(value) {
            *v = x.to_f32();
        }
        for (d, x) in key.iter().enumerate() {
            keys_t[d * KEYS + j] = x.to_f32();
        }
    }
}

/// Scores of ROWS query rows against the chunk's KEYS keys: ROWS accumulators of KEYS lanes,
/// one broadcast multiply-add per (row, dim), enough independent chains to hide FMA latency.
#[inline(always)]
fn block_scores<const D: usize, const ROWS: usize, const ISA: u8>(
    queries: &[f32],
    keys_t: &[f32],
) -> [[f32; KEYS]; ROWS] {
    assert!(queries.len() >= ROWS * D && keys_t.len() >= D * KEYS);
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: ISA names features the caller's #[target_feature] enabled; the lengths are
        // asserted above.
        if ISA == AVX512 {
            return unsafe { x86::block_scores_avx512::<D, ROWS>(queries.as_ptr(), keys_t.as_ptr()) };
        }
        if ISA == AVX2 {
            return unsafe { x86::block_scores_avx2::<D, ROWS>(queries.as_ptr(), keys_t.as_ptr()) };
        }
    }
    let mut scores = [[0.0f32; KEYS]; ROWS];
    for d in 0..D {
        for (i, row) in scores.iter_mut().enumerate() {
            let q = queries[i * D + d];
            for j in 0..KEYS {
                row[j] += q * keys_t[d * KEYS + j];
            }
        }
    }
    scores
}

/// Folds one chunk's scores (those in `visible`) into a row's running max, sum and weighted
/// value sum.
#[inline(always)]
fn online_softmax_step<const D: usize, const ISA: u8>(
    scores: &[f32; KEYS],
    visible: std::ops::Range<usize>,
    max: &mut f32,
    sum: &mut f32,
    acc: &mut [f32; D],
    values: &[f32],
) {
    // Maxima and sums lane by lane, then across lanes in a tree: written so, they vectorize (a
    // plain fold is a chain of scalar compares and adds, as float addition does not reassociate).
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for (half, chunk) in scores.chunks_exact(LANES).enumerate() {
        for l in 0..LANES {
            let score = if visible.contains(&(half * LANES + l)) { chunk[l] } else { f32::NEG_INFINITY };
            lanes[l] = if score > lanes[l] { score } else { lanes[l] };
        }
    }
    let new_max = max.max(tree_reduce(lanes, |a, b| if a > b { a } else { b }));
    let correction = exp_nonpositive(*max - new_max); // the first chunk: acc and sum are 0 anyway
    *max = new_max;
    let mut weights = [0.0f32; KEYS];
    for j in 0..KEYS {
        let weight = exp_nonpositive(scores[j] - new_max);
        weights[j] = if visible.contains(&j) { weight } else { 0.0 };
    }
    let mut lanes = [0.0f32; LANES];
    for chunk in weights.chunks_exact(LANES) {
        for l in 0..LANES {
            lanes[l] += chunk[l];
        }
    }
    *sum = *sum * correction + tree_reduce(lanes, |a, b| a + b);
    assert!(values.len() >= KEYS * D);
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: as in block_scores; values holds KEYS rows of D (asserted above).
        if ISA == AVX512 {
            return unsafe { x86::rescale_and_add_avx512::<D>(acc, correction, &weights, values.as_ptr()) };
        }
        if ISA == AVX2 {
            return unsafe { x86::rescale_and_add_avx2::<D>(acc, correction, &weights, values.as_ptr()) };
        }
    }
    acc.iter_mut().for_each(|a| *a *= correction);
    for (j, &weight) in weights.iter().enumerate() {
        for (a, &v) in acc.iter_mut().zip(&values[j * D..][..D]) {
            *a += weight * v;
        }
    }
}

/// Combines the lanes pairwise, halving the width each step.
#[inline(always)]
fn tree_reduce(mut lanes: [f32; LANES], combine: impl Fn(f32, f32) -> f32) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            lanes[l] = combine(lanes[l], lanes[l + width]);
        }
        width /= 2;
    }
    lanes[0]
}

/// `Isa` as a const parameter of the shared code.
const PORTABLE: u8 = 0;
const AVX2: u8 = 1;
const AVX512: u8 = 2;

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // registers indexed by lane group, on purpose
mod x86 {
    use std::arch::x86_64::*;

    use super::KEYS;

    /// `block_scores` on AVX-512F: one 16-lane accumulator per row.
    #[inline(always)]
    pub unsafe fn block_scores_avx512<const D: usize, const ROWS: usize>(
        queries: *const f32,
        keys_t: *const f32,
    ) -> [[f32; KEYS]; ROWS] {
        const LANES: usize = KEYS / 16;
        let mut acc = [[_mm512_setzero_ps(); LANES]; ROWS];
        for d in 0..D {
            let mut keys = [_mm512_setzero_ps(); LANES];
            for l in 0..LANES {
                keys[l] = _mm512_loadu_ps(keys_t.add(d * KEYS + l * 16));
            }
            for i in 0..ROWS {
                let q = _mm512_set1_ps(*queries.add(i * D + d));
                for l in 0..LANES {
                    acc[i][l] = _mm512_fmadd_ps(q, keys[l], acc[i][l]);
                }
            }
        }
        let mut scores = [[0.0f32; KEYS]; ROWS];
        for i in 0..ROWS {
            for l in 0..LANES {
                _mm512_storeu_ps(scores[i].as_mut_ptr().add(l * 16), acc[i][l]);
            }
        }
        scores
    }

    /// `block_scores` on AVX2 and FMA: two 8-lane accumulators per row.
    #[inline(always)]
    pub unsafe fn block_scores_avx2<const D: usize, const ROWS: usize>(
        queries: *const f32,
        keys_t: *const f32,
    ) -> [[f32; KEYS]; ROWS] {
        const LANES: usize = KEYS / 8;
        let mut acc = [[_mm256_setzero_ps(); LANES]; ROWS];
        for d in 0..D {
            let mut keys = [_mm256_setzero_ps(); LANES];
            for l in 0..LANES {
                keys[l] = _mm256_loadu_ps(keys_t.add(d * KEYS + l * 8));
            }
            for i in 0..ROWS {
                let q = _mm256_set1_ps(*queries.add(i * D + d));
                for l in 0..LANES {
                    acc[i][l] = _mm256_fmadd_ps(q, keys[l], acc[i][l]);
                }
            }
        }
        let mut scores = [[0.0f32; KEYS]; ROWS];
        for i in 0..ROWS {
            for l in 0..LANES {
                _mm256_storeu_ps(scores[i].as_mut_ptr().add(l * 8), acc[i][l]);
            }
        }
        scores
    }

    /// acc = acc * correction + sum_j weights[j] * values[j], D / 16 registers of output.
    #[inline(always)]
    pub unsafe fn rescale_and_add_avx512<const D: usize>(
        acc: &mut [f32; D],
        correction: f32,
        weights: &[f32; KEYS],
        values: *const f32,
    ) {
        let mut total = [_mm512_setzero_ps(); 16]; // D <= 256
        let correction = _mm512_set1_ps(correction);
        for c in 0..D / 16 {
            total[c] = _mm512_mul_ps(_mm512_loadu_ps(acc.as_ptr().add(c * 16)), correction);
        }
        for (j, &weight) in weights.iter().enumerate() {
            let weight = _mm512_set1_ps(weight);
            for c in 0..D / 16 {
                total[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(values.add(j * D + c * 16)), total[c]);
            }
        }
        for c in 0..D / 16 {
            _mm512_storeu_ps(acc.as_mut_ptr().add(c * 16), total[c]);
        }
    }

    /// `rescale_and_add_avx512` in 8-lane registers.
    #[inline(always)]
    pub unsafe fn rescale_and_add_avx2<const D: usize>(
        acc: &mut [f32; D],
        correction: f32,
        weights: &[f32; KEYS],
        values: *const f32,
    ) {
        let mut total = [_mm256_setzero_ps(); 32]; // D <= 256
        let correction = _mm256_set1_ps(correction);
        for c in 0..D / 8 {
            total[c] = _mm256_mul_ps(_mm256_loadu_ps(acc.as_ptr().add(c * 8)), correction);
        }
        for (j, &weight) in weights.iter().enumerate() {
            let weight = _mm256_set1_ps(weight);
            for c in 0..D / 8 {
                total[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(values.add(j * D + c * 8)), total[c]);
            }
        }
        for c in 0..D / 8 {
            _mm256_storeu_ps(acc.as_mut_ptr().add(c * 8), total[c]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_kernels::decode_attention::tests::{pseudo_random, soft_cap_f64};
    use crate::cpu_kernels::fp8::{Fp8E4m3, Fp8E5m2};
    use crate::cpu_kernels::simd::Bf16;

    /// float64 attention of every new token over its sequence's visible context.
    #[allow(clippy::too_many_arguments)]
    fn reference<C: Element>(
        query: &[f32],
        keys: &[C],
        values: &[C],
        tables: &[i32],
        starts: &[i32],
        contexts: &[i32],
        shape: &DecodeShape,
        scale: f32,
        sinks: Option<&[f32]>,
    ) -> Vec<f32> {
        let (dim, group) = (shape.head_dim, shape.num_heads / shape.num_kv_heads);
        let mut out = vec![0.0f32; query.len()];
        let at = |cache: &[C], b: usize, kv: usize, pos: usize, d: usize| {
            let block = tables[b * shape.table_width + pos / shape.block_size] as usize;
            cache[block * shape.block_stride + (kv * shape.block_size + pos % shape.block_size) * dim + d].to_f32()
                as f64
        };
        for b in 0..shape.batch {
            let (start, end) = (starts[b] as usize, starts[b + 1] as usize);
            for t in start..end {
                let visible = contexts[b] as usize - (end - t) + 1;
                let first = shape.first_visible(visible - 1);
                for h in 0..shape.num_heads {
                    let q = &query[(t * shape.num_heads + h) * dim..][..dim];
                    let logits: Vec<f64> = (first..visible)
                        .map(|p| {
                            let logit = (0..dim).map(|d| q[d] as f64 * at(keys, b, h / group, p, d)).sum::<f64>();
                            soft_cap_f64(logit * scale as f64, shape.logit_softcap)
                        })
                        .collect();
                    let sink = sinks.map_or(f64::NEG_INFINITY, |sinks| sinks[h] as f64);
                    let max = logits.iter().cloned().fold(sink, f64::max);
                    let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
                    let total: f64 = weights.iter().sum::<f64>() + (sink - max).exp();
                    for d in 0..dim {
                        let v: f64 =
                            (first..visible).zip(&weights).map(|(p, w)| w * at(values, b, h / group, p, d)).sum();
                        out[(t * shape.num_heads + h) * dim + d] = (v / total) as f32;
                    }
                }
            }
        }
        out
    }

    /// A whole prompt, a chunk after a cached prefix, a one-token chunk and an empty sequence,
    /// blocks scattered over the pool, every instruction set this CPU runs. Queries and outputs
    /// are of type T, the caches of type C.
    fn check<T: Element, C: Element>(
        head_dim: usize,
        block_size: usize,
        convert: fn(f32) -> T,
        to_cache: fn(f32) -> C,
        tolerance: f32,
    ) {
        let (num_heads, num_kv_heads) = (9, 3);
        let new_tokens = [70usize, 37, 1, 0];
        let contexts = [70i32, 150, 9, 5];
        let table_width = 150usize.div_ceil(block_size);
        let num_blocks = 4 * table_width + 3;
        let shape = DecodeShape {
            batch: 4,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            num_blocks,
            block_stride: 3 * num_kv_heads * block_size * head_dim,
            table_width,
            sliding_window: 0,
            logit_softcap: 0.0,
        };
        let cache: Vec<C> = pseudo_random(num_blocks * shape.block_stride, 1).into_iter().map(to_cache).collect();
        let values = &cache[num_kv_heads * block_size * head_dim..];
        let tables: Vec<i32> = (0..4 * table_width).map(|i| ((i * 17 + 5) % num_blocks) as i32).collect();
        let mut starts = vec![0i32];
        for n in new_tokens {
            starts.push(starts.last().unwrap() + n as i32);
        }
        let num_tokens = *starts.last().unwrap() as usize;
        let query: Vec<T> = pseudo_random(num_tokens * num_heads * head_dim, 2).into_iter().map(convert).collect();
        let widened: Vec<f32> = query.iter().map(|q| q.to_f32()).collect();
        let scale = 1.0 / (head_dim as f32).sqrt();
        // windows: none, one token, inside one key chunk, across chunks and blocks, past every
        // context; soft-capped logits with and without a window
        // and attention sinks (one logit of up to +-2 per query head)
        let sink_values: Vec<f32> = pseudo_random(num_heads, 9).iter().map(|x| 2.0 * x).collect();
        for (sliding_window, logit_softcap, with_sinks) in [
            (0, 0.0, false),
            (1, 0.0, false),
            (20, 0.0, false),
            (45, 0.0, false),
            (200, 0.0, false),
            (0, 0.3, false),
            (20, 0.3, false),
            (0, 0.0, true),
            (20, 0.0, true),
        ] {
            let shape = DecodeShape { sliding_window, logit_softcap, ..shape };
            let sinks = with_sinks.then_some(&sink_values[..]);
            let want = reference(&widened, &cache, values, &tables, &starts, &contexts, &shape, scale, sinks);
            for isa in [Isa::Avx512, Isa::Avx2Fma, Isa::Portable].into_iter().filter(|isa| isa.is_supported()) {
                let mut out = vec![convert(f32::NAN); query.len()];
                paged_prefill_attention(
                    isa, &mut out, &query, &cache, values, &tables, &starts, &contexts, &shape, scale, sinks, 2,
                )
                .unwrap();
                let error = out.iter().zip(&want).map(|(a, b)| (a.to_f32() - b).abs()).fold(0.0f32, f32::max);
                assert!(error < tolerance, "{isa:?} d{head_dim} bs{block_size} window {sliding_window} cap {logit_softcap} sinks {with_sinks}: error {error}");
            }
        }
    }

    #[test]
    fn matches_the_reference_for_prompts_and_chunks_after_a_prefix() {
        check(64, 16, |x| x, |x| x, 2e-5);
        check(128, 32, |x| x, |x| x, 2e-5);
        check(64, 8, |x| x, |x| x, 2e-5);
        // bfloat16 outputs: one rounding (half an ulp of values below 1 is < 2e-3).
        check(64, 16, Bf16::from_f32, Bf16::from_f32, 2e-3);
        check(128, 16, Bf16::from_f32, Bf16::from_f32, 2e-3);
        check(256, 16, |x| x, |x| x, 2e-5); // Gemma 3's
        check(256, 32, Bf16::from_f32, Bf16::from_f32, 2e-3);
    }

    #[test]
    fn float8_caches_match_the_reference_on_their_widened_values() {
        // float32 queries and outputs, as the engine passes them with float8 caches.
        check(64, 16, |x| x, Fp8E4m3::from_f32, 2e-5);
        check(128, 32, |x| x, Fp8E4m3::from_f32, 2e-5);
        check(64, 16, |x| x, Fp8E5m2::from_f32, 2e-5);
    }

    #[test]
    fn bad_inputs_are_errors_not_panics() {
        let shape = DecodeShape {
            batch: 1,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 64,
            block_size: 16,
            num_blocks: 2,
            block_stride: 16 * 64,
            table_width: 2,
            sliding_window: 0,
            logit_softcap: 0.0,
        };
        let cache = vec![0.0f32; 2 * 16 * 64];
        let query = vec![0.0f32; 3 * 2 * 64];
        let mut out = vec![0.0f32; query.len()];
        let run = |out: &mut [f32], starts: &[i32], contexts: &[i32], tables: &[i32], shape: &DecodeShape| {
            paged_prefill_attention(
                Isa::Portable,
                out,
                &query,
                &cache,
                &cache,
                tables,
                starts,
                contexts,
                shape,
                1.0,
                None,
                1,
            )
        };
        assert!(run(&mut out, &[0, 3], &[2], &[0, 1], &shape).is_err()); // more new tokens than context
        assert!(run(&mut out, &[0, 3], &[40], &[0, 1], &shape).is_err()); // past the table
        assert!(run(&mut out, &[0, 3], &[20], &[0, 7], &shape).is_err()); // block out of the pool
        assert!(run(&mut out, &[0, 2], &[20], &[0, 1], &shape).is_err()); // starts do not cover the query
        assert!(run(&mut out, &[0, 3], &[20], &[0, 1], &DecodeShape { head_dim: 80, ..shape }).is_err());
        assert!(run(&mut out, &[0, 3], &[20], &[0, 1], &shape).is_ok());
    }
}

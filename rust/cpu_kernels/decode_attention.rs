//! Paged decode attention on the CPU: one query token per sequence, K/V read in place through
//! the block table (no gather copy), each K/V row read once for all query heads of its GQA
//! group. Caches hold float32, bfloat16 (half the bytes to read) or float8 (a quarter), read as
//! the queries' type or float8 with float32 queries; math stays float32. The CPU engine's hot
//! path; the torch reference backend stays the oracle.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::cpu_kernels::openmp_team::run_on_team;
use crate::cpu_kernels::simd::{exp_nonpositive, Element, ElementKind, Isa};
use crate::errors::{Error, Result};

/// Shapes and strides of one call. Caches are per-layer views `[num_blocks, num_kv_heads,
/// block_size, head_dim]` whose blocks are `block_stride` elements apart (the block-major cache
/// interleaves layers); query/out are `[batch, num_heads, head_dim]`, contiguous, of one element
/// type, the caches of another or the same (math in float32, the output rounded once).
#[derive(Debug, Clone, Copy)]
pub struct DecodeShape {
    pub batch: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub block_stride: usize,
    /// Row length of `block_tables` ([batch, table_width]).
    pub table_width: usize,
    /// A token attends to the last `sliding_window` positions up to and including its own
    /// (Mistral's, Gemma's local layers); 0 attends to the whole context.
    pub sliding_window: usize,
    /// Logits become `cap * tanh(logit / cap)` before the softmax (Gemma 2's attention soft
    /// cap); 0 leaves them as they are.
    pub logit_softcap: f32,
}

impl DecodeShape {
    /// Elements a cache slice must span.
    pub fn cache_len(&self) -> usize {
        if self.num_blocks == 0 {
            return 0;
        }
        (self.num_blocks - 1) * self.block_stride + self.num_kv_heads * self.block_size * self.head_dim
    }

    /// The first position a token at `position` attends to.
    pub fn first_visible(&self, position: usize) -> usize {
        if self.sliding_window == 0 {
            0
        } else {
            (position + 1).saturating_sub(self.sliding_window)
        }
    }

    /// Soft-caps scaled logits in place where the shape asks for it.
    #[inline(always)]
    pub fn soft_cap(&self, logits: &mut [f32]) {
        if self.logit_softcap > 0.0 {
            let (cap, inverse) = (self.logit_softcap, 1.0 / self.logit_softcap);
            for logit in logits {
                *logit = cap * tanh(*logit * inverse);
            }
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        let invalid = |message: String| Err(Error::InvalidConfig { field: "shape", message });
        if !(self.logit_softcap >= 0.0 && self.logit_softcap.is_finite()) {
            return invalid(format!("logit_softcap={} must be finite and >= 0", self.logit_softcap));
        }
        if self.num_kv_heads == 0 || self.num_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return invalid(format!(
                "num_heads={} must be a multiple of num_kv_heads={}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || self.block_size == 0 {
            return invalid("head_dim and block_size must be > 0".into());
        }
        if self.block_stride < self.num_kv_heads * self.block_size * self.head_dim {
            return invalid(format!("block_stride={} is smaller than a block", self.block_stride));
        }
        Ok(())
    }
}

/// out[b, h] = softmax(softcap(scale * q[b, h] . K_b)) V_b over the first context_lens[b] tokens of
/// sequence b (the last `shape.sliding_window` of them where set), split over `num_threads`
/// threads by sequence. `sinks` (one logit per query head, GPT-OSS's attention sinks) join each
/// head's softmax as a key whose value is zero: they only take weight from the real keys.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention<T: Element, C: Element>(
    out: &mut [T],
    query: &[T],
    key_cache: &[C],
    value_cache: &[C],
    block_tables: &[i32],
    context_lens: &[i32],
    shape: &DecodeShape,
    scale: f32,
    sinks: Option<&[f32]>,
    num_threads: usize,
) -> Result<()> {
    paged_decode_attention_with(
        Isa::best(),
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        shape,
        scale,
        sinks,
        num_threads,
    )
}

/// `paged_decode_attention` with a chosen instruction set (benches and tests compare them); an
/// instruction set this CPU lacks is an error.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_with<T: Element, C: Element>(
    isa: Isa,
    out: &mut [T],
    query: &[T],
    key_cache: &[C],
    value_cache: &[C],
    block_tables: &[i32],
    context_lens: &[i32],
    shape: &DecodeShape,
    scale: f32,
    sinks: Option<&[f32]>,
    num_threads: usize,
) -> Result<()> {
    check_paged_inputs(isa, shape, key_cache, value_cache, block_tables, context_lens, 1)?;
    check_sinks(shape, sinks)?;
    let row = shape.num_heads * shape.head_dim;
    if out.len() != shape.batch * row || query.len() != shape.batch * row {
        let message = "out and query must be [batch, num_heads, head_dim]".into();
        return Err(Error::InvalidConfig { field: "inputs", message });
    }
    if shape.batch == 0 {
        return Ok(());
    }
    // Work items are (sequence, kv head) pairs, claimed one at a time from a shared counter, as
    // sequences differ in length; the threads are torch's OpenMP team where there is one.
    let group_width = row / shape.num_kv_heads;
    let outputs: Vec<Mutex<&mut [T]>> = out.chunks_mut(group_width).map(Mutex::new).collect();
    let next_item = AtomicUsize::new(0);
    let work = || {
        let mut scratch = Vec::new();
        loop {
            let item = next_item.fetch_add(1, Ordering::Relaxed);
            let Some(output) = outputs.get(item) else {
                break;
            };
            let (b, kv_head) = (item / shape.num_kv_heads, item % shape.num_kv_heads);
            let inputs = HeadInputs {
                queries: &query[item * group_width..][..group_width],
                key_cache,
                value_cache,
                table: &block_tables[b * shape.table_width..][..shape.table_width],
                start: shape.first_visible(context_lens[b] as usize - 1),
                context: context_lens[b] as usize,
                kv_head,
                shape: *shape,
                scale,
                sinks: sinks.map(|sinks| &sinks[kv_head * (shape.num_heads / shape.num_kv_heads)..]),
            };
            // Each item is claimed once, so its lock is never contended.
            let mut output = output.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            attend(isa, &mut output, &inputs, &mut scratch);
        }
    };
    run_on_team(num_threads.clamp(1, outputs.len()), &work);
    Ok(())
}

/// Sinks, where given, are one finite logit per query head.
pub(crate) fn check_sinks(shape: &DecodeShape, sinks: Option<&[f32]>) -> Result<()> {
    match sinks {
        Some(sinks) if sinks.len() != shape.num_heads || !sinks.iter().all(|sink| sink.is_finite()) => {
            Err(Error::InvalidConfig {
                field: "sinks",
                message: format!("must be {} finite logits (one per query head), got {}", shape.num_heads, sinks.len()),
            })
        }
        _ => Ok(()),
    }
}

/// The checks the CPU attention kernels share: `isa` runs here, the shape is consistent, the
/// caches hold `num_blocks` blocks, and each sequence's `min_context..` context lies in its block
/// table row, whose blocks are in the pool.
pub(crate) fn check_paged_inputs<T>(
    isa: Isa,
    shape: &DecodeShape,
    key_cache: &[T],
    value_cache: &[T],
    block_tables: &[i32],
    context_lens: &[i32],
    min_context: i32,
) -> Result<()> {
    if !isa.is_supported() {
        return Err(Error::InvalidConfig { field: "isa", message: format!("this CPU cannot run {isa:?}") });
    }
    shape.check()?;
    let invalid = |message: String| Err(Error::InvalidConfig { field: "inputs", message });
    if key_cache.len() < shape.cache_len() || value_cache.len() < shape.cache_len() {
        return invalid("the caches are smaller than num_blocks blocks".into());
    }
    if block_tables.len() != shape.batch * shape.table_width || context_lens.len() != shape.batch {
        return invalid("block_tables must be [batch, table_width] and context_lens [batch]".into());
    }
    for (b, &context) in context_lens.iter().enumerate() {
        let blocks_needed = (context.max(0) as usize).div_ceil(shape.block_size);
        if context < min_context || blocks_needed > shape.table_width {
            return invalid(format!(
                "context_lens[{b}]={context} must be in {min_context}..={}",
                shape.table_width * shape.block_size
            ));
        }
        let table = &block_tables[b * shape.table_width..][..blocks_needed];
        if let Some(&block) = table.iter().find(|&&block| block < 0 || block as usize >= shape.num_blocks) {
            return invalid(format!("block {block} in block_tables[{b}] is not in 0..{}", shape.num_blocks));
        }
    }
    Ok(())
}

/// What one (sequence, kv head) call reads.
struct HeadInputs<'a, T, C> {
    /// The group's query rows, [group, head_dim].
    queries: &'a [T],
    key_cache: &'a [C],
    value_cache: &'a [C],
    table: &'a [i32],
    /// Attends to positions start..context.
    start: usize,
    context: usize,
    kv_head: usize,
    shape: DecodeShape,
    scale: f32,
    /// The attention sinks of the group's query heads (from its first), if any.
    sinks: Option<&'a [f32]>,
}

impl<T, C> HeadInputs<'_, T, C> {
    /// Softmax numerators of query head g's logits in place; returns their sum (with the head's
    /// sink, where there is one, in the max and the sum).
    #[inline(always)]
    fn exp_normalize(&self, g: usize, logits: &mut [f32]) -> f32 {
        match self.sinks {
            None => exp_normalize(logits, f32::NEG_INFINITY),
            Some(sinks) => exp_normalize(logits, sinks[g]),
        }
    }
}

/// One sequence and kv head on a supported instruction set.
fn attend<T: Element, C: Element>(isa: Isa, out: &mut [T], inputs: &HeadInputs<T, C>, scratch: &mut Vec<f32>) {
    match isa {
        // SAFETY: the caller checked that the CPU supports `isa`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { attend_avx512(out, inputs, scratch) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { attend_avx2(out, inputs, scratch) },
        _ => attend_any_dim::<T, C, PORTABLE>(out, inputs, scratch),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn attend_avx512<T: Element, C: Element>(out: &mut [T], inputs: &HeadInputs<T, C>, scratch: &mut Vec<f32>) {
    attend_any_dim::<T, C, AVX512>(out, inputs, scratch);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2<T: Element, C: Element>(out: &mut [T], inputs: &HeadInputs<T, C>, scratch: &mut Vec<f32>) {
    attend_any_dim::<T, C, AVX2>(out, inputs, scratch);
}

/// `Isa` as a const parameter of the shared code.
const PORTABLE: u8 = 0;
const AVX2: u8 = 1;
const AVX512: u8 = 2;

/// The common head dims get their own copy, whose loops unroll and whose accumulators stay in
/// registers; any other dim runs the same code with the dim read at run time.
#[inline(always)]
fn attend_any_dim<T: Element, C: Element, const ISA: u8>(
    out: &mut [T],
    inputs: &HeadInputs<T, C>,
    scratch: &mut Vec<f32>,
) {
    let widened = matches!(C::KIND, ElementKind::Fp8E4m3 | ElementKind::Fp8E5m2);
    match (inputs.shape.head_dim, widened) {
        (64, false) => attend_head::<T, C, 64, ISA>(out, inputs, scratch),
        (128, false) => attend_head::<T, C, 128, ISA>(out, inputs, scratch),
        (256, false) => attend_head::<T, C, 256, ISA>(out, inputs, scratch),
        (_, false) => attend_head::<T, C, 0, ISA>(out, inputs, scratch),
        (64, true) => attend_head_widened::<T, C, 64, ISA>(out, inputs, scratch),
        (128, true) => attend_head_widened::<T, C, 128, ISA>(out, inputs, scratch),
        (256, true) => attend_head_widened::<T, C, 256, ISA>(out, inputs, scratch),
        (_, true) => attend_head_widened::<T, C, 0, ISA>(out, inputs, scratch),
    }
}

/// `attend_head` for float8 caches: each block is widened to f32 once and then read by every
/// query head of the group, since widening a float8 costs several times the multiply-add it
/// feeds (reading it in place, once per head, ran 2.5x slower than a bfloat16 cache).
#[inline(always)]
fn attend_head_widened<T: Element, C: Element, const D: usize, const ISA: u8>(
    out: &mut [T],
    inputs: &HeadInputs<T, C>,
    scratch: &mut Vec<f32>,
) {
    let dim = if D > 0 { D } else { inputs.shape.head_dim };
    let (context, block_size) = (inputs.context - inputs.start, inputs.shape.block_size);
    let group = inputs.shape.num_heads / inputs.shape.num_kv_heads;
    let blocks = |cache, prefetch| block_rows(cache, inputs, prefetch);
    // scratch: logits (then softmax numerators), the query rows widened to f32, the group's
    // output accumulators, one block widened to f32.
    scratch.clear();
    scratch.resize(group * context + 2 * group * dim + block_size * dim, 0.0);
    let (logits, rest) = scratch.split_at_mut(group * context);
    let (queries, rest) = rest.split_at_mut(group * dim);
    let (accumulators, block) = rest.split_at_mut(group * dim);
    for (q, x) in queries.iter_mut().zip(inputs.queries) {
        *q = x.to_f32();
    }
    for (first, rows) in blocks(inputs.key_cache, true) {
        let keys = &mut block[..rows.len()];
        widen::<C, ISA>(rows, keys);
        for (offset, key) in keys.chunks_exact(dim).enumerate() {
            for g in 0..group {
                let query = &queries[g * dim..][..dim];
                logits[g * context + first + offset] = dot::<f32, ISA>(query, key) * inputs.scale;
            }
        }
    }
    inputs.shape.soft_cap(logits);
    let inverses: Vec<f32> =
        (0..group).map(|g| 1.0 / inputs.exp_normalize(g, &mut logits[g * context..][..context])).collect();
    for (first, rows) in blocks(inputs.value_cache, true) {
        let values = &mut block[..rows.len()];
        widen::<C, ISA>(rows, values);
        for g in 0..group {
            let weights = &logits[g * context + first..];
            let acc = &mut accumulators[g * dim..][..dim];
            if D > 0 {
                // A fixed-size copy, so the block's multiply-adds keep it in registers.
                let mut registers = [0.0f32; D];
                registers.copy_from_slice(acc);
                for (value, &weight) in values.chunks_exact(D).zip(weights) {
                    for d in 0..D {
                        registers[d] = fmadd::<ISA>(weight, value[d], registers[d]);
                    }
                }
                acc.copy_from_slice(&registers);
            } else {
                for (value, &weight) in values.chunks_exact(dim).zip(weights) {
                    for (a, &v) in acc.iter_mut().zip(value) {
                        *a = fmadd::<ISA>(weight, v, *a);
                    }
                }
            }
        }
    }
    for (g, inverse) in inverses.into_iter().enumerate() {
        for (o, &a) in out[g * dim..][..dim].iter_mut().zip(&accumulators[g * dim..][..dim]) {
            *o = T::from_f32(a * inverse);
        }
    }
}

/// dst = src widened to f32, with SIMD loads where the caller enabled them.
#[inline(always)]
fn widen<C: Element, const ISA: u8>(src: &[C], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: ISA names features the caller's #[target_feature] enabled; equal lengths
        // (asserted above) bound every load and store.
        if ISA == AVX512 && src.len().is_multiple_of(16) {
            return unsafe { x86::widen16(src, dst) };
        }
        if ISA == AVX2 && src.len().is_multiple_of(8) {
            return unsafe { x86::widen8(src, dst) };
        }
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// Logits for the group's query heads, softmax, weighted V sum. `D` is the head dim, or 0 to
/// read it from the shape; `ISA` says which instructions the caller enabled.
#[inline(always)]
fn attend_head<T: Element, C: Element, const D: usize, const ISA: u8>(
    out: &mut [T],
    inputs: &HeadInputs<T, C>,
    scratch: &mut Vec<f32>,
) {
    let dim = if D > 0 { D } else { inputs.shape.head_dim };
    let context = inputs.context - inputs.start;
    let group = inputs.shape.num_heads / inputs.shape.num_kv_heads;
    let blocks = |cache, prefetch| block_rows(cache, inputs, prefetch);
    // scratch: the group's logits (then softmax numerators), their sums, the query rows widened
    // to f32, and one output row for the run-time head dim.
    scratch.clear();
    scratch.resize(group * context + group + group * dim + dim, 0.0);
    let (logits, rest) = scratch.split_at_mut(group * context);
    let (sums, rest) = rest.split_at_mut(group);
    let (queries, row) = rest.split_at_mut(group * dim);
    for (q, x) in queries.iter_mut().zip(inputs.queries) {
        *q = x.to_f32();
    }
    for (first, rows) in blocks(inputs.key_cache, true) {
        for (offset, key) in rows.chunks_exact(dim).enumerate() {
            for g in 0..group {
                let query = &queries[g * dim..][..dim];
                logits[g * context + first + offset] = dot::<C, ISA>(query, key) * inputs.scale;
            }
        }
    }
    inputs.shape.soft_cap(logits);
    for g in 0..group {
        sums[g] = inputs.exp_normalize(g, &mut logits[g * context..][..context]);
    }
    // One query head at a time, so its accumulator fits in registers; the V rows it re-reads
    // are in cache.
    for g in 0..group {
        let weights = &logits[g * context..][..context];
        let out = &mut out[g * dim..][..dim];
        let inverse = 1.0 / sums[g];
        if D > 0 {
            let mut acc = [0.0f32; D];
            for (first, rows) in blocks(inputs.value_cache, g == 0) {
                for (value, &weight) in rows.chunks_exact(D).zip(&weights[first..]) {
                    for d in 0..D {
                        acc[d] = fmadd::<ISA>(weight, value[d].to_f32(), acc[d]);
                    }
                }
            }
            for (o, a) in out.iter_mut().zip(acc) {
                *o = T::from_f32(a * inverse);
            }
        } else {
            row.fill(0.0);
            for (first, rows) in blocks(inputs.value_cache, g == 0) {
                for (value, &weight) in rows.chunks_exact(dim).zip(&weights[first..]) {
                    for (o, v) in row.iter_mut().zip(value) {
                        *o = fmadd::<ISA>(weight, v.to_f32(), *o);
                    }
                }
            }
            for (o, &a) in out.iter_mut().zip(row.iter()) {
                *o = T::from_f32(a * inverse);
            }
        }
    }
}

/// The visible context (positions start..context) block by block: (its first position counted
/// from start, the block's rows of one kv head), so the loops need no division per position.
/// With `prefetch`, yielding a block asks the CPU to fetch the next one: blocks lie anywhere in
/// the pool, where its own prefetcher cannot guess.
#[inline(always)]
fn block_rows<'a, T, Q>(
    cache: &'a [T],
    inputs: &HeadInputs<'a, Q, T>,
    prefetch: bool,
) -> impl Iterator<Item = (usize, &'a [T])> + 'a {
    let (shape, table, start, context) = (inputs.shape, inputs.table, inputs.start, inputs.context);
    let (dim, block_size) = (shape.head_dim, shape.block_size);
    let head_rows = inputs.kv_head * block_size * dim;
    let (first_block, end_block) = (start / block_size, context.div_ceil(block_size));
    let rows_of = move |i: usize| {
        let (low, high) = (start.max(i * block_size), context.min((i + 1) * block_size));
        let block = &cache[table[i] as usize * shape.block_stride + head_rows..];
        &block[(low - i * block_size) * dim..(high - i * block_size) * dim]
    };
    if prefetch {
        (first_block..end_block.min(first_block + PREFETCH_BLOCKS)).for_each(|i| prefetch_lines(rows_of(i)));
    }
    (first_block..end_block).map(move |i| {
        if prefetch && i + PREFETCH_BLOCKS < end_block {
            prefetch_lines(rows_of(i + PREFETCH_BLOCKS));
        }
        (start.max(i * block_size) - start, rows_of(i))
    })
}

const PREFETCH_BLOCKS: usize = 4;

/// A hint to bring `data` into the cache; no effect on the result.
#[inline(always)]
fn prefetch_lines<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    for offset in (0..std::mem::size_of_val(data)).step_by(64) {
        // SAFETY: SSE is part of x86-64; a prefetch never faults, and the address is in `data`.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>((data.as_ptr() as *const i8).add(offset));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// tanh(x) as (1 - e) / (1 + e) with e = exp(-2|x|), through the same exp as the softmax: it
/// vectorizes, where libm's tanh is a call per logit (soft-capped decode ran 13-29% slower);
/// within ~1e-7 of it in absolute terms.
#[inline(always)]
fn tanh(x: f32) -> f32 {
    let e = exp_nonpositive(-2.0 * x.abs());
    ((1.0 - e) / (1.0 + e)).copysign(x)
}

/// Replaces logits by exp(logit - max) and returns their sum (a softmax before the division);
/// `sink` (an attention sink's logit, or -inf for none) counts in the max and the sum.
#[inline(always)]
fn exp_normalize(logits: &mut [f32], sink: f32) -> f32 {
    let mut lanes = [sink; 8];
    let mut chunks = logits.chunks_exact(8);
    for chunk in &mut chunks {
        for lane in 0..8 {
            lanes[lane] = if chunk[lane] > lanes[lane] { chunk[lane] } else { lanes[lane] };
        }
    }
    let max = chunks.remainder().iter().chain(&lanes).copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sums = [0.0f32; 8];
    let mut chunks = logits.chunks_exact_mut(8);
    for chunk in &mut chunks {
        for lane in 0..8 {
            chunk[lane] = exp_nonpositive(chunk[lane] - max);
            sums[lane] += chunk[lane];
        }
    }
    let mut sum: f32 =
        sums.iter().sum::<f32>() + if sink > f32::NEG_INFINITY { exp_nonpositive(sink - max) } else { 0.0 };
    for logit in chunks.into_remainder() {
        *logit = exp_nonpositive(*logit - max);
        sum += *logit;
    }
    sum
}

/// a * b + c, fused where the caller enabled FMA (elsewhere `mul_add` is a slow libm call).
#[inline(always)]
fn fmadd<const ISA: u8>(a: f32, b: f32, c: f32) -> f32 {
    if ISA != PORTABLE {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// a . b, with SIMD intrinsics where the caller enabled them (the compiler's own vectorization
/// of this reduction falls back to scalar code once the head dim is a constant).
#[inline(always)]
fn dot<T: Element, const ISA: u8>(a: &[f32], b: &[T]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: ISA names features the caller's #[target_feature] enabled, and the slices
        // have equal lengths (asserted above), which bounds every load.
        if ISA == AVX512 && a.len().is_multiple_of(16) {
            return unsafe { x86::dot16(a, b) };
        }
        if ISA == AVX2 && a.len().is_multiple_of(8) {
            return unsafe { x86::dot8(a, b) };
        }
    }
    dot_portable(a, b)
}

/// Dot product in 8 independent lanes, so the compiler can vectorize it.
#[inline(always)]
fn dot_portable<T: Element>(a: &[f32], b: &[T]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (a_chunks, b_chunks) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a_chunks.remainder().iter().zip(b_chunks.remainder()).map(|(x, y)| x * y.to_f32()).sum();
    for (x, y) in a_chunks.zip(b_chunks) {
        for lane in 0..8 {
            lanes[lane] += x[lane] * y[lane].to_f32();
        }
    }
    lanes.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cpu_kernels::fp8::{Fp8E4m3, Fp8E5m2};
    use crate::cpu_kernels::simd::Bf16;

    /// Straightforward reference: gather the context, softmax in f64.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        query: &[f32],
        cache_k: &[f32],
        cache_v: &[f32],
        tables: &[i32],
        contexts: &[i32],
        shape: &DecodeShape,
        scale: f32,
        sinks: Option<&[f32]>,
    ) -> Vec<f32> {
        let (dim, group) = (shape.head_dim, shape.num_heads / shape.num_kv_heads);
        let mut out = vec![0.0f32; shape.batch * shape.num_heads * dim];
        for b in 0..shape.batch {
            for head in 0..shape.num_heads {
                let kv_head = head / group;
                let q = &query[(b * shape.num_heads + head) * dim..][..dim];
                let context = contexts[b] as usize;
                let offset = |pos: usize| {
                    tables[b * shape.table_width + pos / shape.block_size] as usize * shape.block_stride
                        + (kv_head * shape.block_size + pos % shape.block_size) * dim
                };
                let visible = shape.first_visible(context - 1)..context;
                let logits: Vec<f64> = visible
                    .clone()
                    .map(|pos| {
                        let logit =
                            (0..dim).map(|d| q[d] as f64 * cache_k[offset(pos) + d] as f64).sum::<f64>() * scale as f64;
                        soft_cap_f64(logit, shape.logit_softcap)
                    })
                    .collect();
                let sink = sinks.map_or(f64::NEG_INFINITY, |sinks| sinks[head] as f64);
                let max = logits.iter().cloned().fold(sink, f64::max);
                let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
                let total: f64 = weights.iter().sum::<f64>() + (sink - max).exp();
                for d in 0..dim {
                    let value: f64 = visible
                        .clone()
                        .zip(&weights)
                        .map(|(pos, weight)| weight * cache_v[offset(pos) + d] as f64)
                        .sum();
                    out[(b * shape.num_heads + head) * dim + d] = (value / total) as f32;
                }
            }
        }
        out
    }

    /// `cap * tanh(logit / cap)`, or the logit for cap 0 (the kernels' tests share it).
    pub(crate) fn soft_cap_f64(logit: f64, cap: f32) -> f64 {
        if cap > 0.0 {
            cap as f64 * (logit / cap as f64).tanh()
        } else {
            logit
        }
    }

    /// Deterministic values in [-1, 1) (the kernels' tests share them).
    pub(crate) fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn matches_the_reference_with_gqa_strided_blocks_and_odd_contexts() {
        let isas = [Isa::Portable, Isa::Avx2Fma, Isa::Avx512].into_iter().filter(|isa| isa.is_supported());
        for isa in isas {
            for (num_heads, num_kv_heads, head_dim, threads, sliding_window, logit_softcap, with_sinks) in [
                (9, 3, 64, 2, 0, 0.0, false),
                (4, 4, 24, 1, 0, 0.0, false),
                (8, 2, 128, 3, 0, 0.0, false),
                (2, 1, 80, 2, 0, 0.0, false),
                (4, 1, 256, 2, 0, 0.0, false),
                (4, 1, 256, 2, 20, 0.0, false),
                (9, 3, 64, 2, 1, 0.0, false),
                (9, 3, 64, 2, 23, 0.0, false),
                (8, 2, 128, 3, 32, 0.0, false),
                (4, 4, 24, 1, 50, 0.0, false),
                (9, 3, 64, 2, 0, 0.25, false),
                (8, 2, 128, 3, 32, 0.5, false),
                (4, 1, 256, 2, 0, 0.25, false),
                (9, 3, 64, 2, 0, 0.0, true),
                (8, 2, 128, 3, 32, 0.0, true),
                (4, 4, 24, 1, 0, 0.0, true),
            ] {
                // sinks of up to +-2: as large as the logits, so they take a real share
                let sink_values: Vec<f32> = pseudo_random(num_heads, 9).iter().map(|x| 2.0 * x).collect();
                let sinks = with_sinks.then_some(&sink_values[..]);
                let shape = DecodeShape {
                    batch: 4,
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    block_size: 16,
                    num_blocks: 20,
                    block_stride: 3 * num_kv_heads * 16 * head_dim,
                    table_width: 6,
                    sliding_window,
                    logit_softcap,
                };
                let cache = pseudo_random(shape.num_blocks * shape.block_stride, 1);
                let value_offset = num_kv_heads * 16 * head_dim; // V follows K inside each block, as in the engine
                let (keys, values) = (&cache[..], &cache[value_offset..]);
                let query = pseudo_random(shape.batch * num_heads * head_dim, 2);
                let tables: Vec<i32> =
                    vec![3, 17, 0, 9, 12, 5, 1, 2, 4, 6, 7, 8, 19, 18, 16, 15, 14, 13, 10, 11, 0, 0, 0, 0];
                let contexts = [1, 17, 96, 40];
                let mut out = vec![f32::NAN; shape.batch * num_heads * head_dim];
                paged_decode_attention_with(
                    isa, &mut out, &query, keys, values, &tables, &contexts, &shape, 0.125, sinks, threads,
                )
                .unwrap();
                let expected = reference(&query, keys, values, &tables, &contexts, &shape, 0.125, sinks);
                for (got, want) in out.iter().zip(&expected) {
                    assert!(
                        (got - want).abs() < 1e-4,
                        "{isa:?} head dim {head_dim} window {sliding_window} cap {logit_softcap} sinks {with_sinks}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn bfloat16_caches_match_the_reference_on_their_widened_values() {
        let shape = DecodeShape {
            batch: 3,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            block_size: 16,
            num_blocks: 12,
            block_stride: 2 * 3 * 16 * 64,
            table_width: 4,
            sliding_window: 0,
            logit_softcap: 0.0,
        };
        let cache: Vec<Bf16> =
            pseudo_random(shape.num_blocks * shape.block_stride, 3).into_iter().map(Bf16::from_f32).collect();
        let widened: Vec<f32> = cache.iter().map(|x| x.to_f32()).collect();
        let value_offset = 3 * 16 * 64;
        let query: Vec<Bf16> = pseudo_random(shape.batch * 9 * 64, 4).into_iter().map(Bf16::from_f32).collect();
        let widened_query: Vec<f32> = query.iter().map(|x| x.to_f32()).collect();
        let tables = [7, 2, 11, 0, 5, 4, 0, 0, 1, 3, 6, 8];
        let contexts = [50, 17, 64];
        let mut out = vec![Bf16::from_f32(f32::NAN); query.len()];
        paged_decode_attention(
            &mut out,
            &query,
            &cache[..],
            &cache[value_offset..],
            &tables,
            &contexts,
            &shape,
            0.125,
            None,
            2,
        )
        .unwrap();
        let expected =
            reference(&widened_query, &widened, &widened[value_offset..], &tables, &contexts, &shape, 0.125, None);
        for (got, want) in out.iter().zip(&expected) {
            // The output is rounded to bfloat16 once: within half a bfloat16 step of the exact value.
            assert!((got.to_f32() - want).abs() <= want.abs() / 256.0 + 1e-6, "{got:?} vs {want}");
        }
    }

    /// Float8 caches with float32 queries on every instruction set, against the reference on the
    /// caches' widened values; the codes cover every value, NaN and infinity excepted.
    fn check_float8_caches<C: Element + std::fmt::Debug>(codes: impl Fn(u8) -> Option<C>) {
        // 64 and 128 have their own unrolled copies; 40 reads the dim at run time.
        for head_dim in [64, 128, 40] {
            check_float8_caches_with_dim(head_dim, &codes);
        }
    }

    fn check_float8_caches_with_dim<C: Element + std::fmt::Debug>(dim: usize, codes: impl Fn(u8) -> Option<C>) {
        let shape = DecodeShape {
            batch: 3,
            num_heads: 8,
            num_kv_heads: 2,
            head_dim: dim,
            block_size: 16,
            num_blocks: 10,
            block_stride: 2 * 2 * 16 * dim,
            table_width: 4,
            sliding_window: 0,
            logit_softcap: 0.0,
        };
        let finite: Vec<C> = (0..=255u8).filter_map(codes).collect();
        let cache: Vec<C> =
            (0..shape.num_blocks * shape.block_stride).map(|i| finite[(i * 37) % finite.len()]).collect();
        let widened: Vec<f32> = cache.iter().map(|x| x.to_f32()).collect();
        let value_offset = 2 * 16 * dim;
        let query = pseudo_random(shape.batch * 8 * dim, 5);
        let tables = [9, 2, 4, 0, 5, 1, 0, 0, 3, 6, 7, 8];
        let contexts = [49, 1, 64];
        // Scaled so that the large codes (up to 57344) do not leave one key with all the weight.
        let scale = 1e-4;
        // Soft-capped too (the widened kernels cap their logits on their own path)
        for shape in [shape, DecodeShape { logit_softcap: 0.5, ..shape }] {
            let expected =
                reference(&query, &widened, &widened[value_offset..], &tables, &contexts, &shape, scale, None);
            for isa in [Isa::Portable, Isa::Avx2Fma, Isa::Avx512].into_iter().filter(|isa| isa.is_supported()) {
                let mut out = vec![f32::NAN; query.len()];
                let (keys, values) = (&cache[..], &cache[value_offset..]);
                paged_decode_attention_with(
                    isa, &mut out, &query, keys, values, &tables, &contexts, &shape, scale, None, 2,
                )
                .unwrap();
                // Outputs average values up to the largest code: f32 rounding is relative to those.
                let largest = widened.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                for (got, want) in out.iter().zip(&expected) {
                    let cap = shape.logit_softcap;
                    assert!((got - want).abs() <= 1e-6 * largest, "{isa:?} dim {dim} cap {cap}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn simd_float8_loads_widen_every_code_exactly() {
        fn check<C: Element>(isa: Isa, make: fn(u8) -> C) {
            let codes: Vec<C> = (0..=255u8).map(make).collect();
            let widened = match isa {
                // SAFETY: the CPU runs `isa` (checked by the caller); 256 codes cover every load.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { x86::widen_all_avx512(&codes) },
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2Fma => unsafe { x86::widen_all_avx2(&codes) },
                _ => return,
            };
            for (code, (got, want)) in widened.iter().zip(codes.iter().map(|c| c.to_f32())).enumerate() {
                assert!(
                    got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan(),
                    "{isa:?} code {code:#x}: {got} vs {want}"
                );
            }
        }
        for isa in [Isa::Avx2Fma, Isa::Avx512].into_iter().filter(|isa| isa.is_supported()) {
            check(isa, Fp8E4m3);
            check(isa, Fp8E5m2);
        }
    }

    #[test]
    fn float8_caches_match_the_reference_on_their_widened_values() {
        check_float8_caches(|code| (code & 0x7f != 0x7f).then_some(Fp8E4m3(code)));
        check_float8_caches(|code| (code & 0x7f < 0x7c).then_some(Fp8E5m2(code)));
    }

    #[test]
    fn bad_inputs_are_errors_not_panics() {
        let shape = DecodeShape {
            batch: 1,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
            block_size: 4,
            num_blocks: 2,
            block_stride: 32,
            table_width: 2,
            sliding_window: 0,
            logit_softcap: 0.0,
        };
        let cache = vec![0.0; 64];
        let query = vec![0.0; 16];
        let mut out = vec![0.0; 16];
        let run = |tables: &[i32], contexts: &[i32], out: &mut [f32]| {
            paged_decode_attention(out, &query, &cache, &cache, tables, contexts, &shape, 1.0, None, 1)
        };
        assert!(run(&[0, 5], &[8], &mut out).is_err()); // block out of range
        assert!(run(&[0, 1], &[9], &mut out).is_err()); // context longer than the table
        assert!(run(&[0, 1], &[0], &mut out).is_err()); // empty context
        assert!(run(&[0, 1], &[8], &mut out[..8]).is_err()); // wrong output size
        assert!(run(&[0, 1], &[8], &mut out).is_ok());
        let no_heads = DecodeShape { num_heads: 0, ..shape };
        assert!(paged_decode_attention::<f32, f32>(
            &mut [],
            &[],
            &cache,
            &cache,
            &[0, 1],
            &[8],
            &no_heads,
            1.0,
            None,
            1
        )
        .is_err());
        let empty = DecodeShape { batch: 0, ..shape };
        assert!(
            paged_decode_attention::<f32, f32>(&mut [], &[], &cache, &cache, &[], &[], &empty, 1.0, None, 2).is_ok()
        );
    }

    #[test]
    fn vectorizable_tanh_is_within_1e_6_of_libm() {
        for i in -20000..=20000 {
            let x = i as f32 * 1e-3; // -20..20, through 0 and the saturated tails
            assert!((tanh(x) as f64 - (x as f64).tanh()).abs() < 1e-6, "tanh({x}) = {}", tanh(x));
        }
        assert_eq!(tanh(0.0), 0.0);
        assert_eq!(tanh(-100.0), -1.0);
    }

    #[test]
    fn exp_normalize_leaves_softmax_numerators() {
        let mut logits = [3.0f32, -1.0, 0.5, 2.0, -30.0, 1.0, 0.0, -2.5, 4.0, 1.5];
        let expected: Vec<f64> = logits.iter().map(|&l| ((l - 4.0) as f64).exp()).collect();
        let sum = exp_normalize(&mut logits, f32::NEG_INFINITY);
        assert!((sum as f64 - expected.iter().sum::<f64>()).abs() < 1e-6);
        for (got, want) in logits.iter().zip(&expected) {
            assert!((*got as f64 - want).abs() < 1e-7);
        }
    }
}

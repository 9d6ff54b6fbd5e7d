//! Random sampling of one token per logits row on the CPU: temperature, top-k, min-p, top-p
//! and an inverse-CDF draw, a row at a time while it is in cache, rows spread over torch's
//! threads. torch's ops make ~8 passes over the whole [rows, vocabulary] batch (two top-k
//! selections, softmax, masks, cumulative sums): 70 ms a step at 256 rows of a 49k vocabulary on
//! 2 cores. A row with a small top-k (the common top_k = 20..256) is one pass finding its k best
//! tokens and everything else over those alone (`sample_top_k_row`): ~3x less again.

use crate::cpu_kernels::layer_ops::{check_rows, chunk_len, for_row_chunks, invalid};
use crate::cpu_kernels::simd::{exp_nonpositive, with_isa, Element, Isa};
use crate::errors::Result;

/// One row's sampling settings, as SamplingParams has them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    /// > 0 (greedy rows are an argmax, not sampled here).
    pub temperature: f32,
    /// Keep the k most likely tokens (and ties with the k-th); 0 or >= the vocabulary: all.
    pub top_k: usize,
    /// Keep the fewest most likely tokens whose probability reaches top_p (and ties); 1: all.
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely one; 0: none.
    pub min_p: f32,
    /// The row's uniform number in [0, 1): the draw.
    pub uniform: f32,
}

/// Top-p looks among this many best tokens at most; a row whose top-p set is larger bisects.
const TOP_P_CANDIDATES: usize = 256;

/// `out[r]` = the token drawn for logits row r (`width` long) under `settings[r]`: logits / T,
/// then only the top-k, then softmax, then min-p, then top-p (by the remaining probabilities, not
/// renormalized), then the first token whose cumulative kept probability, in vocabulary order,
/// reaches (1 - uniform) of the kept total (as the torch sampler's `searchsorted`). Tokens whose
/// logit is -inf (masked) are never drawn.
pub fn sample_rows<E: Element>(
    logits: &[E],
    width: usize,
    settings: &[RowSampling],
    out: &mut [i64],
    num_threads: usize,
) -> Result<()> {
    check_rows("logits", logits.len(), width)?;
    let rows = logits.len() / width;
    if settings.len() != rows || out.len() != rows {
        return invalid(format!("settings and out have {} and {} entries for {rows} rows", settings.len(), out.len()));
    }
    if let Some(bad) =
        settings.iter().find(|s| s.temperature.is_nan() || s.temperature <= 0.0 || !(0.0..1.0).contains(&s.uniform))
    {
        return invalid(format!("want temperature > 0 and uniform in [0, 1), got {bad:?}"));
    }
    let isa = Isa::best();
    // A few chunks per thread (not one row each): each sets up its buffers (a row of weights) once.
    let rows_per_chunk = (chunk_len(width) / width).max(rows.div_ceil(4 * num_threads.max(1)));
    let chunks =
        logits.chunks(rows_per_chunk * width).zip(settings.chunks(rows_per_chunk).zip(out.chunks_mut(rows_per_chunk)));
    for_row_chunks(chunks.collect(), num_threads, |(rows, (settings, out)): (&[E], (&[RowSampling], &mut [i64]))| {
        let mut weights = Vec::new(); // (the dense path's, made at its first row)
        let mut scratch: Vec<f32> = Vec::new();
        let (mut maxima, mut kept) = (BlockMaxima::default(), Vec::new());
        for ((row, setting), slot) in rows.chunks_exact(width).zip(settings).zip(out.iter_mut()) {
            *slot = with_isa(
                isa,
                #[inline(always)]
                || {
                    // (no closures in here: they would be compiled without the ISA's features)
                    let small_top_k = setting.top_k > 0 && setting.top_k <= TOP_P_CANDIDATES && setting.top_k < width;
                    match if small_top_k {
                        maxima.of(row); // (in here: the one pass over the row, at the ISA's width)
                        sample_top_k_row(row, setting, &mut scratch, &maxima, &mut kept)
                    } else {
                        None
                    } {
                        Some(token) => token,
                        None => {
                            weights.resize(width, 0.0);
                            sample_row(row, setting, &mut weights, &mut scratch)
                        }
                    }
                },
            ) as i64;
        }
    });
    Ok(())
}

const LANES: usize = 16;

#[inline(always)]
fn sample_row<E: Element>(row: &[E], setting: &RowSampling, weights: &mut [f32], scratch: &mut Vec<f32>) -> usize {
    let vocab = row.len();
    let temperature = setting.temperature;
    for (w, &x) in weights.iter_mut().zip(row) {
        *w = x.to_f32() / temperature;
    }
    // The k-th largest scaled logit: tokens below it are dropped.
    let mut floor = f32::NEG_INFINITY;
    if setting.top_k > 0 && setting.top_k < vocab {
        floor = kth_largest(weights, setting.top_k, scratch);
    }
    let maximum = lane_max(weights);
    if maximum == f32::NEG_INFINITY {
        return 0; // (every token masked, or NaN logits: nothing to draw from)
    }
    // Unnormalized probabilities: exp(x - max), the largest weighing 1 (softmax's numerators).
    for w in weights.iter_mut() {
        let scaled = *w;
        let e = exp_nonpositive(scaled - maximum);
        *w = if scaled >= floor && scaled != f32::NEG_INFINITY { e } else { 0.0 };
    }
    let total = lane_sum(weights, 0.0); // (of the top-k: what top-p measures against, as softmax normalizes it)
    if setting.min_p > 0.0 {
        for w in weights.iter_mut() {
            *w = if *w < setting.min_p { 0.0 } else { *w }; // (min_p x the largest weight, 1)
        }
    }
    if setting.top_p < 1.0 {
        let threshold = top_p_threshold(weights, setting.top_p * total, scratch);
        for w in weights.iter_mut() {
            *w = if *w < threshold { 0.0 } else { *w };
        }
    }
    // The draw: blocks of LANES first, then the token within the block that reaches the target.
    let target = (1.0 - setting.uniform) * lane_sum(weights, 0.0);
    let mut cumulative = 0.0f32;
    let mut last_kept = 0;
    for (block_index, block) in weights.chunks(LANES).enumerate() {
        let block_sum: f32 = block.iter().sum();
        if block_sum == 0.0 {
            continue;
        }
        if cumulative + block_sum < target {
            cumulative += block_sum;
            last_kept = block_index * LANES + block.iter().rposition(|&w| w > 0.0).unwrap_or(0);
            continue;
        }
        for (offset, &w) in block.iter().enumerate() {
            if w > 0.0 {
                cumulative += w;
                last_kept = block_index * LANES + offset;
                if cumulative >= target {
                    return last_kept;
                }
            }
        }
    }
    last_kept // (rounding left the target just above the sum: the last kept token)
}

/// `sample_row` for a row with a small top-k (at most TOP_P_CANDIDATES), given the row's block
/// maxima (`BlockMaxima::of`, the one pass over the row): they find the k-th largest logit and
/// the tokens at or above it, and everything else (scaling, exp, min-p, top-p, the draw) runs
/// over those few tokens, not the vocabulary. The same weights, filters and draw as
/// `sample_row`, summed in another order. None where the dense path must decide: fewer than k
/// finite logits, scaling that reaches an infinity, or ties with the k-th largest logit that
/// make more tokens than CANDIDATE_LIMIT (bfloat16 logits tie often).
fn sample_top_k_row<E: Element>(
    row: &[E],
    setting: &RowSampling,
    scratch: &mut Vec<f32>,
    maxima: &BlockMaxima,
    kept: &mut Vec<(usize, f32)>,
) -> Option<usize> {
    let (k, temperature) = (setting.top_k, setting.temperature);
    let (kth, largest, collected_down_to) = kth_and_largest(row, maxima, k, scratch, kept)?;
    // Division by temperature > 0 keeps the order, so these are the scaled row's largest and k-th
    // largest values, as sample_row's weights have them.
    let (maximum, floor) = (largest / temperature, kth / temperature);
    if !maximum.is_finite() || !floor.is_finite() {
        return None;
    }
    // The least logit whose scaled value reaches the floor: the k-th largest logit, or a float or
    // two below it where the division rounds neighbours to the same value.
    let mut lower = kth;
    let mut settled = false;
    for _ in 0..8 {
        let below = lower.next_down();
        if below / temperature < floor {
            settled = true;
            break;
        }
        lower = below;
    }
    if !settled {
        return None;
    }
    if lower >= collected_down_to {
        kept.retain(|&(_, x)| x >= lower);
    } else {
        collect_at_least(row, maxima, lower, kept, usize::MAX);
    }
    if kept.len() > CANDIDATE_LIMIT {
        return None;
    }
    let mut total = 0.0f32;
    for (_, w) in kept.iter_mut() {
        *w = exp_nonpositive(*w / temperature - maximum);
        total += *w;
    }
    if setting.min_p > 0.0 {
        for (_, w) in kept.iter_mut() {
            *w = if *w < setting.min_p { 0.0 } else { *w };
        }
    }
    if setting.top_p < 1.0 {
        // (top_p_threshold's rule over the kept weights, largest first)
        scratch.clear();
        scratch.extend(kept.iter().map(|&(_, w)| w).filter(|&w| w > 0.0));
        scratch.sort_unstable_by(|a, b| b.total_cmp(a));
        let threshold = first_reaching(scratch, setting.top_p * total).or(scratch.last().copied()).unwrap_or(0.0);
        for (_, w) in kept.iter_mut() {
            *w = if *w < threshold { 0.0 } else { *w };
        }
    }
    let target = (1.0 - setting.uniform) * kept.iter().map(|&(_, w)| w).sum::<f32>();
    let mut cumulative = 0.0f32;
    let mut last_kept = 0;
    for &(token, w) in kept.iter().filter(|&&(_, w)| w > 0.0) {
        cumulative += w;
        last_kept = token;
        if cumulative >= target {
            return Some(token);
        }
    }
    Some(last_kept) // (rounding left the target just above the sum: the last kept token)
}

/// (the k-th largest value, the largest value, c) of a row with at least k finite values (else
/// None), where `kept` holds every (index, value) of the row at least c, in index order. Usually
/// c is the k-th largest maximum of the row's groups (of its blocks where it has no more than k
/// groups): k groups reach it, so at least k values do,
/// and in most rows about k, found in the blocks that reach it; where more than
/// CANDIDATE_LIMIT do, the k best values are selected block by block (`largest_among`), and
/// `kept` is empty (c is infinite).
fn kth_and_largest<E: Element>(
    row: &[E],
    maxima: &BlockMaxima,
    k: usize,
    scratch: &mut Vec<f32>,
    kept: &mut Vec<(usize, f32)>,
) -> Option<(f32, f32, f32)> {
    let descending = |a: &f32, b: &f32| b.total_cmp(a);
    // (rows of fewer than k groups, a small vocabulary or a large k: the blocks' maxima, by the same argument)
    let level = if maxima.groups.len() > k { &maxima.groups } else { &maxima.blocks };
    if level.len() > k {
        scratch.clear();
        scratch.extend_from_slice(level);
        let reach = *scratch.select_nth_unstable_by(k - 1, descending).1;
        if reach > f32::NEG_INFINITY && collect_at_least(row, maxima, reach, kept, CANDIDATE_LIMIT) && kept.len() >= k {
            scratch.clear();
            scratch.extend(kept.iter().map(|&(_, x)| x));
            let (better, &mut kth, _) = scratch.select_nth_unstable_by(k - 1, descending);
            let largest = better.iter().fold(kth, |m, &x| if x > m { x } else { m });
            return Some((kth, largest, reach));
        }
    }
    largest_among(row, maxima, k, f32::NEG_INFINITY, scratch);
    if scratch.len() < k {
        return None;
    }
    kept.clear();
    Some((scratch[k - 1], scratch[0], f32::INFINITY))
}

/// A top-k row's candidates are collected from its groups' maxima while at most this many.
const CANDIDATE_LIMIT: usize = 4 * TOP_P_CANDIDATES;

/// `out` = (index, value) of every value at least `lower`, in index order, looking only into the
/// blocks whose maximum reaches it (a group's such blocks read a row of LANES at a time, so the
/// indices come in order); false (`out` then partial) if there are more than `limit`.
fn collect_at_least<E: Element>(
    values: &[E],
    maxima: &BlockMaxima,
    lower: f32,
    out: &mut Vec<(usize, f32)>,
    limit: usize,
) -> bool {
    out.clear();
    let whole_groups = values.len() / GROUP;
    // (groups and blocks that reach `lower` as bits, compared without branches: which of the
    // row's ~200 groups pass is a coin toss the branch predictor loses)
    for (word_index, chunk) in maxima.groups.chunks(64).enumerate() {
        let mut reaching_groups = 0u64;
        for (bit, &group_maximum) in chunk.iter().enumerate() {
            reaching_groups |= ((group_maximum >= lower) as u64) << bit;
        }
        while reaching_groups != 0 {
            let group = word_index * 64 + reaching_groups.trailing_zeros() as usize;
            reaching_groups &= reaching_groups - 1;
            let start = group * GROUP;
            if group == whole_groups {
                // (the tail: one block of consecutive values)
                for (index, x) in values[start..].iter().enumerate() {
                    let x = x.to_f32();
                    if x >= lower {
                        out.push((start + index, x));
                    }
                }
            } else {
                let mut reaching_lanes = 0u32;
                for (lane, &block_maximum) in maxima.blocks[group * LANES..(group + 1) * LANES].iter().enumerate() {
                    reaching_lanes |= ((block_maximum >= lower) as u32) << lane;
                }
                for vector_start in (start..start + GROUP).step_by(LANES) {
                    let mut lanes = reaching_lanes;
                    while lanes != 0 {
                        let index = vector_start + lanes.trailing_zeros() as usize;
                        lanes &= lanes - 1;
                        let x = values[index].to_f32();
                        if x >= lower {
                            out.push((index, x));
                        }
                    }
                }
            }
            if out.len() > limit {
                return false;
            }
        }
    }
    true
}

/// The largest value, in LANES independent lanes (one running maximum would not vectorize).
#[inline(always)]
fn lane_max(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = values.chunks_exact(LANES);
    for chunk in &mut chunks {
        for lane in 0..LANES {
            lanes[lane] = if chunk[lane] > lanes[lane] { chunk[lane] } else { lanes[lane] };
        }
    }
    chunks.remainder().iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

/// The sum of the values at least `floor`, in LANES independent lanes.
#[inline(always)]
fn lane_sum(values: &[f32], floor: f32) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut chunks = values.chunks_exact(LANES);
    for chunk in &mut chunks {
        for lane in 0..LANES {
            lanes[lane] += if chunk[lane] >= floor { chunk[lane] } else { 0.0 };
        }
    }
    let tail: f32 = chunks.remainder().iter().filter(|&&x| x >= floor).sum();
    lanes.iter().sum::<f32>() + tail
}

/// How many values are at least `floor`, in LANES independent lanes.
#[inline(always)]
fn lane_count(values: &[f32], floor: f32) -> usize {
    let mut lanes = [0u32; LANES];
    let mut chunks = values.chunks_exact(LANES);
    for chunk in &mut chunks {
        for lane in 0..LANES {
            lanes[lane] += (chunk[lane] >= floor) as u32;
        }
    }
    lanes.iter().map(|&n| n as usize).sum::<usize>() + chunks.remainder().iter().filter(|&&x| x >= floor).count()
}

/// The k-th largest value (1 <= k < len): by block maxima for small k, else bisection on the value.
fn kth_largest(values: &[f32], k: usize, scratch: &mut Vec<f32>) -> f32 {
    if k <= TOP_P_CANDIDATES {
        largest(values, k, f32::NEG_INFINITY, scratch);
        return scratch.get(k - 1).copied().unwrap_or(f32::NEG_INFINITY); // (fewer finite values: keep them all)
    }
    // The largest t with at least k values >= t is the k-th largest value.
    largest_satisfying(|t| lane_count(values, t) >= k)
}

/// The smallest weight in the top-p set: the fewest largest weights whose sum reaches `mass`
/// (a token is kept while the weights before it sum to less than `mass`). Equivalently, the
/// largest t whose weights >= t sum to `mass` or more.
fn top_p_threshold(weights: &[f32], mass: f32, scratch: &mut Vec<f32>) -> f32 {
    // (a peaked distribution's set is a few tokens: look among 32 before 256)
    for candidates in [32, TOP_P_CANDIDATES] {
        largest(weights, candidates, 0.0, scratch);
        if let Some(w) = first_reaching(scratch, mass) {
            return w;
        }
        if scratch.len() < candidates {
            return scratch.last().copied().unwrap_or(0.0); // (every kept token, and rounding left the mass short)
        }
    }
    // A top-p set beyond the candidates (a flat distribution): bisection over the whole row.
    if lane_sum(weights, 0.0) < mass {
        return 0.0; // (min-p left less than the mass: keep every token it kept)
    }
    largest_satisfying(|t| lane_sum(weights, t) >= mass)
}

/// The weight, of `descending` weights, at which their running sum reaches `mass` (a token is
/// kept while the weights before it sum to less than `mass`); None if the sum stays short.
fn first_reaching(descending: &[f32], mass: f32) -> Option<f32> {
    let mut before = 0.0f32;
    for &w in descending {
        if before + w >= mass {
            return Some(w);
        }
        before += w;
    }
    None
}

/// The largest float t (not NaN) for which `holds(t)`, given that `holds` is true up to some
/// value and false above it, and true for the lowest float: bisection on the bit patterns
/// ordered as the floats are (at most 32 steps).
fn largest_satisfying(holds: impl Fn(f32) -> bool) -> f32 {
    fn key(x: f32) -> u32 {
        let bits = x.to_bits();
        if bits >> 31 == 1 {
            !bits
        } else {
            bits | (1 << 31)
        }
    }
    fn value(key: u32) -> f32 {
        f32::from_bits(if key >> 31 == 1 { key & !(1 << 31) } else { !key })
    }
    let (mut low, mut high) = (key(f32::NEG_INFINITY), key(f32::INFINITY));
    if holds(value(high)) {
        return f32::INFINITY;
    }
    while high - low > 1 {
        let middle = low + (high - low) / 2;
        if holds(value(middle)) {
            low = middle;
        } else {
            high = middle;
        }
    }
    value(low)
}

/// `out` = the k largest of the `values` above `above` (all of them if fewer), in descending
/// order (`largest_among` with the values' block maxima).
fn largest(values: &[f32], k: usize, above: f32, out: &mut Vec<f32>) {
    let mut maxima = BlockMaxima::default();
    maxima.of(values);
    largest_among(values, &maxima, k, above, out);
}

const GROUP: usize = LANES * LANES;

/// The maximum of each block of a row, and of each group of blocks. A block is a lane of a group
/// of LANES x LANES values (its values LANES apart), so all maxima of a group are one vector max
/// over its LANES vectors; what is left after the last whole group is one block, and one group.
#[derive(Default)]
struct BlockMaxima {
    blocks: Vec<f32>,
    groups: Vec<f32>,
}

impl BlockMaxima {
    /// (Inlined into `with_isa`'s body by its callers, to run at the ISA's width: no closures.)
    #[inline(always)]
    fn of<E: Element>(&mut self, values: &[E]) {
        self.blocks.clear();
        self.groups.clear();
        let groups = values.chunks_exact(GROUP);
        let tail = groups.remainder();
        for group in groups {
            let mut lanes = [f32::NEG_INFINITY; LANES];
            for vector in group.chunks_exact(LANES) {
                for lane in 0..LANES {
                    let x = vector[lane].to_f32();
                    lanes[lane] = if x > lanes[lane] { x } else { lanes[lane] };
                }
            }
            self.blocks.extend_from_slice(&lanes);
            let mut maximum = f32::NEG_INFINITY;
            for x in lanes {
                maximum = if x > maximum { x } else { maximum };
            }
            self.groups.push(maximum);
        }
        let mut tail_maximum = f32::NEG_INFINITY;
        for x in tail {
            let x = x.to_f32();
            tail_maximum = if x > tail_maximum { x } else { tail_maximum };
        }
        self.blocks.push(tail_maximum);
        self.groups.push(tail_maximum);
    }

    /// Calls `visit(block, maximum)` for every block whose maximum passes `keep`, in order of
    /// blocks; `keep` must hold for every value above one it holds for (the groups whose
    /// maximum fails it are passed over whole).
    fn for_blocks_where(&self, keep: impl Fn(f32) -> bool, mut visit: impl FnMut(usize, f32)) {
        for (group, &maximum) in self.groups.iter().enumerate() {
            if keep(maximum) {
                let first = group * LANES;
                let blocks = &self.blocks[first..(first + LANES).min(self.blocks.len())];
                for (lane, &block_maximum) in blocks.iter().enumerate() {
                    if keep(block_maximum) {
                        visit(first + lane, block_maximum);
                    }
                }
            }
        }
    }

    /// Calls `visit(index, value)` for the values of every block whose maximum passes `keep`
    /// (as `for_blocks_where`), block by block.
    fn for_values_where<E: Element>(
        &self,
        values: &[E],
        keep: impl Fn(f32) -> bool,
        mut visit: impl FnMut(usize, f32),
    ) {
        let whole = values.len() / GROUP * GROUP;
        self.for_blocks_where(keep, |block, _| {
            if block * LANES >= whole {
                (whole..values.len()).for_each(|index| visit(index, values[index].to_f32()));
            } else {
                let start = block / LANES * GROUP + block % LANES;
                (start..start + GROUP).step_by(LANES).for_each(|index| visit(index, values[index].to_f32()));
            }
        });
    }
}

/// `out` = the k largest of the `values` above `above` (all of them if fewer), in descending
/// order, given the values' block maxima. The k-th largest of the maxima bounds the k-th largest
/// value from below (k blocks hold a value at least that high), so only the blocks whose maximum
/// reaches it are looked into: about k blocks, not the whole row. That maximum is selected among
/// the blocks reaching the k-th largest maximum of whole groups (by the same argument).
fn largest_among<E: Element>(values: &[E], maxima: &BlockMaxima, k: usize, above: f32, out: &mut Vec<f32>) {
    let descending = |a: &f32, b: &f32| b.total_cmp(a);
    let mut floor = f32::NEG_INFINITY;
    if maxima.blocks.len() > k {
        let mut order = maxima.groups.clone();
        let reach =
            if order.len() > k { *order.select_nth_unstable_by(k - 1, descending).1 } else { f32::NEG_INFINITY };
        order.clear();
        maxima.for_blocks_where(|m| m >= reach, |_, m| order.push(m));
        if order.len() < k {
            order.clone_from(&maxima.blocks); // (NaN maxima: none reaches)
        }
        floor = *order.select_nth_unstable_by(k - 1, descending).1;
    }
    let collect = |floor: f32, out: &mut Vec<f32>| {
        out.clear();
        let keep = |x: f32| x >= floor && x > above;
        maxima.for_values_where(values, keep, |_, x| {
            if keep(x) {
                out.push(x)
            }
        });
    };
    collect(floor, out);
    if out.len() < k && floor > f32::NEG_INFINITY {
        collect(f32::NEG_INFINITY, out); // (some of the k best blocks peak at or below `above`)
    }
    if out.len() > k {
        out.select_nth_unstable_by(k - 1, descending);
        out.truncate(k);
    }
    out.sort_unstable_by(descending);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setting(temperature: f32, top_k: usize, top_p: f32, min_p: f32, uniform: f32) -> RowSampling {
        RowSampling { temperature, top_k, top_p, min_p, uniform }
    }

    fn draw(row: &[f32], s: RowSampling) -> usize {
        let mut out = [0i64];
        sample_rows(row, row.len(), &[s], &mut out, 1).unwrap();
        out[0] as usize
    }

    /// Probabilities of the plain softmax of row / temperature, in float64.
    fn softmax(row: &[f32], temperature: f32) -> Vec<f64> {
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64 / temperature as f64;
        let e: Vec<f64> = row.iter().map(|&x| (x as f64 / temperature as f64 - max).exp()).collect();
        let total: f64 = e.iter().sum();
        e.iter().map(|x| x / total).collect()
    }

    #[test]
    fn draws_follow_the_softmax_over_a_grid_of_uniform_numbers() {
        let row = [0.5f32, 2.0, -1.0, 1.0, f32::NEG_INFINITY, 0.0];
        let probabilities = softmax(&row, 0.7);
        let draws = 20_000;
        let mut counts = [0usize; 6];
        for i in 0..draws {
            counts[draw(&row, setting(0.7, 0, 1.0, 0.0, (i as f32 + 0.5) / draws as f32))] += 1;
        }
        for (count, p) in counts.iter().zip(&probabilities) {
            assert!((*count as f64 / draws as f64 - p).abs() < 1e-3, "{counts:?} vs {probabilities:?}");
        }
        assert_eq!(counts[4], 0); // (masked)
    }

    #[test]
    fn top_k_top_p_and_min_p_keep_only_their_tokens() {
        let row: Vec<f32> = (0..300).map(|i| ((i * 37) % 101) as f32 / 10.0).collect();
        let probabilities = softmax(&row, 1.0);
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        for i in 0..500 {
            let uniform = i as f32 / 500.0;
            let k = draw(&row, setting(1.0, 3, 1.0, 0.0, uniform));
            assert!(row[k] >= row[order[2]], "top-k kept token {k}");
            let p = draw(&row, setting(1.0, 0, 0.5, 0.0, uniform));
            let mass_before: f64 = order.iter().take_while(|&&t| row[t] > row[p]).map(|&t| probabilities[t]).sum();
            assert!(mass_before < 0.5, "top-p kept token {p} with {mass_before} before it");
            let m = draw(&row, setting(1.0, 0, 1.0, 0.5, uniform));
            assert!(probabilities[m] >= 0.5 * probabilities[order[0]] * 0.999, "min-p kept token {m}");
        }
        // The most likely token alone: each filter at its tightest.
        let best = order[0];
        assert_eq!(draw(&row, setting(1.0, 1, 1.0, 0.0, 0.9)), best);
        assert_eq!(draw(&row, setting(1.0, 0, 1e-6, 0.0, 0.9)), best);
        assert_eq!(draw(&row, setting(1.0, 0, 1.0, 1.0, 0.9)), best);
    }

    #[test]
    fn a_top_p_set_beyond_the_candidates_sorts_the_whole_row() {
        let row = vec![0.0f32; 1000]; // uniform: top_p 0.9 keeps ~900 tokens
        let tokens: Vec<usize> = (0..100).map(|i| draw(&row, setting(1.0, 0, 0.9, 0.0, i as f32 / 100.0))).collect();
        assert!(tokens.iter().any(|&t| t > 600), "{tokens:?}");
    }

    #[test]
    fn a_small_top_k_draws_over_its_candidates_what_the_whole_row_draws() {
        let mut state = 11u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let (mut compared, mut differing) = (0usize, 0usize);
        for len in [300usize, 1000, 5000] {
            for spread in [2u64, 40, 4000] {
                let row: Vec<f32> = (0..len)
                    .map(|i| if i % 89 == 5 { f32::NEG_INFINITY } else { (next() % spread) as f32 / 7.0 - 3.0 }) // (ties)
                    .collect();
                for (top_k, top_p, min_p, temperature) in [
                    (1, 1.0, 0.0, 0.7),
                    (5, 1.0, 0.0, 1.0),
                    (50, 0.9, 0.0, 0.3),
                    (50, 0.5, 0.05, 1.3),
                    (256, 0.95, 0.0, 1.7),
                ] {
                    let mut weights = vec![0.0f32; len];
                    let (mut scratch, mut maxima, mut kept) = (Vec::new(), BlockMaxima::default(), Vec::new());
                    for i in 0..200 {
                        let s = setting(temperature, top_k, top_p, min_p, i as f32 / 200.0);
                        let dense = sample_row(&row, &s, &mut weights, &mut scratch);
                        let kept_by_dense = weights[..].to_vec();
                        maxima.of(&row);
                        let Some(sparse) = sample_top_k_row(&row, &s, &mut scratch, &maxima, &mut kept) else {
                            let mut sorted = row.clone();
                            sorted.sort_by(|a, b| b.total_cmp(a));
                            let floor = sorted[top_k - 1] / temperature; // (what the kernel's limit counts: scaled ties)
                            let tied = row.iter().filter(|&&x| x / temperature >= floor).count();
                            assert!(tied > CANDIDATE_LIMIT, "no sparse draw: {s:?}, spread {spread}");
                            continue; // (more tied tokens than CANDIDATE_LIMIT)
                        };
                        assert!(kept_by_dense[sparse] > 0.0, "token {sparse} is not kept: {s:?}");
                        compared += 1;
                        differing += (sparse != dense) as usize;
                    }
                }
            }
        }
        // The same token but where summing in another order moves the target over a boundary.
        assert!(differing * 200 <= compared, "{differing} of {compared} draws differ");
    }

    #[test]
    fn largest_is_the_sorted_top_k() {
        let mut state = 7u64;
        for len in [1usize, 15, 16, 17, 100, 255, 256, 257, 1000, 5000, 49_152] {
            let values: Vec<f32> = (0..len)
                .map(|i| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    if i % 97 == 3 {
                        f32::NEG_INFINITY
                    } else {
                        (state % 300) as f32 / 7.0
                    } // (ties)
                })
                .collect();
            let mut sorted = values.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            for k in [1, 2, 16, 33, 256].into_iter().filter(|&k| k <= len) {
                let mut out = Vec::new();
                largest(&values, k, f32::NEG_INFINITY, &mut out);
                let finite: Vec<f32> = sorted.iter().copied().filter(|&x| x > f32::NEG_INFINITY).take(k).collect();
                assert_eq!(out, finite, "len {len}, k {k}");
                largest(&values, k, 20.0, &mut out);
                let above: Vec<f32> = sorted.iter().copied().filter(|&x| x > 20.0).take(k).collect();
                assert_eq!(out, above, "len {len}, k {k}, above 20");
            }
        }
    }

    #[test]
    fn bfloat16_rows_draw_what_their_float32_widening_draws() {
        use crate::cpu_kernels::simd::Bf16;
        let (rows, width) = (6usize, 3000usize);
        let wide: Vec<f32> =
            (0..rows * width).map(|i| Bf16::from_f32(((i * 7919) % 1013) as f32 / 97.0 - 4.0).to_f32()).collect(); // (bfloat16 values: their widening is exact)
        let narrow: Vec<Bf16> = wide.iter().map(|&x| Bf16::from_f32(x)).collect();
        for i in 0..50 {
            let uniform = i as f32 / 50.0;
            let settings: Vec<RowSampling> = [(0, 1.0, 0.0), (40, 0.9, 0.0), (256, 0.95, 0.05), (0, 0.8, 0.0)]
                .iter()
                .cycle()
                .take(rows)
                .enumerate()
                .map(|(r, &(top_k, top_p, min_p))| setting(0.5 + r as f32 / 4.0, top_k, top_p, min_p, uniform))
                .collect();
            let (mut from_wide, mut from_narrow) = (vec![0i64; rows], vec![0i64; rows]);
            sample_rows(&wide, width, &settings, &mut from_wide, 2).unwrap();
            sample_rows(&narrow, width, &settings, &mut from_narrow, 2).unwrap();
            assert_eq!(from_wide, from_narrow, "uniform {uniform}");
        }
    }

    #[test]
    fn bad_settings_and_shapes_are_errors() {
        let mut out = [0i64; 2];
        let good = setting(1.0, 0, 1.0, 0.0, 0.5);
        assert!(sample_rows(&[0.0; 8], 4, &[good, setting(0.0, 0, 1.0, 0.0, 0.5)], &mut out, 1).is_err());
        assert!(sample_rows(&[0.0; 8], 4, &[good, setting(1.0, 0, 1.0, 0.0, 1.0)], &mut out, 1).is_err());
        assert!(sample_rows(&[0.0; 8], 4, &[good], &mut out, 1).is_err());
        assert!(sample_rows(&[0.0; 8], 4, &[good, good], &mut out, 2).is_ok());
    }
}

//! Greedy sampling's argmax over float32 or bfloat16 logits rows, on torch's thread team: numpy's
//! is one thread and torch's several times slower on rows as wide as a vocabulary (49k floats).
//! bfloat16 rows are a bfloat16 model's LM-head output read as it is: widening a value to float32
//! is exact, so the argmax is the float32 logits' without writing them (50 MB at 256 rows of 49k).

use crate::cpu_kernels::layer_ops::{check_rows, chunk_len, for_row_chunks, invalid};
use crate::cpu_kernels::simd::{with_isa, Element, Isa};
use crate::errors::Result;

/// `out[r]` = the index of row r's largest value, the first of equal ones, as torch's and
/// numpy's argmax: a row holding NaN gives its first NaN. Rows are `width` long.
pub fn argmax_rows<E: Element>(logits: &[E], width: usize, out: &mut [i64], num_threads: usize) -> Result<()> {
    check_rows("logits", logits.len(), width)?;
    if out.len() != logits.len() / width {
        return invalid(format!("out has {} elements for {} rows", out.len(), logits.len() / width));
    }
    let isa = Isa::best();
    let rows_per_chunk = chunk_len(width) / width;
    let chunks = logits.chunks(rows_per_chunk * width).zip(out.chunks_mut(rows_per_chunk)).collect();
    for_row_chunks(chunks, num_threads, |(rows, out): (&[E], &mut [i64])| {
        for (row, slot) in rows.chunks_exact(width).zip(out.iter_mut()) {
            *slot = with_isa(
                isa,
                #[inline(always)]
                || row_argmax(row),
            ) as i64;
        }
    });
    Ok(())
}

/// Two vectorized passes: the row's maximum in 64 lanes (a compare-and-select per value, four
/// vectors wide so no single chain waits on its own latency), with a lane sum that is NaN if the
/// row holds a NaN (or infinities of both signs: then a scalar look settles it); then the first
/// block of 64 holding the maximum, read again from cache, and its first such value.
#[inline(always)]
fn row_argmax<E: Element>(row: &[E]) -> usize {
    const LANES: usize = 64;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut sums = [0.0f32; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for lane in 0..LANES {
            let x = chunk[lane].to_f32();
            lanes[lane] = if x > lanes[lane] { x } else { lanes[lane] };
            sums[lane] += x;
        }
    }
    let mut maximum = lanes.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    let mut has_nan = sums.iter().any(|sum| sum.is_nan());
    for x in chunks.remainder().iter().map(|x| x.to_f32()) {
        maximum = if x > maximum { x } else { maximum };
        has_nan |= x.is_nan();
    }
    if has_nan {
        if let Some(nan) = row.iter().position(|x| x.to_f32().is_nan()) {
            return nan;
        }
    }
    let block = row
        .chunks(LANES)
        .position(|block| block.iter().fold(false, |found, x| found | (x.to_f32() == maximum)))
        .unwrap_or(0);
    block * LANES + row[block * LANES..].iter().position(|x| x.to_f32() == maximum).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(row: &[f32]) -> usize {
        if let Some(nan) = row.iter().position(|x| x.is_nan()) {
            return nan;
        }
        let mut best = 0;
        for (i, &x) in row.iter().enumerate() {
            if x > row[best] {
                best = i;
            }
        }
        best
    }

    #[test]
    fn matches_a_scalar_reference_with_ties_infinities_and_nan() {
        let width = 1000 + 7; // (a remainder after the 16 lanes)
        let mut logits = Vec::new();
        let mut state = 12345u64;
        for _ in 0..9 * width {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            logits.push((state % 1000) as f32 / 10.0 - 50.0); // many equal values: ties
        }
        logits[width + 500] = f32::INFINITY;
        logits[width + 900] = f32::INFINITY; // a tie of infinities: the first wins
        logits[2 * width..3 * width].fill(f32::NEG_INFINITY);
        logits[3 * width + 800] = f32::NAN;
        logits[3 * width + 900] = f32::NAN;
        logits[4 * width + width - 1] = 1e9; // the maximum in the remainder
        logits[5 * width + 3] = f32::NAN; // a NaN before the maximum
        for threads in [1, 3] {
            let mut out = vec![-1i64; 9];
            argmax_rows(&logits, width, &mut out, threads).unwrap();
            let want: Vec<i64> = logits.chunks(width).map(|row| reference(row) as i64).collect();
            assert_eq!(out, want);
        }
        assert_eq!(reference(&logits[width..2 * width]), 500);
        assert_eq!(reference(&logits[3 * width..4 * width]), 800);
    }

    #[test]
    fn bfloat16_rows_give_the_argmax_of_their_float32_values() {
        use crate::cpu_kernels::simd::Bf16;
        let width = 300 + 5;
        let mut state = 99u64;
        let mut logits: Vec<Bf16> = (0..4 * width)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                Bf16::from_f32((state % 512) as f32 / 8.0 - 30.0) // (ties again)
            })
            .collect();
        logits[width + 200] = Bf16::from_f32(f32::INFINITY);
        logits[2 * width + 7] = Bf16::from_f32(f32::NAN);
        logits[3 * width + width - 2] = Bf16::from_f32(1e30); // in the remainder
        let widened: Vec<f32> = logits.iter().map(|x| x.to_f32()).collect();
        for threads in [1, 2] {
            let mut out = vec![-1i64; 4];
            argmax_rows(&logits, width, &mut out, threads).unwrap();
            let want: Vec<i64> = widened.chunks(width).map(|row| reference(row) as i64).collect();
            assert_eq!(out, want);
        }
    }

    #[test]
    fn rejects_rows_that_do_not_fit() {
        let mut out = vec![0i64; 2];
        assert!(argmax_rows(&[0.0f32; 10], 4, &mut out, 1).is_err());
        assert!(argmax_rows(&[0.0f32; 12], 4, &mut out, 1).is_err());
        assert!(argmax_rows(&[0.0f32; 8], 0, &mut out, 1).is_err());
    }
}

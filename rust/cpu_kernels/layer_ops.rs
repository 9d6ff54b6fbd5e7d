//! The CPU forward pass's elementwise layers, fused: residual add + RMSNorm, SiLU-and-mul and
//! rotary embedding each make one pass over their rows, where torch runs 3 to 7 ops with
//! float32 temporaries. Values are rounded to the element type wherever torch's unfused ops
//! round (after each op), so results match the unfused model's up to float32 summation order.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::cpu_kernels::openmp_team::run_on_team;
use crate::cpu_kernels::simd::{exp_nonpositive, with_isa, Element, Isa};
use crate::errors::{Error, Result};

/// hidden[t] = weight * normalize(hidden[t]), where normalize(x) = x / sqrt(mean(x^2) + eps) in
/// float32, rounded to the element type before the weight multiplies it (HF's RMSNorm). With a
/// residual, vLLM's fused_add_rms_norm: residual[t] += hidden[t] first, and the sum is what is
/// normalized; both are updated in place. Rows are `width` long.
pub fn rms_norm<E: Element>(
    hidden: &mut [E],
    residual: Option<&mut [E]>,
    weight: &[E],
    width: usize,
    eps: f32,
    num_threads: usize,
) -> Result<()> {
    check_rows("hidden", hidden.len(), width)?;
    if weight.len() != width {
        return invalid(format!("weight has {} elements for rows of {width}", weight.len()));
    }
    let isa = Isa::best();
    match residual {
        None => for_row_chunks(hidden.chunks_mut(chunk_len(width)).collect(), num_threads, |rows: &mut [E]| {
            rows.chunks_exact_mut(width).for_each(|row| {
                with_isa(
                    isa,
                    #[inline(always)]
                    || norm_row(row, weight, eps),
                )
            });
        }),
        Some(residual) => {
            if residual.len() != hidden.len() {
                return invalid(format!("residual has {} elements, hidden {}", residual.len(), hidden.len()));
            }
            let chunks = hidden.chunks_mut(chunk_len(width)).zip(residual.chunks_mut(chunk_len(width))).collect();
            for_row_chunks(chunks, num_threads, |(rows, residual_rows): (&mut [E], &mut [E])| {
                for (row, residual_row) in rows.chunks_exact_mut(width).zip(residual_rows.chunks_exact_mut(width)) {
                    with_isa(
                        isa,
                        #[inline(always)]
                        || {
                            for (x, r) in row.iter_mut().zip(residual_row.iter_mut()) {
                                *r = E::from_f32(x.to_f32() + r.to_f32());
                                *x = *r;
                            }
                            norm_row(row, weight, eps)
                        },
                    );
                }
            })
        }
    }
    Ok(())
}

#[inline(always)]
fn norm_row<E: Element>(row: &mut [E], weight: &[E], eps: f32) {
    let mut lanes = [0.0f32; 16];
    let mut chunks = row.chunks_exact(16);
    for chunk in &mut chunks {
        for lane in 0..16 {
            let x = chunk[lane].to_f32();
            lanes[lane] += x * x;
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|x| x.to_f32() * x.to_f32()).sum();
    let inverse = 1.0 / ((lanes.iter().sum::<f32>() + tail) / row.len() as f32 + eps).sqrt();
    for (x, w) in row.iter_mut().zip(weight) {
        *x = E::from_f32(w.to_f32() * round::<E>(x.to_f32() * inverse));
    }
}

/// out[t] = silu(gate) * up for input rows [gate | up] of 2 * width (Llama's MLP activation);
/// silu(x) = x * sigmoid(x) is rounded to the element type before the product, as torch's
/// `F.silu(gate) * up`.
pub fn silu_and_mul<E: Element>(out: &mut [E], input: &[E], width: usize, num_threads: usize) -> Result<()> {
    check_rows("out", out.len(), width)?;
    if input.len() != 2 * out.len() {
        return invalid(format!("input has {} elements, want 2 x out's {}", input.len(), out.len()));
    }
    let isa = Isa::best();
    let chunks = out.chunks_mut(chunk_len(width)).zip(input.chunks(2 * chunk_len(width))).collect();
    for_row_chunks(chunks, num_threads, |(rows, inputs): (&mut [E], &[E])| {
        for (row, input) in rows.chunks_exact_mut(width).zip(inputs.chunks_exact(2 * width)) {
            let (gate, up) = input.split_at(width);
            with_isa(
                isa,
                #[inline(always)]
                || {
                    for ((o, g), u) in row.iter_mut().zip(gate).zip(up) {
                        *o = E::from_f32(round::<E>(silu(g.to_f32())) * u.to_f32());
                    }
                },
            );
        }
    });
    Ok(())
}

/// x * sigmoid(x), with the exponential of a non-positive number only (no overflow, vectorizes).
#[inline(always)]
fn silu(x: f32) -> f32 {
    let e = exp_nonpositive(-x.abs());
    let numerator = if x >= 0.0 { 1.0 } else { e };
    x * numerator / (1.0 + e)
}

/// Shapes of a rotary call: `qkv` rows of `row_width` per token whose first `num_heads` heads of
/// `head_dim` (the query heads, then the key heads) are rotated; the values after them are not.
#[derive(Debug, Clone, Copy)]
pub struct RotaryShape {
    pub num_tokens: usize,
    pub row_width: usize,
    pub num_heads: usize,
    pub head_dim: usize,
}

/// Rotates the heads of each token in place by its position's (cos, sin) rows of `head_dim`
/// (HF's layout: the two halves repeat): x * cos + rotate_half(x) * sin, each product and the
/// sum rounded as torch rounds them.
pub fn rotary_in_place<E: Element>(
    qkv: &mut [E],
    cos: &[E],
    sin: &[E],
    shape: RotaryShape,
    num_threads: usize,
) -> Result<()> {
    let RotaryShape { num_tokens, row_width, num_heads, head_dim } = shape;
    if head_dim == 0 || !head_dim.is_multiple_of(2) || num_heads * head_dim > row_width {
        return invalid(format!("{num_heads} heads of {head_dim} (even, > 0) must fit rows of {row_width}"));
    }
    if qkv.len() != num_tokens * row_width || cos.len() != num_tokens * head_dim || sin.len() != cos.len() {
        return invalid(format!(
            "want qkv [{num_tokens}, {row_width}] and cos/sin [{num_tokens}, {head_dim}], got {}, {} and {} elements",
            qkv.len(),
            cos.len(),
            sin.len()
        ));
    }
    if num_tokens == 0 {
        return Ok(());
    }
    let isa = Isa::best();
    let tokens_per_chunk = chunk_len(row_width) / row_width;
    let chunks = qkv
        .chunks_mut(tokens_per_chunk * row_width)
        .zip(cos.chunks(tokens_per_chunk * head_dim).zip(sin.chunks(tokens_per_chunk * head_dim)))
        .collect();
    for_row_chunks(chunks, num_threads, |(rows, (cos, sin)): (&mut [E], (&[E], &[E]))| {
        let per_token =
            rows.chunks_exact_mut(row_width).zip(cos.chunks_exact(head_dim).zip(sin.chunks_exact(head_dim)));
        for (row, (cos, sin)) in per_token {
            with_isa(
                isa,
                #[inline(always)]
                || {
                    for head in row[..num_heads * head_dim].chunks_exact_mut(head_dim) {
                        rotate_head(head, cos, sin)
                    }
                },
            );
        }
    });
    Ok(())
}

#[inline(always)]
fn rotate_head<E: Element>(head: &mut [E], cos: &[E], sin: &[E]) {
    let half = head.len() / 2;
    let (low, high) = head.split_at_mut(half);
    let (cos_low, cos_high) = cos[..2 * half].split_at(half);
    let (sin_low, sin_high) = sin[..2 * half].split_at(half);
    let tables = cos_low.iter().zip(cos_high).zip(sin_low.iter().zip(sin_high));
    for ((l, h), ((cos_l, cos_h), (sin_l, sin_h))) in low.iter_mut().zip(high.iter_mut()).zip(tables) {
        let (a, b) = (l.to_f32(), h.to_f32());
        *l = E::from_f32(round::<E>(a * cos_l.to_f32()) + round::<E>(-b * sin_l.to_f32()));
        *h = E::from_f32(round::<E>(b * cos_h.to_f32()) + round::<E>(a * sin_h.to_f32()));
    }
}

/// What storing `x` as an `E` and reading it back gives (torch rounds each op's output).
#[inline(always)]
fn round<E: Element>(x: f32) -> f32 {
    E::from_f32(x).to_f32()
}

/// Elements per unit of parallel work: below this, waking another thread costs more than it saves.
const MIN_CHUNK_ELEMENTS: usize = 32 * 1024;

/// Whole rows of `width` adding up to about MIN_CHUNK_ELEMENTS (at least one row).
pub(crate) fn chunk_len(width: usize) -> usize {
    MIN_CHUNK_ELEMENTS.div_ceil(width.max(1)) * width.max(1)
}

/// Runs `work` once per chunk on up to `num_threads` threads (torch's OpenMP team where there
/// is one), each thread claiming the next unclaimed chunk.
pub(crate) fn for_row_chunks<T: Send>(chunks: Vec<T>, num_threads: usize, work: impl Fn(T) + Sync) {
    let slots: Vec<Mutex<Option<T>>> = chunks.into_iter().map(|chunk| Mutex::new(Some(chunk))).collect();
    let next = AtomicUsize::new(0);
    let run = || {
        while let Some(slot) = slots.get(next.fetch_add(1, Ordering::Relaxed)) {
            // Each slot is claimed once, so its lock is never contended.
            if let Some(chunk) = slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take() {
                work(chunk);
            }
        }
    };
    run_on_team(num_threads.clamp(1, slots.len().max(1)), &run);
}

pub(crate) fn check_rows(what: &str, len: usize, width: usize) -> Result<()> {
    if width == 0 || !len.is_multiple_of(width) {
        return invalid(format!("{what} has {len} elements, not whole rows of {width}"));
    }
    Ok(())
}

pub(crate) fn invalid(message: String) -> Result<()> {
    Err(Error::InvalidConfig { field: "inputs", message })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_kernels::simd::Bf16;

    fn pseudo_random(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % 20_001) as f32 / 10_000.0 - 1.0
            })
            .collect()
    }

    fn close(got: f32, want: f64, tolerance: f64) -> bool {
        (got as f64 - want).abs() <= tolerance * (1.0 + want.abs())
    }

    #[test]
    fn rms_norm_matches_a_float64_reference_with_and_without_residual() {
        let (rows, width, eps) = (5, 72, 1e-5);
        let input = pseudo_random(rows * width, 1);
        let residual_in = pseudo_random(rows * width, 2);
        let weight = pseudo_random(width, 3);
        let reference = |source: &[f32]| -> Vec<f64> {
            source
                .chunks(width)
                .flat_map(|row| {
                    let mean_square = row.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / width as f64;
                    let inverse = 1.0 / (mean_square + eps as f64).sqrt();
                    row.iter().zip(&weight).map(move |(&x, &w)| x as f64 * inverse * w as f64).collect::<Vec<_>>()
                })
                .collect()
        };
        let mut hidden = input.clone();
        rms_norm(&mut hidden, None, &weight, width, eps, 1).unwrap();
        for (got, want) in hidden.iter().zip(reference(&input)) {
            assert!(close(*got, want, 1e-5), "{got} vs {want}");
        }
        let (mut hidden, mut residual) = (input.clone(), residual_in.clone());
        rms_norm(&mut hidden, Some(&mut residual), &weight, width, eps, 1).unwrap();
        let sum: Vec<f32> = input.iter().zip(&residual_in).map(|(a, b)| a + b).collect();
        assert_eq!(residual, sum);
        for (got, want) in hidden.iter().zip(reference(&sum)) {
            assert!(close(*got, want, 1e-5), "{got} vs {want}");
        }
    }

    #[test]
    fn bf16_rounds_where_torch_rounds() {
        let (width, eps) = (64, 1e-6);
        let to_bf16 = |values: Vec<f32>| values.into_iter().map(Bf16::from_f32).collect::<Vec<_>>();
        let input = to_bf16(pseudo_random(2 * width, 4).iter().map(|x| x * 3.0).collect());
        let weight = to_bf16(pseudo_random(width, 5));
        let mut hidden = input.clone();
        rms_norm(&mut hidden, None, &weight, width, eps, 1).unwrap();
        for (row_in, row_out) in input.chunks(width).zip(hidden.chunks(width)) {
            let mean_square = row_in.iter().map(|x| x.to_f32() * x.to_f32()).sum::<f32>() / width as f32;
            let inverse = 1.0 / (mean_square + eps).sqrt();
            for ((x, w), got) in row_in.iter().zip(&weight).zip(row_out) {
                let normalized = Bf16::from_f32(x.to_f32() * inverse).to_f32();
                let want = Bf16::from_f32(w.to_f32() * normalized);
                // The float32 sum's order may move a rounding by one bf16 step.
                assert!((got.0 as i32 - want.0 as i32).abs() <= 1, "{got:?} vs {want:?}");
            }
        }
        let gate_up = to_bf16(pseudo_random(2 * width, 6).iter().map(|x| x * 8.0).collect());
        let mut out = vec![Bf16(0); width];
        silu_and_mul(&mut out, &gate_up, width, 1).unwrap();
        for i in 0..width {
            let (g, u) = (gate_up[i].to_f32() as f64, gate_up[width + i].to_f32());
            let silu = Bf16::from_f32((g / (1.0 + (-g).exp())) as f32).to_f32();
            assert_eq!(out[i], Bf16::from_f32(silu * u), "gate {g}, up {u}");
        }
    }

    #[test]
    fn silu_and_mul_is_exact_over_the_whole_range() {
        let width = 40;
        let mut gate_up = pseudo_random(2 * width, 7);
        gate_up[0] = 100.0;
        gate_up[1] = -100.0;
        gate_up[2] = 0.0;
        gate_up[3] = -20.0;
        let mut out = vec![f32::NAN; width];
        silu_and_mul(&mut out, &gate_up, width, 1).unwrap();
        for i in 0..width {
            let (g, u) = (gate_up[i] as f64, gate_up[width + i] as f64);
            let want = g / (1.0 + (-g).exp()) * u;
            assert!(close(out[i], want, 1e-6), "silu({g}) * {u} = {}, want {want}", out[i]);
        }
    }

    #[test]
    fn rotary_rotates_the_named_heads_only() {
        let shape = RotaryShape { num_tokens: 3, row_width: 4 * 8 + 8, num_heads: 4, head_dim: 8 };
        let original = pseudo_random(shape.num_tokens * shape.row_width, 8);
        let angles: Vec<f64> = (0..shape.num_tokens * 4).map(|i| 0.37 * i as f64).collect();
        // HF's layout: both halves of a row hold the same four frequencies.
        let table = |f: fn(f64) -> f64| -> Vec<f32> {
            (0..shape.num_tokens)
                .flat_map(|t| (0..8).map(move |d| (t, d % 4)))
                .map(|(t, k)| f(angles[t * 4 + k]) as f32)
                .collect()
        };
        let (cos, sin) = (table(f64::cos), table(f64::sin));
        let mut qkv = original.clone();
        rotary_in_place(&mut qkv, &cos, &sin, shape, 1).unwrap();
        for t in 0..shape.num_tokens {
            let row = &original[t * shape.row_width..][..shape.row_width];
            let rotated = &qkv[t * shape.row_width..][..shape.row_width];
            for head in 0..4 {
                for k in 0..4 {
                    let (a, b) = (row[head * 8 + k] as f64, row[head * 8 + k + 4] as f64);
                    let angle = angles[t * 4 + k] as f32 as f64;
                    let (c, s) = (angle.cos(), angle.sin());
                    assert!(close(rotated[head * 8 + k], a * c - b * s, 1e-6));
                    assert!(close(rotated[head * 8 + k + 4], b * c + a * s, 1e-6));
                }
            }
            assert_eq!(&rotated[32..], &row[32..], "the value heads must stay as they were");
        }
    }

    #[test]
    fn threads_change_nothing() {
        let (rows, width) = (300, 576);
        let input: Vec<Bf16> = pseudo_random(rows * 2 * width, 9).into_iter().map(Bf16::from_f32).collect();
        let weight: Vec<Bf16> = pseudo_random(width, 10).into_iter().map(Bf16::from_f32).collect();
        let run = |threads: usize| {
            let mut out = vec![Bf16(0); rows * width];
            silu_and_mul(&mut out, &input, width, threads).unwrap();
            let (mut hidden, mut residual) = (out.clone(), input[..rows * width].to_vec());
            rms_norm(&mut hidden, Some(&mut residual), &weight, width, 1e-5, threads).unwrap();
            let mut qkv = input.clone();
            let shape = RotaryShape { num_tokens: rows, row_width: 2 * width, num_heads: 9, head_dim: 64 };
            let cos_sin: Vec<Bf16> = input[..rows * 64].to_vec();
            rotary_in_place(&mut qkv, &cos_sin, &cos_sin, shape, threads).unwrap();
            (out, hidden, residual, qkv)
        };
        assert_eq!(run(1), run(3));
    }

    #[test]
    fn bad_shapes_are_errors() {
        let mut hidden = vec![0.0f32; 10];
        assert!(rms_norm(&mut hidden, None, &[1.0; 4], 4, 1e-5, 1).is_err());
        assert!(rms_norm(&mut hidden, None, &[1.0; 5], 5, 1e-5, 1).is_ok());
        assert!(rms_norm(&mut hidden, Some(&mut [0.0; 5]), &[1.0; 5], 5, 1e-5, 1).is_err());
        assert!(silu_and_mul(&mut hidden, &[0.0; 10], 5, 1).is_err());
        let shape = RotaryShape { num_tokens: 1, row_width: 10, num_heads: 2, head_dim: 6 };
        assert!(rotary_in_place(&mut hidden, &[0.0; 6], &[0.0; 6], shape, 1).is_err());
        let shape = RotaryShape { num_tokens: 1, row_width: 10, num_heads: 1, head_dim: 5 };
        assert!(rotary_in_place(&mut hidden, &[0.0; 5], &[0.0; 5], shape, 1).is_err());
    }
}

//! out[M, N] = x[M, K] @ weight[N, K]^T (+ bias[N]) for the few rows of a decode step, where
//! reading the weights is the whole cost: each weight row is read from memory once per call for
//! all M rows (torch's GEMM at M = 1 reaches well under half the memory bandwidth).
//!
//! A tile is NR weight rows by up to MR rows of x, whose NR * MR float32 dot products run side by
//! side (independent FMA chains); the M rows take turns on a tile while its weight rows are in
//! L1. Threads (torch's OpenMP team) claim column ranges of the output, a range of weight rows
//! each. Activations and output are float32 or bfloat16, weights float32 or bfloat16, math float32.

use crate::cpu_kernels::layer_ops::{chunk_len, for_row_chunks, invalid};
use crate::cpu_kernels::simd::{with_isa, Element, ElementKind, Isa};
use crate::errors::{Error, Result};

/// Weight rows per tile.
const NR: usize = 4;
/// Rows of x per tile at most: NR * MR accumulators, NR widened weight vectors and one of x fit
/// AVX-512's 32 registers; AVX2's 16 hold half as many rows (`rows_per_tile`).
const MR: usize = 4;

/// Rows of x a tile takes on `isa`: each weight vector is widened once per tile, so more rows
/// per tile widen less per product (batches of 16-64 on AVX-512: the widening was the limit).
fn rows_per_tile(isa: Isa) -> usize {
    if isa == Isa::Avx512 {
        MR
    } else {
        2
    }
}

/// The sizes of one call: x is [rows, in_features], weight [out_features, in_features].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearShape {
    pub rows: usize,
    pub in_features: usize,
    pub out_features: usize,
}

/// out = x @ weight^T + bias with the widest instruction set this CPU runs (all row-major,
/// contiguous); bias (the weight's element type) is optional.
pub fn small_m_linear<E: Element, W: Element>(
    out: &mut [E],
    x: &[E],
    weight: &[W],
    bias: Option<&[W]>,
    shape: LinearShape,
    num_threads: usize,
) -> Result<()> {
    small_m_linear_with(Isa::best(), out, x, weight, bias, shape, num_threads)
}

/// `small_m_linear` on a chosen instruction set (tests compare them); one this CPU lacks is an error.
pub fn small_m_linear_with<E: Element, W: Element>(
    isa: Isa,
    out: &mut [E],
    x: &[E],
    weight: &[W],
    bias: Option<&[W]>,
    shape: LinearShape,
    num_threads: usize,
) -> Result<()> {
    check(isa, out, x, weight, bias, shape)?;
    let LinearShape { rows, in_features: k, out_features: n } = shape;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    // x is widened once here, not once per tile.
    let x: Vec<f32> = x.iter().map(|value| value.to_f32()).collect();
    // Each unit of work: a range of columns, as one piece of each of the M output rows; one run
    // per thread, so each streams its weight rows in one sequence (claimed in turn, ~60 columns at a
    // time, every claim moved the shared counter between cores and restarted the prefetcher).
    let columns_per_chunk = (chunk_len(k) / k.max(1)).max(n.div_ceil(num_threads.max(1))).next_multiple_of(NR);
    let mut chunks: Vec<(usize, Vec<&mut [E]>)> =
        (0..n.div_ceil(columns_per_chunk)).map(|c| (c * columns_per_chunk, Vec::with_capacity(rows))).collect();
    for row in out.chunks_mut(n) {
        for (piece, chunk) in row.chunks_mut(columns_per_chunk).zip(chunks.iter_mut()) {
            chunk.1.push(piece);
        }
    }
    for_row_chunks(chunks, num_threads, |(first_column, mut pieces): (usize, Vec<&mut [E]>)| {
        let width = pieces[0].len();
        let weight = &weight[first_column * k..][..width * k];
        let bias = bias.map(|bias| &bias[first_column..][..width]);
        columns(isa, &mut pieces, &x, weight, bias, k);
    });
    Ok(())
}

fn check<E: Element, W: Element>(
    isa: Isa,
    out: &[E],
    x: &[E],
    weight: &[W],
    bias: Option<&[W]>,
    shape: LinearShape,
) -> Result<()> {
    if !isa.is_supported() {
        return Err(Error::InvalidConfig { field: "isa", message: format!("this CPU cannot run {isa:?}") });
    }
    let floats = |kind| matches!(kind, ElementKind::F32 | ElementKind::Bf16);
    if !floats(E::KIND) || !floats(W::KIND) {
        return invalid(format!("elements must be float32 or bfloat16, got {:?} and {:?}", E::KIND, W::KIND));
    }
    let LinearShape { rows, in_features: k, out_features: n } = shape;
    if x.len() != rows * k || out.len() != rows * n || weight.len() != n * k {
        return invalid(format!(
            "want x [{rows}, {k}], weight [{n}, {k}], out [{rows}, {n}]; got {}, {} and {} elements",
            x.len(),
            weight.len(),
            out.len()
        ));
    }
    match bias {
        Some(bias) if bias.len() != n => invalid(format!("bias has {} elements for {n} outputs", bias.len())),
        _ => Ok(()),
    }
}

/// One chunk: `pieces[m]` is output row m's columns of `weight`'s rows.
fn columns<E: Element, W: Element>(
    isa: Isa,
    pieces: &mut [&mut [E]],
    x: &[f32],
    weight: &[W],
    bias: Option<&[W]>,
    k: usize,
) {
    let width = pieces[0].len();
    let mut sums = [[0.0f32; NR]; MR];
    let mr = rows_per_tile(isa);
    for first in (0..width).step_by(NR) {
        let tile_width = NR.min(width - first);
        let tile = &weight[first * k..][..tile_width * k];
        let mut m = 0;
        while m < pieces.len() {
            let tile_rows = mr.min(pieces.len() - m);
            let x_rows = &x[m * k..][..tile_rows * k];
            tile_dots(isa, x_rows, tile, k, tile_rows, tile_width, &mut sums);
            for r in 0..tile_rows {
                for c in 0..tile_width {
                    let added = bias.map_or(0.0, |bias| bias[first + c].to_f32());
                    pieces[m + r][first + c] = E::from_f32(sums[r][c] + added);
                }
            }
            m += tile_rows;
        }
    }
}

/// sums[r][c] = x row r . weight row c for the tile's `rows` rows of x and `width` weight rows.
#[inline(always)]
fn tile_dots<W: Element>(
    isa: Isa,
    x_rows: &[f32],
    tile: &[W],
    k: usize,
    rows: usize,
    width: usize,
    sums: &mut [[f32; NR]; MR],
) {
    match (rows, width) {
        (1, NR) => dot_tile::<W, 1>(isa, x_rows, tile, k, sums),
        (2, NR) => dot_tile::<W, 2>(isa, x_rows, tile, k, sums),
        (3, NR) => dot_tile::<W, 3>(isa, x_rows, tile, k, sums),
        (4, NR) => dot_tile::<W, 4>(isa, x_rows, tile, k, sums),
        // The last tile of a chunk whose width is not a multiple of NR: rare, plain code.
        _ => {
            for (r, x_row) in x_rows.chunks_exact(k).enumerate() {
                for (c, w_row) in tile.chunks_exact(k).enumerate() {
                    sums[r][c] = x_row.iter().zip(w_row).map(|(a, b)| a * b.to_f32()).sum();
                }
            }
        }
    }
}

/// sums[r][c] = x row r . weight row c, for `ROWS` rows of x (each `k` long) and NR weight rows.
#[inline(always)]
fn dot_tile<W: Element, const ROWS: usize>(isa: Isa, x: &[f32], weight: &[W], k: usize, sums: &mut [[f32; NR]; MR]) {
    match isa {
        // SAFETY: the caller checked that this CPU runs `isa`; x holds ROWS rows of k and
        // weight NR rows of k.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { x86::dot_tile_avx2::<W, ROWS>(x, weight, k, sums) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86_512::dot_tile_avx512::<W, ROWS>(x, weight, k, sums) },
        _ => with_isa(
            isa,
            #[inline(always)]
            || dot_tile_portable::<W, ROWS>(x, weight, k, sums),
        ),
    }
}

/// `dot_tile` in 8 float32 lanes per dot product, which the compiler maps onto SSE2 registers.
#[inline(always)]
fn dot_tile_portable<W: Element, const ROWS: usize>(x: &[f32], weight: &[W], k: usize, sums: &mut [[f32; NR]; MR]) {
    const LANES: usize = 8;
    let mut lanes = [[[0.0f32; LANES]; NR]; ROWS];
    let body = k - k % LANES;
    for i in (0..body).step_by(LANES) {
        for c in 0..NR {
            let w: [f32; LANES] = std::array::from_fn(|l| weight[c * k + i + l].to_f32());
            for r in 0..ROWS {
                let x_lanes = &x[r * k + i..][..LANES];
                for l in 0..LANES {
                    lanes[r][c][l] += x_lanes[l] * w[l];
                }
            }
        }
    }
    for r in 0..ROWS {
        for c in 0..NR {
            let tail: f32 = (body..k).map(|i| x[r * k + i] * weight[c * k + i].to_f32()).sum();
            sums[r][c] = lanes[r][c].iter().sum::<f32>() + tail;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{MR, NR};
    use crate::cpu_kernels::simd::{Element, ElementKind};

    /// 8 weights at `p` widened to float32 (bfloat16: zero-extended into the high half, exact).
    #[inline(always)]
    unsafe fn load8<W: Element>(p: *const W) -> __m256 {
        match W::KIND {
            ElementKind::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                p as *const __m128i,
            )))),
            _ => _mm256_loadu_ps(p as *const f32), // (check() lets float32 and bfloat16 in only)
        }
    }

    #[inline(always)]
    unsafe fn sum8(v: __m256) -> f32 {
        let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
        _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps::<1>(pair, pair)))
    }

    /// `dot_tile` with AVX2 and FMA: NR * ROWS accumulators of 8 lanes.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_tile_avx2<W: Element, const ROWS: usize>(
        x: &[f32],
        weight: &[W],
        k: usize,
        sums: &mut [[f32; NR]; MR],
    ) {
        let (x, w) = (x.as_ptr(), weight.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); NR]; ROWS];
        let body = k - k % 8;
        let mut i = 0;
        while i < body {
            // The same place in the next tile's rows (NR * k on): without it a decode step's
            // bfloat16 weights streamed ~25% slower on one AVX2 core (float32: no change measured).
            // (A prefetch past the last tile never faults; wrapping_add keeps its address legal.)
            for c in 0..NR {
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(c * k + i + NR * k) as *const i8);
            }
            let w_lanes: [__m256; NR] = std::array::from_fn(|c| load8(w.add(c * k + i)));
            for (r, acc_row) in acc.iter_mut().enumerate() {
                let x_lanes = _mm256_loadu_ps(x.add(r * k + i));
                for (acc, w_lane) in acc_row.iter_mut().zip(&w_lanes) {
                    *acc = _mm256_fmadd_ps(x_lanes, *w_lane, *acc);
                }
            }
            i += 8;
        }
        for r in 0..ROWS {
            for c in 0..NR {
                let tail: f32 = (body..k).map(|i| *x.add(r * k + i) * (*w.add(c * k + i)).to_f32()).sum();
                sums[r][c] = sum8(acc[r][c]) + tail;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86_512 {
    use std::arch::x86_64::*;

    use super::{MR, NR};
    use crate::cpu_kernels::simd::{Element, ElementKind};

    /// 16 weights at `p` widened to float32 (bfloat16: zero-extended into the high half, exact).
    #[inline(always)]
    unsafe fn load16<W: Element>(p: *const W) -> __m512 {
        match W::KIND {
            ElementKind::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p as *const __m256i),
            ))),
            _ => _mm512_loadu_ps(p as *const f32), // (check() lets float32 and bfloat16 in only)
        }
    }

    /// `dot_tile` with AVX-512: NR * ROWS accumulators of 16 lanes, 32 weights of a row per step
    /// (a bfloat16 row's cache line: one prefetch of the next tile's line per row and step).
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn dot_tile_avx512<W: Element, const ROWS: usize>(
        x: &[f32],
        weight: &[W],
        k: usize,
        sums: &mut [[f32; NR]; MR],
    ) {
        let (x, w) = (x.as_ptr(), weight.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); NR]; ROWS];
        let body = k - k % 32;
        let mut i = 0;
        while i < body {
            for c in 0..NR {
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(c * k + i + NR * k) as *const i8);
            }
            for half in [0, 16] {
                let w_lanes: [__m512; NR] = std::array::from_fn(|c| load16(w.add(c * k + i + half)));
                for (r, acc_row) in acc.iter_mut().enumerate() {
                    let x_lanes = _mm512_loadu_ps(x.add(r * k + i + half));
                    for (acc, w_lane) in acc_row.iter_mut().zip(&w_lanes) {
                        *acc = _mm512_fmadd_ps(x_lanes, *w_lane, *acc);
                    }
                }
            }
            i += 32;
        }
        for r in 0..ROWS {
            for c in 0..NR {
                let tail: f32 = (body..k).map(|i| *x.add(r * k + i) * (*w.add(c * k + i)).to_f32()).sum();
                sums[r][c] = _mm512_reduce_add_ps(acc[r][c]) + tail;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_kernels::decode_attention::tests::pseudo_random;
    use crate::cpu_kernels::simd::Bf16;

    /// The float64 reference of the values as the kernel reads them.
    fn reference<E: Element, W: Element>(x: &[E], weight: &[W], bias: Option<&[W]>, shape: LinearShape) -> Vec<f64> {
        let LinearShape { rows, in_features: k, out_features: n } = shape;
        (0..rows * n)
            .map(|i| {
                let (m, c) = (i / n, i % n);
                let dot: f64 = (0..k).map(|j| x[m * k + j].to_f32() as f64 * weight[c * k + j].to_f32() as f64).sum();
                dot + bias.map_or(0.0, |bias| bias[c].to_f32() as f64)
            })
            .collect()
    }

    fn isas() -> impl Iterator<Item = Isa> {
        [Isa::Portable, Isa::Avx2Fma, Isa::Avx512].into_iter().filter(|isa| isa.is_supported())
    }

    #[test]
    fn float32_matches_a_float64_reference_on_odd_shapes() {
        for (rows, k, n) in [(1, 64, 8), (1, 13, 5), (2, 100, 37), (3, 577, 130), (5, 8, 4), (17, 33, 9), (4, 1, 3)] {
            let shape = LinearShape { rows, in_features: k, out_features: n };
            let x = pseudo_random(rows * k, 1);
            let weight = pseudo_random(n * k, 2);
            let bias = pseudo_random(n, 3);
            for isa in isas() {
                for bias in [None, Some(&bias[..])] {
                    for threads in [1, 3] {
                        let mut out = vec![f32::NAN; rows * n];
                        small_m_linear_with(isa, &mut out, &x, &weight, bias, shape, threads).unwrap();
                        for (got, want) in out.iter().zip(reference(&x, &weight, bias, shape)) {
                            // float32 sums of k products of values below 1
                            let tolerance = 1e-6 * (k as f64).sqrt() * 4.0;
                            assert!((*got as f64 - want).abs() <= tolerance, "{isa:?} {shape:?}: {got} vs {want}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bfloat16_weights_and_activations_round_once() {
        let shape = LinearShape { rows: 3, in_features: 75, out_features: 21 };
        let to_bf16 = |values: Vec<f32>| values.into_iter().map(Bf16::from_f32).collect::<Vec<_>>();
        let x = to_bf16(pseudo_random(3 * 75, 4));
        let weight = to_bf16(pseudo_random(21 * 75, 5));
        let bias = to_bf16(pseudo_random(21, 6));
        for isa in isas() {
            let mut out = vec![Bf16(0); 3 * 21];
            small_m_linear_with(isa, &mut out, &x, &weight, Some(&bias), shape, 2).unwrap();
            for (got, want) in out.iter().zip(reference(&x, &weight, Some(&bias), shape)) {
                // One rounding to bfloat16 (half a step: 2^-9 relative) over a float32 sum.
                let tolerance = want.abs() * 2f64.powi(-8) + 1e-5;
                assert!((got.to_f32() as f64 - want).abs() <= tolerance, "{isa:?}: {got:?} vs {want}");
            }
            // float32 activations with bfloat16 weights: no rounding but the sum's.
            let x32: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
            let mut out32 = vec![0.0f32; 3 * 21];
            small_m_linear_with(isa, &mut out32, &x32, &weight, None, shape, 1).unwrap();
            for (got, want) in out32.iter().zip(reference(&x32, &weight, None, shape)) {
                assert!((*got as f64 - want).abs() <= 1e-5, "{isa:?}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn bfloat16_weights_give_the_bits_of_their_float32_widening_at_any_row_count() {
        // (widening is exact, and the tiles sum in the same order whatever the weights' type)
        let (k, n) = (70, 13);
        let weight: Vec<Bf16> = pseudo_random(n * k, 9).into_iter().map(Bf16::from_f32).collect();
        let widened: Vec<f32> = weight.iter().map(|w| w.to_f32()).collect();
        for rows in [1, 3, 4, 5, 9, 17] {
            let shape = LinearShape { rows, in_features: k, out_features: n };
            let x = pseudo_random(rows * k, 10);
            for isa in isas() {
                let (mut from_bf16, mut from_f32) = (vec![0.0f32; rows * n], vec![0.0f32; rows * n]);
                small_m_linear_with(isa, &mut from_bf16, &x, &weight, None, shape, 2).unwrap();
                small_m_linear_with(isa, &mut from_f32, &x, &widened, None, shape, 2).unwrap();
                assert_eq!(from_bf16, from_f32, "{isa:?}, {rows} rows");
            }
        }
    }

    #[test]
    fn isas_and_thread_counts_agree_bit_for_bit() {
        let shape = LinearShape { rows: 7, in_features: 640, out_features: 203 };
        let x = pseudo_random(7 * 640, 7);
        let weight = pseudo_random(203 * 640, 8);
        let run = |threads| {
            let mut out = vec![0.0f32; 7 * 203];
            small_m_linear(&mut out, &x, &weight, None, shape, threads).unwrap();
            out
        };
        assert_eq!(run(1), run(4));
    }

    #[test]
    fn bad_shapes_are_errors() {
        let shape = LinearShape { rows: 2, in_features: 4, out_features: 3 };
        let (x, weight, mut out) = (vec![0.0f32; 8], vec![0.0f32; 12], vec![0.0f32; 6]);
        assert!(small_m_linear(&mut out, &x, &weight, None, shape, 1).is_ok());
        assert!(small_m_linear(&mut out, &x[..7], &weight, None, shape, 1).is_err());
        assert!(small_m_linear(&mut out, &x, &weight[..8], None, shape, 1).is_err());
        assert!(small_m_linear(&mut out[..5], &x, &weight, None, shape, 1).is_err());
        assert!(small_m_linear(&mut out, &x, &weight, Some(&[0.0; 2]), shape, 1).is_err());
        let empty = LinearShape { rows: 0, in_features: 4, out_features: 3 };
        assert!(small_m_linear::<f32, f32>(&mut [], &[], &weight, None, empty, 1).is_ok());
    }
}

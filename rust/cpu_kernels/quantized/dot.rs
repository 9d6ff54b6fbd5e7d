//! One weight row times one row of quantized activations: the scalar reference every SIMD path
//! equals bit for bit.
//!
//! Each block's integer products sum exactly, so every path gets the same integers; the floats
//! are then combined in one fixed order, which differs by format family:
//!
//! - Q4_0, Q4_1, Q8_0 (blocks of 32; eight_rows.rs): per block, the integer total t of w * x
//!   (w signed: Q4_0 q - 8, Q8_0 q; Q4_1 q), then `acc = fma(d_w * d_x, t, acc)` in f32, and for
//!   Q4_1 `mins = fma(m, s, mins)`; the result is `acc + mins`.
//! - Q4_K, Q5_K, Q6_K (blocks of 256; k_quants.rs, k_quant_tiles.rs, x86.rs): per block, the
//!   integer total t of scale * w * x over its sub-blocks (Q4_K, Q5_K: 6-bit scales of 32s, w = q;
//!   Q6_K: int8 scales of 16s, w = q - 32), then `acc = fma(d_w * d_x, t, acc)` in f32, and for Q4_K and Q5_K
//!   `mins = fma(dmin * d_x, sum(min * sum of the 32's x), mins)`; the result is `acc - mins`
//!   (Q6_K: `acc`). One total per block is what lets a kernel hold one row per lane.

use super::activations::QuantizedActivations;
use super::formats::{f16_at, q4_k_or_q5_k_value, q4_k_scale_min, q6_k_value, GgmlType};

/// The float accumulators of one K-quant dot product.
#[derive(Default, Clone, Copy)]
pub(crate) struct KQuantSums {
    pub acc: f32,
    pub mins: f32,
}

impl KQuantSums {
    /// The result: Q4_K's and Q5_K's mins term taken off.
    #[inline(always)]
    pub fn finish(self, ty: GgmlType) -> f32 {
        if ty.has_mins() {
            self.acc - self.mins
        } else {
            self.acc
        }
    }
}

/// Σ over a weight row of `ty` blocks (`row`) times quantized activations starting at block
/// `first_block` of `activations`: the scalar reference.
pub fn dot_row_scalar(ty: GgmlType, row: &[u8], activations: &QuantizedActivations, first_block: usize) -> f32 {
    if ty.block_len() == 32 {
        return dot_row_32_scalar(ty, row, activations, first_block);
    }
    let mut sums = KQuantSums::default();
    for (b, block) in row.chunks_exact(ty.block_bytes()).enumerate() {
        let a = first_block + b;
        let quants = &activations.quants[a * 256..(a + 1) * 256];
        let act_scale = activations.scales[a];
        let total: i32 = match ty {
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let scales = &block[4..16];
                let sub_block_total = |j: usize| -> i32 {
                    (32 * j..32 * j + 32).map(|e| q4_k_or_q5_k_value(ty, block, e) as i32 * quants[e] as i32).sum()
                };
                let sums_of_32 = &activations.sums_of_32[8 * a..8 * (a + 1)];
                let mins: i32 = (0..8).map(|j| q4_k_scale_min(j, scales).1 as i32 * sums_of_32[j] as i32).sum();
                sums.mins = (f16_at(block, 2) * act_scale).mul_add(mins as f32, sums.mins);
                (0..8).map(|j| q4_k_scale_min(j, scales).0 as i32 * sub_block_total(j)).sum()
            }
            GgmlType::Q6_K => (0..16)
                .map(|j| {
                    let scale = block[192 + j] as i8 as i32;
                    let sub_block: i32 =
                        (16 * j..16 * j + 16).map(|e| (q6_k_value(block, e) as i32 - 32) * quants[e] as i32).sum();
                    scale * sub_block
                })
                .sum(),
            _ => unreachable!("blocks of 32 are summed above"),
        };
        let weight_scale = f16_at(block, if ty == GgmlType::Q6_K { 208 } else { 0 });
        sums.acc = (weight_scale * act_scale).mul_add(total as f32, sums.acc);
    }
    sums.finish(ty)
}

/// `dot_row_scalar` for Q4_0, Q4_1 and Q8_0: a total per block, combined by fused multiply-add.
fn dot_row_32_scalar(ty: GgmlType, row: &[u8], activations: &QuantizedActivations, first_block: usize) -> f32 {
    let (mut acc, mut mins) = (0f32, 0f32);
    for (b, block) in row.chunks_exact(ty.block_bytes()).enumerate() {
        let a = first_block + b;
        let x = &activations.quants[a * 32..(a + 1) * 32];
        let weight = |e: usize| -> i32 {
            match ty {
                GgmlType::Q8_0 => block[2 + e] as i8 as i32,
                _ => {
                    let nibbles = if ty == GgmlType::Q4_1 { &block[4..20] } else { &block[2..18] };
                    let q = if e < 16 { nibbles[e] & 0xf } else { nibbles[e - 16] >> 4 } as i32;
                    if ty == GgmlType::Q4_0 {
                        q - 8
                    } else {
                        q
                    }
                }
            }
        };
        let total: i32 = (0..32).map(|e| weight(e) * x[e] as i32).sum();
        acc = (f16_at(block, 0) * activations.scales[a]).mul_add(total as f32, acc);
        if ty == GgmlType::Q4_1 {
            mins = f16_at(block, 2).mul_add(activations.sums[a], mins);
        }
    }
    acc + mins
}

/// The same sums for `R` weight rows (of one length) and the tokens whose activations start at
/// `first_blocks`, `[row][token]`, on the widest path this CPU runs (`use_simd` false: the scalar
/// reference). Reading a row once for several tokens is what makes more than one token cheaper
/// than one call each; several rows at one token let the sums overlap.
#[inline]
pub fn dot_rows<const R: usize, const T: usize>(
    ty: GgmlType,
    rows: [&[u8]; R],
    activations: &QuantizedActivations,
    first_blocks: [usize; T],
    use_simd: bool,
) -> [[f32; T]; R] {
    #[cfg(target_arch = "x86_64")]
    if use_simd {
        // SAFETY: callers pass use_simd only where `Isa::best()` is not Portable (AVX2, FMA, F16C).
        return unsafe { super::x86::dot_rows_avx2(ty, rows, activations, first_blocks) };
    }
    let _ = use_simd;
    rows.map(|row| first_blocks.map(|first_block| dot_row_scalar(ty, row, activations, first_block)))
}

//! One weight row times one row of quantized activations: the scalar reference every SIMD path
//! equals bit for bit.
//!
//! Each block's integer products sum exactly, so every path gets the same integers; the floats
//! are then combined in one fixed order, which differs by format family:
//!
//! - Q4_0, Q4_1, Q8_0 (blocks of 32; eight_rows.rs): per block, the integer total t of w * x
//!   (w signed: Q4_0 q - 8, Q8_0 q; Q4_1 q), then `acc = fma(d_w * d_x, t, acc)` in f32, and for
//!   Q4_1 `mins = fma(m, s, mins)`; the result is `acc + mins`.
//! - Q4_K, Q6_K (blocks of 256; k_quants.rs, x86.rs): sums into 16 int32 lanes, lane l (0..8)
//!   holding the elements of even 32s (sub-blocks of 32 numbered in the block) whose position
//!   within their 32 is 4l..4l+3, lane 8 + l those of odd 32s (times their sub-block's scale): what
//!   maddubs + madd leave in a 512-bit register that holds two 32s. Per lane,
//!   `acc[l] = fma(scale, lanes[l], acc[l])` with scale = d_w * d_x; Q4_K's mins term has its own
//!   `mins = fma(dmin * d_x, sum(min * bsum), mins)`; the result is the lanes' tree of
//!   `Accumulators::finish` minus `mins`.

use super::activations::QuantizedActivations;
use super::formats::{f16_at, q4_k_scale_min, q6_k_value, GgmlType};

/// The float accumulators of one dot product.
#[derive(Default)]
pub(crate) struct Accumulators {
    pub lanes: [f32; 16],
    pub mins: f32,
}

impl Accumulators {
    #[inline(always)]
    fn add_block(&mut self, scale: f32, lanes: [i32; 16]) {
        for (acc, lane) in self.lanes.iter_mut().zip(lanes) {
            *acc = scale.mul_add(lane as f32, *acc);
        }
    }

    /// The lanes summed in the fixed tree order, then the mins term.
    #[inline(always)]
    pub fn finish(&self, ty: GgmlType) -> f32 {
        let a: [f32; 8] = std::array::from_fn(|l| self.lanes[l] + self.lanes[l + 8]);
        let total = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        if ty == GgmlType::Q4_K {
            total - self.mins
        } else {
            total
        }
    }
}

/// Σ over a weight row of `ty` blocks (`row`) times quantized activations starting at block
/// `first_block` of `activations`: the scalar reference.
pub fn dot_row_scalar(ty: GgmlType, row: &[u8], activations: &QuantizedActivations, first_block: usize) -> f32 {
    if ty.block_len() == 32 {
        return dot_row_32_scalar(ty, row, activations, first_block);
    }
    let mut acc = Accumulators::default();
    let block_len = ty.block_len();
    for (b, block) in row.chunks_exact(ty.block_bytes()).enumerate() {
        let a = first_block + b;
        let quants = &activations.quants[a * block_len..(a + 1) * block_len];
        let act_scale = activations.scales[a];
        let mut lanes = [0i32; 16];
        let lane = |e: usize| 8 * ((e / 32) % 2) + (e % 32) / 4;
        match ty {
            GgmlType::Q4_K => {
                let (scales, nibbles) = (&block[4..16], &block[16..144]);
                for (e, &x) in quants.iter().enumerate() {
                    let sub_block = e / 32;
                    let byte = nibbles[32 * (sub_block / 2) + e % 32];
                    let q = if sub_block % 2 == 0 { byte & 0xf } else { byte >> 4 };
                    lanes[lane(e)] += q4_k_scale_min(sub_block, scales).0 as i32 * (q as i32 * x as i32);
                }
                let sums_of_16 = &activations.sums_of_16[16 * a..16 * (a + 1)];
                let mins: i32 = (0..16).map(|j| sums_of_16[j] * q4_k_scale_min(j / 2, scales).1 as i32).sum();
                acc.mins = (f16_at(block, 2) * act_scale).mul_add(mins as f32, acc.mins);
            }
            GgmlType::Q6_K => {
                for (e, &x) in quants.iter().enumerate() {
                    let scale = block[192 + e / 16] as i8 as i32;
                    lanes[lane(e)] += scale * ((q6_k_value(block, e) as i32 - 32) * x as i32);
                }
            }
            _ => unreachable!("blocks of 32 are summed above"),
        }
        let weight_scale = f16_at(block, if ty == GgmlType::Q6_K { 208 } else { 0 });
        acc.add_block(weight_scale * act_scale, lanes);
    }
    acc.finish(ty)
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

//! The AVX2 dot products: the scalar reference's integer lanes (dot.rs) from maddubs + madd, and
//! its float combination in the same order.

use std::arch::x86_64::*;

use super::activations::QuantizedActivations;
use super::dot::Accumulators;
use super::formats::{f16_at, q4_k_scale_min, GgmlType};

/// `dot::dot_row_scalar`, bit for bit.
///
/// # Safety
/// The CPU must run AVX2 and FMA; `row` holds whole blocks and `activations` at least
/// `first_block` plus that many blocks.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot_row_avx2(
    ty: GgmlType,
    row: &[u8],
    activations: &QuantizedActivations,
    first_block: usize,
) -> f32 {
    let block_len = ty.block_len();
    let num_blocks = row.len() / ty.block_bytes();
    assert!(activations.scales.len() >= first_block + num_blocks);
    let ones = _mm256_set1_epi16(1);
    let low_nibbles = _mm256_set1_epi8(0xf);
    let mut acc = _mm256_setzero_ps();
    let mut mins = 0f32;
    for (b, block) in row.chunks_exact(ty.block_bytes()).enumerate() {
        let a = first_block + b;
        let x = activations.quants.as_ptr().add(a * block_len) as *const __m256i;
        let act_scale = *activations.scales.get_unchecked(a);
        let half = |offset: usize| f16_at(block, offset);
        let (weight_scale, lanes) = match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let packed =
                    _mm_loadu_si128(block.as_ptr().add(if ty == GgmlType::Q4_1 { 4 } else { 2 }) as *const __m128i);
                // Low nibbles are elements 0-15, high 16-31: one register in element order.
                let q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low_nibbles);
                let x = _mm256_loadu_si256(x);
                let lanes = if ty == GgmlType::Q4_1 {
                    mins += half(2) * *activations.sums.get_unchecked(a);
                    _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), ones)
                } else {
                    signed_lanes(_mm256_sub_epi8(q, _mm256_set1_epi8(8)), x, ones)
                };
                (half(0), lanes)
            }
            GgmlType::Q8_0 => {
                let w = _mm256_loadu_si256(block.as_ptr().add(2) as *const __m256i);
                (half(0), signed_lanes(w, _mm256_loadu_si256(x), ones))
            }
            GgmlType::Q4_K => {
                let scales = &block[4..16];
                let mut lanes = _mm256_setzero_si256();
                for pair in 0..4 {
                    let packed = _mm256_loadu_si256(block.as_ptr().add(16 + 32 * pair) as *const __m256i);
                    let low = _mm256_and_si256(packed, low_nibbles);
                    let high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
                    for (sub_block, q) in [(2 * pair, low), (2 * pair + 1, high)] {
                        // maddubs pairs stay below 2 * 15 * 127, far from int16 saturation.
                        let products = _mm256_maddubs_epi16(q, _mm256_loadu_si256(x.add(sub_block)));
                        let scale = _mm256_set1_epi16(q4_k_scale_min(sub_block, scales).0 as i16);
                        lanes = _mm256_add_epi32(lanes, _mm256_madd_epi16(products, scale));
                    }
                }
                let sums_of_16 = activations.sums_of_16.get_unchecked(16 * a..16 * (a + 1));
                let block_mins: i32 = (0..16).map(|j| sums_of_16[j] * q4_k_scale_min(j / 2, scales).1 as i32).sum();
                mins += (half(2) * act_scale) * block_mins as f32;
                (half(0), lanes)
            }
            GgmlType::Q6_K => {
                let mut lanes = _mm256_setzero_si256();
                let thirty_two = _mm256_set1_epi8(32);
                for half_block in 0..2 {
                    let low = block.as_ptr().add(64 * half_block);
                    let high = _mm256_loadu_si256(block.as_ptr().add(128 + 32 * half_block) as *const __m256i);
                    let low_a = _mm256_loadu_si256(low as *const __m256i);
                    let low_b = _mm256_loadu_si256(low.add(32) as *const __m256i);
                    let nibbles = [
                        _mm256_and_si256(low_a, low_nibbles),
                        _mm256_and_si256(low_b, low_nibbles),
                        _mm256_and_si256(_mm256_srli_epi16(low_a, 4), low_nibbles),
                        _mm256_and_si256(_mm256_srli_epi16(low_b, 4), low_nibbles),
                    ];
                    for (quarter, nibble) in nibbles.into_iter().enumerate() {
                        let high_bits = _mm256_and_si256(srli_epi16_by(high, 2 * quarter), _mm256_set1_epi8(3));
                        let q = _mm256_or_si256(nibble, _mm256_slli_epi16(high_bits, 4));
                        let chunk = 4 * half_block + quarter;
                        let x = _mm256_loadu_si256(x.add(chunk));
                        // (q - 32) * x as q * x - 32 * x: each maddubs pair fits int16, so does the difference.
                        let products =
                            _mm256_sub_epi16(_mm256_maddubs_epi16(q, x), _mm256_maddubs_epi16(thirty_two, x));
                        let scale_a = block[192 + 2 * chunk] as i8 as i16;
                        let scale_b = block[192 + 2 * chunk + 1] as i8 as i16;
                        let scales = _mm256_set_m128i(_mm_set1_epi16(scale_b), _mm_set1_epi16(scale_a));
                        lanes = _mm256_add_epi32(lanes, _mm256_madd_epi16(products, scales));
                    }
                }
                (half(208), lanes)
            }
        };
        let scale = _mm256_set1_ps(weight_scale * act_scale);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(lanes)));
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    Accumulators { lanes, mins }.finish(ty)
}

/// Lanes of signed weights times signed activations: maddubs takes |w| unsigned and x with w's
/// sign (|w| <= 128, |x| <= 127: pairs stay below int16's limit).
#[inline(always)]
unsafe fn signed_lanes(w: __m256i, x: __m256i, ones: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones)
}

/// A 16-bit right shift by 0, 2, 4 or 6 (the intrinsic wants a constant).
#[inline(always)]
unsafe fn srli_epi16_by(value: __m256i, bits: usize) -> __m256i {
    match bits {
        0 => value,
        2 => _mm256_srli_epi16(value, 2),
        4 => _mm256_srli_epi16(value, 4),
        _ => _mm256_srli_epi16(value, 6),
    }
}

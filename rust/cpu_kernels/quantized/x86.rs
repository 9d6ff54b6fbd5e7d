//! The AVX2 dot products of the K-quants (Q4_K, Q5_K, Q6_K): each block's integer total (dot.rs) from
//! maddubs + madd, and the scalar reference's float combination. One weight row is
//! read once for up to `T` tokens: each 32 weights are unpacked once and meet every token's
//! activations. (The blocks of 32 take eight_rows.rs.)

use std::arch::x86_64::*;

use super::activations::QuantizedActivations;
use super::dot::KQuantSums;
use super::formats::{q4_k_scale_min, GgmlType};

/// How far ahead of the block being read the weights are prefetched: ~12-15% off a batch-1
/// decode step of the embedded Q4_1 model against none (512 and 2048 were no better).
const PREFETCH_BYTES: usize = 1024;

/// `dot::dot_row_scalar` of each of `R` weight rows (of one length) for the tokens whose
/// activations start at `first_blocks`, bit for bit: `[row][token]`. Rows side by side give the
/// core independent sums to overlap where there is one token.
///
/// # Safety
/// The CPU must run AVX2, FMA and F16C; every row holds the same whole number of blocks and
/// `activations` holds each `first_blocks[t]` plus that many blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_rows_avx2<const R: usize, const T: usize>(
    ty: GgmlType,
    rows: [&[u8]; R],
    activations: &QuantizedActivations,
    first_blocks: [usize; T],
) -> [[f32; T]; R] {
    // One inlined copy per format, so that each inner loop is compiled for its constant format.
    match ty {
        GgmlType::Q4_K => dot_rows(GgmlType::Q4_K, rows, activations, first_blocks),
        GgmlType::Q5_K => dot_rows(GgmlType::Q5_K, rows, activations, first_blocks),
        GgmlType::Q6_K => dot_rows(GgmlType::Q6_K, rows, activations, first_blocks),
        _ => unreachable!("blocks of 32 take eight_rows.rs"),
    }
}

#[inline(always)]
unsafe fn dot_rows<const R: usize, const T: usize>(
    ty: GgmlType,
    rows: [&[u8]; R],
    activations: &QuantizedActivations,
    first_blocks: [usize; T],
) -> [[f32; T]; R] {
    let (block_len, block_bytes) = (ty.block_len(), ty.block_bytes());
    let num_blocks = rows[0].len() / block_bytes;
    assert!(rows.iter().all(|row| row.len() == num_blocks * block_bytes));
    for first in first_blocks {
        assert!(
            activations.scales.len() >= first + num_blocks
                && activations.quants.len() >= (first + num_blocks) * block_len
        );
    }
    let mut sums = [[KQuantSums::default(); T]; R];
    for b in 0..num_blocks {
        for r in 0..R {
            let block = rows[r].get_unchecked(b * block_bytes..(b + 1) * block_bytes);
            // The weights PREFETCH_BYTES on (past a short row's end: the rows after it, which the
            // caller reads next), so that they arrive before they are read. A prefetch of an
            // address outside the weights is harmless: it never faults.
            _mm_prefetch::<_MM_HINT_T0>(block.as_ptr().wrapping_add(PREFETCH_BYTES) as *const i8);
            let mut lanes = [[_mm256_setzero_si256(); 2]; T];
            for chunk in 0..block_len / 32 {
                let (q, scales) = weight_chunk(ty, block, chunk);
                for (t, lanes) in lanes.iter_mut().enumerate() {
                    let x = _mm256_loadu_si256(
                        activations.quants.as_ptr().add((first_blocks[t] + b) * block_len + 32 * chunk)
                            as *const __m256i,
                    );
                    let products = if ty == GgmlType::Q6_K {
                        // (q - 32) * x as q * x - 32 * x: each maddubs pair fits int16, so does
                        // the difference.
                        _mm256_sub_epi16(_mm256_maddubs_epi16(q, x), _mm256_maddubs_epi16(_mm256_set1_epi8(32), x))
                    } else {
                        _mm256_maddubs_epi16(q, x)
                    };
                    let lanes = &mut lanes[chunk % 2];
                    *lanes = _mm256_add_epi32(*lanes, _mm256_madd_epi16(products, scales));
                }
            }
            // (d, and dmin where the format has one; Q6_K's d is its last two bytes)
            let (weight_scale, weight_min) =
                if ty == GgmlType::Q6_K { (half_pair(block, 206).1, 0.0) } else { half_pair(block, 0) };
            let mins_of_block =
                ty.has_mins().then(|| std::array::from_fn::<i32, 8, _>(|j| q4_k_scale_min(j, &block[4..16]).1 as i32));
            for t in 0..T {
                let a = first_blocks[t] + b;
                let act_scale = *activations.scales.get_unchecked(a);
                if let Some(block_mins) = mins_of_block {
                    let sums_of_16 = activations.sums_of_16.get_unchecked(16 * a..16 * (a + 1));
                    let integer: i32 = (0..16).map(|j| sums_of_16[j] * block_mins[j / 2]).sum();
                    sums[r][t].mins = (weight_min * act_scale).mul_add(integer as f32, sums[r][t].mins);
                }
                let total = total_of(_mm256_add_epi32(lanes[t][0], lanes[t][1]));
                sums[r][t].acc = (weight_scale * act_scale).mul_add(total as f32, sums[r][t].acc);
            }
        }
    }
    sums.map(|row| row.map(|sums| sums.finish(ty)))
}

/// The sum of the eight int32 lanes (exact).
#[inline(always)]
unsafe fn total_of(lanes: __m256i) -> i32 {
    let four = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256::<1>(lanes));
    let two = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
    _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32::<1>(two)))
}

/// Weights `32 * chunk..32 * chunk + 32` of a block in element order (unsigned), and the int16
/// scale of each pair of them.
#[inline(always)]
unsafe fn weight_chunk(ty: GgmlType, block: &[u8], chunk: usize) -> (__m256i, __m256i) {
    let low_nibbles = _mm256_set1_epi8(0xf);
    let at = |offset: usize| block.as_ptr().add(offset);
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let quants = if ty == GgmlType::Q5_K { 48 } else { 16 };
            let packed = _mm256_loadu_si256(at(quants + 32 * (chunk / 2)) as *const __m256i);
            let q = if chunk.is_multiple_of(2) { packed } else { _mm256_srli_epi16(packed, 4) };
            let mut q = _mm256_and_si256(q, low_nibbles);
            if ty == GgmlType::Q5_K {
                // Bit `chunk` of each high-bits byte, to bit 4.
                let high = _mm256_loadu_si256(at(16) as *const __m256i);
                let high =
                    _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(chunk as i32)), _mm256_set1_epi8(1));
                q = _mm256_or_si256(q, _mm256_slli_epi16(high, 4));
            }
            let scale = q4_k_scale_min(chunk, &block[4..16]).0 as i16;
            (q, _mm256_set1_epi16(scale))
        }
        GgmlType::Q6_K => {
            let (half_block, quarter) = (chunk / 4, chunk % 4);
            let low = _mm256_loadu_si256(at(64 * half_block + 32 * (quarter % 2)) as *const __m256i);
            let low = if quarter < 2 { low } else { _mm256_srli_epi16(low, 4) };
            let high = _mm256_loadu_si256(at(128 + 32 * half_block) as *const __m256i);
            let high = match quarter {
                0 => high,
                1 => _mm256_srli_epi16(high, 2),
                2 => _mm256_srli_epi16(high, 4),
                _ => _mm256_srli_epi16(high, 6),
            };
            let high = _mm256_and_si256(high, _mm256_set1_epi8(3));
            let q = _mm256_or_si256(_mm256_and_si256(low, low_nibbles), _mm256_slli_epi16(high, 4));
            // int16 lanes 0-7 hold elements 0-15 (scale 2 * chunk), lanes 8-15 elements 16-31.
            let scale = |i: usize| _mm_set1_epi16(block[192 + 2 * chunk + i] as i8 as i16);
            (q, _mm256_set_m128i(scale(1), scale(0)))
        }
        _ => unreachable!("blocks of 32 take eight_rows.rs"),
    }
}

/// The two little-endian f16 at `block[offset..offset + 4]`, widened by F16C (exact, as
/// `formats::f16_to_f32`). In assembly because the compiler, seeing one lane used, narrows the
/// load to an insert into whatever register is at hand (the running sum), which makes every
/// block wait for the previous block's sum: half the speed at one token. `vmovd` writes the
/// whole register, so nothing waits.
#[inline(always)]
unsafe fn half_pair(block: &[u8], offset: usize) -> (f32, f32) {
    debug_assert!(offset + 4 <= block.len());
    let bits = u32::from_le_bytes(block.as_ptr().add(offset).cast::<[u8; 4]>().read_unaligned());
    let wide: __m128;
    std::arch::asm!(
        "vmovd {wide}, {bits:e}",
        "vcvtph2ps {wide}, {wide}",
        bits = in(reg) bits,
        wide = out(xmm_reg) wide,
        options(pure, nomem, nostack, preserves_flags),
    );
    (_mm_cvtss_f32(wide), _mm_cvtss_f32(_mm_movehdup_ps(wide)))
}

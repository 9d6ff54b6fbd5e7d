//! The linear layer over the K-quants (Q4_K, Q6_K) on AVX-512 (BW, VNNI): two weight rows at a
//! time, each block's 6-bit scales unpacked with vector instructions, 64 weights per register.
//! Gives `dot::dot_row_scalar`'s result bit for bit.
//!
//! A register holds 64 consecutive weights of a block (two sub-blocks of 32, unpacked once for
//! every token), `maddubs` pairs them with the token's 8-bit activations, and `vpdpwssd` adds each
//! pair times its sub-block's scale into 16 int32 lanes: lane i holds positions 4i..4i+3 of the
//! 64, so lanes i and i + 8 added are the reference's lane i. Q6_K's -32 offset is taken off as
//! `maddubs(32, x)`, computed once per token and block for both rows.

use std::arch::x86_64::*;
use std::ops::Range;

use super::activations::QuantizedActivations;
use super::dot::Accumulators;
use super::eight_rows::Problem;
use super::formats::GgmlType;

/// Rows read side by side: their sums overlap, and each token's activations are loaded once for both.
const ROWS: usize = 2;
/// Tokens that share one unpacking of the rows' blocks.
const TILE_TOKENS: usize = 4;

/// Writes `out[token * n + row]` (through `write`, bias added) for every token and the rows in `rows`.
///
/// # Safety
/// The CPU runs AVX2, FMA, F16C and AVX-512 F, BW, VL and VNNI; `problem` is consistent (weight
/// holds n rows of blocks_per_row `ty` blocks, activations m rows of as many Q8_K blocks), `ty`
/// is Q4_K or Q6_K, rows lie in 0..n.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn run_rows_k_quants(problem: &Problem, rows: Range<usize>, write: &impl Fn(usize, usize, f32)) {
    // One inlined copy per format, so that each inner loop is compiled for its constant format.
    match problem.ty {
        GgmlType::Q4_K => run_pairs(GgmlType::Q4_K, problem, rows, write),
        GgmlType::Q6_K => run_pairs(GgmlType::Q6_K, problem, rows, write),
        _ => unreachable!("k_quants takes Q4_K and Q6_K"),
    }
}

#[inline(always)]
unsafe fn run_pairs(ty: GgmlType, problem: &Problem, rows: Range<usize>, write: &impl Fn(usize, usize, f32)) {
    let Problem { weight, row_bytes, activations, bias, m, n, blocks_per_row, .. } = *problem;
    assert!(weight.len() == n * row_bytes && rows.end <= n && row_bytes == blocks_per_row * ty.block_bytes());
    assert!(activations.quants.len() >= m * blocks_per_row * 256 && activations.scales.len() >= m * blocks_per_row);
    assert!(ty != GgmlType::Q4_K || activations.sums_of_32.len() >= m * blocks_per_row * 8);
    for first_row in rows.clone().step_by(ROWS) {
        // A last odd row is read twice; its copy is not written.
        let starts: [*const u8; ROWS] =
            std::array::from_fn(|r| weight.as_ptr().add((first_row + r).min(rows.end - 1) * row_bytes));
        let emit = |first_token: usize, sums: &[[f32; TILE_TOKENS]; ROWS], tokens: usize| {
            for (r, sums) in sums.iter().enumerate().take(rows.end - first_row) {
                for (t, &sum) in sums.iter().enumerate().take(tokens) {
                    let row = first_row + r;
                    write(first_token + t, row, sum + bias.map_or(0.0, |bias| bias[row]));
                }
            }
        };
        // While the first tile reads these rows, the next two rows' bytes (contiguous) are
        // prefetched, spread evenly over the blocks, so that they arrive before they are read.
        let next_rows = starts[0].wrapping_add(ROWS * row_bytes);
        let lines_per_block = (ROWS * row_bytes).div_ceil(64 * blocks_per_row);
        let mut token = 0;
        while token < m {
            let prefetch = (next_rows, if token == 0 { lines_per_block } else { 0 });
            let first_blocks = |t: usize| (token + t).min(m - 1) * blocks_per_row;
            let tokens = (m - token).min(TILE_TOKENS);
            let pair = RowPair { ty, starts, num_blocks: blocks_per_row, activations, prefetch };
            let mut sums = [[0f32; TILE_TOKENS]; ROWS];
            match tokens {
                1 => pair.tile::<1>([first_blocks(0)], &mut sums),
                2 => pair.tile::<2>(std::array::from_fn(first_blocks), &mut sums),
                3 => pair.tile::<3>(std::array::from_fn(first_blocks), &mut sums),
                _ => pair.tile::<4>(std::array::from_fn(first_blocks), &mut sums),
            }
            emit(token, &sums, tokens);
            token += tokens;
        }
    }
}

/// `ROWS` weight rows read together, and the next rows' bytes to prefetch meanwhile (from, lines
/// per block).
struct RowPair<'a> {
    ty: GgmlType,
    starts: [*const u8; ROWS],
    num_blocks: usize,
    activations: &'a QuantizedActivations,
    prefetch: (*const u8, usize),
}

impl RowPair<'_> {
    /// The sums (before bias) of the rows for `T` tokens whose activations start at block
    /// `first_blocks[t]`, into `sums[row][token]`.
    #[inline(always)]
    unsafe fn tile<const T: usize>(&self, first_blocks: [usize; T], sums: &mut [[f32; TILE_TOKENS]; ROWS]) {
        let RowPair { ty, starts, num_blocks, activations, prefetch: (prefetch_from, prefetch_lines) } = *self;
        let block_bytes = ty.block_bytes();
        let mut acc = [[_mm256_setzero_ps(); T]; ROWS];
        let mut mins = [[0f32; T]; ROWS];
        let thirty_two = _mm512_set1_epi8(32);
        for b in 0..num_blocks {
            let blocks: [*const u8; ROWS] = std::array::from_fn(|r| starts[r].add(b * block_bytes));
            for line in b * prefetch_lines..(b + 1) * prefetch_lines {
                // (past the weights' end for the last rows: a prefetch never faults)
                _mm_prefetch::<_MM_HINT_T0>(prefetch_from.wrapping_add(64 * line) as *const i8);
            }
            // Each row's scales, as 16 int16 (Q4_K: 8 scales then 8 mins; Q6_K: 16 signed scales).
            let mut scales = [_mm512_setzero_si512(); ROWS];
            for r in 0..ROWS {
                scales[r] = _mm512_castsi256_si512(if ty == GgmlType::Q4_K {
                    q4_k_scales_and_mins(blocks[r])
                } else {
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(blocks[r].add(192) as *const __m128i))
                });
            }
            let mut lanes = [[_mm512_setzero_si512(); T]; ROWS];
            for part in 0..4 {
                let mut weights = [_mm512_setzero_si512(); ROWS];
                let mut part_scales = [_mm512_setzero_si512(); ROWS];
                for r in 0..ROWS {
                    weights[r] = unpack_64(ty, blocks[r], part);
                    part_scales[r] = _mm512_permutexvar_epi16(scale_index(ty, part), scales[r]);
                }
                for t in 0..T {
                    let a = first_blocks[t] + b;
                    let x = _mm512_loadu_si512(activations.quants.as_ptr().add(256 * a + 64 * part) as *const _);
                    let offset = if ty == GgmlType::Q6_K { _mm512_maddubs_epi16(thirty_two, x) } else { x };
                    for r in 0..ROWS {
                        let mut pairs = _mm512_maddubs_epi16(weights[r], x);
                        if ty == GgmlType::Q6_K {
                            // (q - 32) * x as q * x - 32 * x: both pair sums fit int16, so does the difference.
                            pairs = _mm512_sub_epi16(pairs, offset);
                        }
                        lanes[r][t] = _mm512_dpwssd_epi32(lanes[r][t], pairs, part_scales[r]);
                    }
                }
            }
            for r in 0..ROWS {
                let (weight_scale, weight_min) = if ty == GgmlType::Q6_K {
                    (half(blocks[r].add(208)), 0.0)
                } else {
                    (half(blocks[r]), half(blocks[r].add(2)))
                };
                for t in 0..T {
                    let a = first_blocks[t] + b;
                    let act_scale = *activations.scales.get_unchecked(a);
                    if ty == GgmlType::Q4_K {
                        let sums_of_32 = _mm_loadu_si128(activations.sums_of_32.as_ptr().add(8 * a) as *const __m128i);
                        let block_mins = _mm256_extracti128_si256::<1>(_mm512_castsi512_si256(scales[r]));
                        let integer = horizontal_sum(_mm_madd_epi16(block_mins, sums_of_32));
                        mins[r][t] += (weight_min * act_scale) * integer as f32;
                    }
                    let wide = lanes[r][t];
                    let eight = _mm256_add_epi32(_mm512_castsi512_si256(wide), _mm512_extracti64x4_epi64::<1>(wide));
                    let scale = _mm256_set1_ps(weight_scale * act_scale);
                    acc[r][t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(eight), acc[r][t]);
                }
            }
        }
        for r in 0..ROWS {
            for t in 0..T {
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][t]);
                sums[r][t] = Accumulators { lanes, mins: mins[r][t] }.finish(ty);
            }
        }
    }
}

/// Weights `64 * part..64 * part + 64` of a block in element order, unsigned (Q4_K 0..15,
/// Q6_K 0..63).
#[inline(always)]
unsafe fn unpack_64(ty: GgmlType, block: *const u8, part: usize) -> __m512i {
    let low_nibbles = _mm512_set1_epi8(0x0f);
    if ty == GgmlType::Q4_K {
        // 32 bytes hold sub-block 2 * part (low nibbles) and 2 * part + 1 (high nibbles).
        let packed = _mm512_broadcast_i64x4(_mm256_loadu_si256(block.add(16 + 32 * part) as *const __m256i));
        let shifted = _mm512_srlv_epi16(packed, _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4)));
        return _mm512_and_si512(shifted, low_nibbles);
    }
    // Q6_K: each half of 128 has 64 bytes of low bits (their low nibbles elements 0-63, high
    // nibbles 64-127) and 32 of high bits (bits 2i..2i+1 of byte l: element 32i + l).
    let (half, upper) = (part / 2, part % 2 == 1);
    let low_bits = _mm512_loadu_si512(block.add(64 * half) as *const _);
    let low_bits = if upper { _mm512_srli_epi16::<4>(low_bits) } else { low_bits };
    let high_bits = _mm512_broadcast_i64x4(_mm256_loadu_si256(block.add(128 + 32 * half) as *const __m256i));
    // Bits 2i..2i+1 moved to bits 4-5 (i = 0, 1 for the first part of the half, 2, 3 for the second).
    let shift = |low: i16, high: i16| _mm512_inserti64x4::<1>(_mm512_set1_epi16(low), _mm256_set1_epi16(high));
    let high_bits =
        if upper { _mm512_srlv_epi16(high_bits, shift(0, 2)) } else { _mm512_sllv_epi16(high_bits, shift(4, 2)) };
    let high_bits = _mm512_and_si512(high_bits, _mm512_set1_epi8(0x30));
    // (low_bits & 0x0f) | high_bits
    _mm512_ternarylogic_epi32::<0xEC>(low_bits, high_bits, low_nibbles)
}

/// For `_mm512_permutexvar_epi16`: which of the 16 int16 scales each int16 pair of a part's
/// `maddubs` takes. Q4_K: sub-blocks of 32 (2 * part, 2 * part + 1); Q6_K: of 16 (4 * part ..).
#[inline(always)]
unsafe fn scale_index(ty: GgmlType, part: usize) -> __m512i {
    let per_scale = if ty == GgmlType::Q4_K { 16 } else { 8 };
    let first = (part * 32 / per_scale) as i16;
    let index: [i16; 32] = std::array::from_fn(|w| first + (w / per_scale) as i16);
    _mm512_loadu_si512(index.as_ptr() as *const _)
}

/// Q4_K's eight 6-bit scales then eight mins (ggml's get_scale_min_k4 for all sub-blocks at once),
/// widened to int16.
#[inline(always)]
unsafe fn q4_k_scales_and_mins(block: *const u8) -> __m256i {
    // Bytes 0-3: scales 0-3 (low 6 bits), 4-7: mins 0-3, 8-11: low nibbles scales 4-7, high mins 4-7;
    // the top two bits of bytes 0-3 and 4-7 are the high bits of scales and mins 4-7.
    let bytes = block.add(4);
    let word = |i: usize| (bytes.add(4 * i) as *const u32).read_unaligned();
    let (w0, w1, w2) = (word(0), word(1), word(2));
    const SIX_BITS: u32 = 0x3f3f_3f3f;
    const LOW_NIBBLES: u32 = 0x0f0f_0f0f;
    const TWO_BITS: u32 = 0x0303_0303;
    let scales_0_3 = w0 & SIX_BITS;
    let mins_0_3 = w1 & SIX_BITS;
    let scales_4_7 = (w2 & LOW_NIBBLES) | (((w0 >> 6) & TWO_BITS) << 4);
    let mins_4_7 = ((w2 >> 4) & LOW_NIBBLES) | (((w1 >> 6) & TWO_BITS) << 4);
    let packed = _mm_setr_epi32(scales_0_3 as i32, scales_4_7 as i32, mins_0_3 as i32, mins_4_7 as i32);
    _mm256_cvtepu8_epi16(packed)
}

/// The f16 at `at`, widened (exact).
#[inline(always)]
unsafe fn half(at: *const u8) -> f32 {
    let bits = (at as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// The exact sum of four int32 lanes.
#[inline(always)]
unsafe fn horizontal_sum(v: __m128i) -> i32 {
    let v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01>(v));
    _mm_cvtsi128_si32(v)
}

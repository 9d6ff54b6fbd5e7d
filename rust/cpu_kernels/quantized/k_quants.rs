//! The linear layer over the K-quants (Q4_K, Q5_K, Q6_K) on AVX-512 (BW, VNNI) for a few tokens (decode
//! steps): two weight rows at a time, each block's 6-bit scales unpacked with vector instructions,
//! 64 weights per register. Gives `dot::dot_row_scalar`'s result bit for bit. (Q4_K for more
//! tokens: k_quant_tiles.rs.)
//!
//! A register holds 64 consecutive weights of a block (two sub-blocks of 32, unpacked once for
//! every token); `dpbusd` sums four products per int32 lane, the two halves' sums (each fits
//! int16) share one register and one `vpdpwssd` multiplies each by its sub-block's scale. The 16
//! lanes then add up to the block's exact integer total, which the reference scales once. Q6_K's
//! -32 offset is taken off as `dpbusd(32, x)`, computed once per token and block for both rows;
//! Q4_K's mins term is summed for four tokens at once.

use std::arch::x86_64::*;
use std::ops::Range;

use super::activations::QuantizedActivations;
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
/// is a K-quant, rows lie in 0..n.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn run_rows_k_quants(problem: &Problem, rows: Range<usize>, write: &impl Fn(usize, usize, f32)) {
    // One inlined copy per format, so that each inner loop is compiled for its constant format.
    match problem.ty {
        GgmlType::Q4_K => run_pairs(GgmlType::Q4_K, problem, rows, write),
        GgmlType::Q5_K => run_pairs(GgmlType::Q5_K, problem, rows, write),
        GgmlType::Q6_K => run_pairs(GgmlType::Q6_K, problem, rows, write),
        _ => unreachable!("k_quants takes the K-quants"),
    }
}

#[inline(always)]
unsafe fn run_pairs(ty: GgmlType, problem: &Problem, rows: Range<usize>, write: &impl Fn(usize, usize, f32)) {
    let Problem { weight, row_bytes, activations, bias, first_token, m, n, blocks_per_row, .. } = *problem;
    assert!(first_token < m);
    assert!(weight.len() == n * row_bytes && rows.end <= n && row_bytes == blocks_per_row * ty.block_bytes());
    assert!(activations.quants.len() >= m * blocks_per_row * 256 && activations.scales.len() >= m * blocks_per_row);
    assert!(!ty.has_mins() || activations.sums_of_32.len() >= m * blocks_per_row * 8);
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
        let mut token = first_token;
        while token < m {
            let prefetch = (next_rows, if token == first_token { lines_per_block } else { 0 });
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
        // Per row, token t's sums in lane t: the blocks' scaled totals, and Q4_K's mins terms.
        let mut acc = [_mm_setzero_ps(); ROWS];
        let mut mins = [_mm_setzero_ps(); ROWS];
        let thirty_two = _mm512_set1_epi8(32);
        let zero = _mm512_setzero_si512();
        let low_halves = _mm512_set1_epi32(0xffff);
        for b in 0..num_blocks {
            let blocks: [*const u8; ROWS] = std::array::from_fn(|r| starts[r].add(b * block_bytes));
            for line in b * prefetch_lines..(b + 1) * prefetch_lines {
                // (past the weights' end for the last rows: a prefetch never faults)
                _mm_prefetch::<_MM_HINT_T0>(prefetch_from.wrapping_add(64 * line) as *const i8);
            }
            // Each row's scales, as 16 int16 (Q4_K: 8 scales then 8 mins; Q6_K: 16 signed scales).
            let mut scales = [_mm512_setzero_si512(); ROWS];
            for r in 0..ROWS {
                scales[r] = _mm512_castsi256_si512(if ty.has_mins() {
                    q4_k_scales_and_mins(blocks[r])
                } else {
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(blocks[r].add(192) as *const __m128i))
                });
            }
            // (lanes past T stay zero: their totals are never read)
            let mut lanes = [[_mm512_setzero_si512(); TILE_TOKENS]; ROWS];
            for pair in 0..2 {
                // (Loops, not closures: a closure is compiled without this function's target
                // features, so the intrinsics in it would become calls.)
                let mut weights = [[zero; 2]; ROWS];
                let mut pair_scales = [zero; ROWS];
                for r in 0..ROWS {
                    for (i, weight) in weights[r].iter_mut().enumerate() {
                        *weight = unpack_64(ty, blocks[r], 2 * pair + i);
                    }
                    pair_scales[r] = _mm512_permutexvar_epi16(scale_index(ty, pair), scales[r]);
                }
                for t in 0..T {
                    let a = first_blocks[t] + b;
                    let (mut x, mut start) = ([zero; 2], [zero; 2]);
                    for i in 0..2 {
                        x[i] = _mm512_loadu_si512(
                            activations.quants.as_ptr().add(256 * a + 64 * (2 * pair + i)) as *const _
                        );
                        if ty == GgmlType::Q6_K {
                            // (q - 32) * x: dpbusd sums q * x onto -32 * x.
                            start[i] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, thirty_two, x[i]));
                        }
                    }
                    for r in 0..ROWS {
                        // Each lane's sum of four products fits int16 (|sum| <= 4 * 32 * 127): the two
                        // parts' sums go side by side into one lane, and one dpwssd scales and adds both.
                        let even = _mm512_dpbusd_epi32(start[0], weights[r][0], x[0]);
                        let odd = _mm512_dpbusd_epi32(start[1], weights[r][1], x[1]);
                        let both = _mm512_ternarylogic_epi32::<0xD8>(_mm512_slli_epi32::<16>(odd), even, low_halves);
                        lanes[r][t] = _mm512_dpwssd_epi32(lanes[r][t], both, pair_scales[r]);
                    }
                }
            }
            let mut act_scales = [0f32; TILE_TOKENS];
            for t in 0..T {
                act_scales[t] = *activations.scales.get_unchecked(first_blocks[t] + b);
            }
            let act_scales = _mm_loadu_ps(act_scales.as_ptr());
            for r in 0..ROWS {
                let (weight_scale, weight_min) = if ty == GgmlType::Q6_K {
                    (half(blocks[r].add(208)), 0.0)
                } else {
                    (half(blocks[r]), half(blocks[r].add(2)))
                };
                if ty.has_mins() {
                    // Each token's sum of min * (sum of its 32 activations), exact, in lane t.
                    let block_mins = _mm256_extracti128_si256::<1>(_mm512_castsi512_si256(scales[r]));
                    let mut products = [_mm_setzero_si128(); 4];
                    for t in 0..T {
                        let sums_of_32 = activations.sums_of_32.as_ptr().add(8 * (first_blocks[t] + b));
                        products[t] = _mm_madd_epi16(block_mins, _mm_loadu_si128(sums_of_32 as *const __m128i));
                    }
                    let totals = _mm_hadd_epi32(
                        _mm_hadd_epi32(products[0], products[1]),
                        _mm_hadd_epi32(products[2], products[3]),
                    );
                    let scale = _mm_mul_ps(_mm_set1_ps(weight_min), act_scales);
                    mins[r] = _mm_fmadd_ps(scale, _mm_cvtepi32_ps(totals), mins[r]);
                }
                let scale = _mm_mul_ps(_mm_set1_ps(weight_scale), act_scales);
                acc[r] = _mm_fmadd_ps(scale, _mm_cvtepi32_ps(totals_of_four(lanes[r])), acc[r]);
            }
        }
        for r in 0..ROWS {
            let result = if ty.has_mins() { _mm_sub_ps(acc[r], mins[r]) } else { acc[r] };
            let mut tokens = [0f32; 4];
            _mm_storeu_ps(tokens.as_mut_ptr(), result);
            sums[r][..T].copy_from_slice(&tokens[..T]);
        }
    }
}

/// The sum of each register's 16 int32 lanes, register t's in lane t (exact).
#[inline(always)]
unsafe fn totals_of_four(lanes: [__m512i; 4]) -> __m128i {
    let mut halves = [_mm256_setzero_si256(); 4];
    for (half, &lane) in halves.iter_mut().zip(&lanes) {
        *half = _mm256_add_epi32(_mm512_castsi512_si256(lane), _mm512_extracti64x4_epi64::<1>(lane));
    }
    // Each 128-bit half: the four registers' sums of that half's lanes.
    let quarters = _mm256_hadd_epi32(_mm256_hadd_epi32(halves[0], halves[1]), _mm256_hadd_epi32(halves[2], halves[3]));
    _mm_add_epi32(_mm256_castsi256_si128(quarters), _mm256_extracti128_si256::<1>(quarters))
}

/// Weights `64 * part..64 * part + 64` of a block in element order, unsigned (Q4_K 0..15,
/// Q5_K 0..31, Q6_K 0..63).
#[inline(always)]
unsafe fn unpack_64(ty: GgmlType, block: *const u8, part: usize) -> __m512i {
    let low_nibbles = _mm512_set1_epi8(0x0f);
    if ty.has_mins() {
        // 32 bytes hold sub-block 2 * part (low nibbles) and 2 * part + 1 (high nibbles); Q5_K's
        // fifth bits are bit 2 * part (and 2 * part + 1) of the 32 bytes before its nibbles.
        let quants = if ty == GgmlType::Q5_K { 48 } else { 16 };
        let packed = _mm512_broadcast_i64x4(_mm256_loadu_si256(block.add(quants + 32 * part) as *const __m256i));
        let shifted = _mm512_srlv_epi16(packed, _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4)));
        let low = _mm512_and_si512(shifted, low_nibbles);
        if ty == GgmlType::Q4_K {
            return low;
        }
        let high_bits = _mm512_broadcast_i64x4(_mm256_loadu_si256(block.add(16) as *const __m256i));
        let shift = _mm512_inserti64x4::<1>(_mm512_set1_epi16(2 * part as i16), _mm256_set1_epi16(2 * part as i16 + 1));
        let high = _mm512_and_si512(_mm512_srlv_epi16(high_bits, shift), _mm512_set1_epi8(1));
        return _mm512_or_si512(low, _mm512_slli_epi16::<4>(high));
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

/// For `_mm512_permutexvar_epi16`: the scales of parts 2 * pair (even int16) and 2 * pair + 1
/// (odd) for each int32 lane i (elements 4i..4i+3 of a part): Q4_K's sub-blocks of 32
/// (2 * part + i / 8), Q6_K's of 16 (4 * part + i / 4).
#[inline(always)]
unsafe fn scale_index(ty: GgmlType, pair: usize) -> __m512i {
    const fn table(sub_block_len: usize) -> [[i16; 32]; 2] {
        let mut table = [[0i16; 32]; 2];
        let mut w = 0;
        while w < 64 {
            let (pair, lane, odd) = (w / 32, (w % 32) / 2, w % 2);
            let element = 64 * (2 * pair + odd) + 4 * lane;
            table[pair][w % 32] = (element / sub_block_len) as i16;
            w += 1;
        }
        table
    }
    static Q4_K: [[i16; 32]; 2] = table(32);
    static Q6_K: [[i16; 32]; 2] = table(16);
    let index = if ty == GgmlType::Q6_K { &Q6_K[pair] } else { &Q4_K[pair] };
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

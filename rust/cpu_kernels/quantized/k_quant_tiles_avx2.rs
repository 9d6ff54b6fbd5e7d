//! k_quant_tiles.rs on AVX2 (no VNNI): eight weight rows interleaved, one per int32 lane of a
//! 256-bit register, their values unpacked to bytes while interleaving. `maddubs` sums two
//! products of each row per int16 half-lane against a token's four activations broadcast to every
//! lane; as many of those as fit int16 (Q4_K 8, Q5_K 4, Q6_K 2) add up before one `madd` by the
//! sub-block's scale (held twice per lane) widens them, scaled, to int32. The same integer totals
//! and float order as dot.rs: `dot::dot_row_scalar`'s result bit for bit.

use std::arch::x86_64::*;
use std::ops::Range;

use super::activations::QuantizedActivations;
use super::eight_rows::Problem;
use super::formats::GgmlType;
use super::k_quant_tiles::{check_problem, for_token_tiles};

/// Rows interleaved: one per int32 lane of a 256-bit register.
pub(crate) const GROUP_ROWS: usize = 8;
/// Tokens that share each load of the interleaved values (AVX2 has 16 registers).
const TILE_TOKENS: usize = 2;

/// One block of eight rows, as the tiles read it.
#[repr(C, align(32))]
#[derive(Clone, Copy)]
struct Block {
    /// Register g: lane r holds row r's values (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 before its -32
    /// offset) of elements 4g..4g + 4.
    values: [[u32; GROUP_ROWS]; 64],
    /// `[sub-block][row]`: the sub-block's scale in both int16 halves (Q6_K: 16 sub-blocks of 16).
    scales: [[u32; GROUP_ROWS]; 16],
    /// `[pair][row]`, int16 pairs for sub-blocks 2 * pair and 2 * pair + 1: Q4_K's and Q5_K's mins
    /// (4 pairs), Q6_K's scales (8).
    pairs: [[u32; GROUP_ROWS]; 8],
    d: [f32; GROUP_ROWS],
    dmin: [f32; GROUP_ROWS],
}

/// Writes `out[token * n + row]` (through `write`, bias added) for the problem's tokens and the
/// rows in `rows`, a whole number of groups.
///
/// # Safety
/// The CPU runs AVX2, FMA and F16C; `problem` is consistent (weight holds n rows of blocks_per_row
/// `ty` blocks, activations m rows of as many Q8_K blocks), `ty` is a K-quant, rows lie in 0..n and
/// their count is a multiple of `GROUP_ROWS`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn run_groups_avx2(problem: &Problem, rows: Range<usize>, write: &impl Fn(usize, usize, f32)) {
    let Problem { ty, weight, row_bytes, activations, blocks_per_row, .. } = *problem;
    check_problem(problem, &rows, GROUP_ROWS);
    let mut blocks = vec![std::mem::zeroed::<Block>(); blocks_per_row];
    for first_row in rows.step_by(GROUP_ROWS) {
        interleave(ty, weight.as_ptr().add(first_row * row_bytes), row_bytes, &mut blocks);
        for_token_tiles(problem, first_row, write, |first_blocks: [usize; TILE_TOKENS], tokens, sums| {
            match (ty, tokens) {
                (GgmlType::Q4_K, 1) => tile::<1, 8>(ty, &blocks, activations, [first_blocks[0]], sums),
                (GgmlType::Q4_K, _) => tile::<2, 8>(ty, &blocks, activations, first_blocks, sums),
                (GgmlType::Q5_K, 1) => tile::<1, 4>(ty, &blocks, activations, [first_blocks[0]], sums),
                (GgmlType::Q5_K, _) => tile::<2, 4>(ty, &blocks, activations, first_blocks, sums),
                (_, 1) => tile::<1, 2>(ty, &blocks, activations, [first_blocks[0]], sums),
                (_, _) => tile::<2, 2>(ty, &blocks, activations, first_blocks, sums),
            }
        });
    }
}

/// `words[w]` lane r = `rows[r]` lane w.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn transpose_8x8(rows: [__m256i; 8]) -> [__m256i; 8] {
    let mut pairs = [_mm256_setzero_si256(); 8];
    for i in 0..4 {
        pairs[2 * i] = _mm256_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
        pairs[2 * i + 1] = _mm256_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
    }
    // quads[4i + j], 128-bit half h: rows 4i..4i + 4 of word 4h + j.
    let mut quads = [_mm256_setzero_si256(); 8];
    for i in 0..2 {
        quads[4 * i] = _mm256_unpacklo_epi64(pairs[4 * i], pairs[4 * i + 2]);
        quads[4 * i + 1] = _mm256_unpackhi_epi64(pairs[4 * i], pairs[4 * i + 2]);
        quads[4 * i + 2] = _mm256_unpacklo_epi64(pairs[4 * i + 1], pairs[4 * i + 3]);
        quads[4 * i + 3] = _mm256_unpackhi_epi64(pairs[4 * i + 1], pairs[4 * i + 3]);
    }
    let mut words = [_mm256_setzero_si256(); 8];
    for j in 0..4 {
        words[j] = _mm256_permute2x128_si256::<0x20>(quads[j], quads[4 + j]);
        words[4 + j] = _mm256_permute2x128_si256::<0x31>(quads[j], quads[4 + j]);
    }
    words
}

/// Eight rows of 32 bytes at `at` (+ r * row_bytes), transposed: `words[w]` lane r = row r's word w.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn load_transposed(at: *const u8, row_bytes: usize) -> [__m256i; 8] {
    let mut rows = [_mm256_setzero_si256(); GROUP_ROWS];
    for (r, row) in rows.iter_mut().enumerate() {
        *row = _mm256_loadu_si256(at.add(r * row_bytes) as *const __m256i);
    }
    transpose_8x8(rows)
}

/// Byte `i` of each int32 lane.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn byte(words: __m256i, i: i32) -> __m256i {
    _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_set1_epi32(8 * i)), _mm256_set1_epi32(0xff))
}

/// Eight rows (from `first`, `row_bytes` apart) of `ty` blocks into `blocks`, one per block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn interleave(ty: GgmlType, first: *const u8, row_bytes: usize, blocks: &mut [Block]) {
    let offsets = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(row_bytes as i32));
    let gather = |at: *const u8| _mm256_i32gather_epi32::<1>(at as *const i32, offsets);
    let (low_nibbles, low_bits) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x03));
    let block_bytes = ty.block_bytes();
    let store = |register: &mut [u32; GROUP_ROWS], value: __m256i| {
        _mm256_store_si256(register.as_mut_ptr() as *mut __m256i, value)
    };
    for (b, block) in blocks.iter_mut().enumerate() {
        let at = first.add(b * block_bytes);
        // The next group's rows (contiguous, after these), this block's share: they have arrived
        // when that group is interleaved. (A prefetch past the weights' end never faults.)
        let next = first.wrapping_add(GROUP_ROWS * row_bytes + b * block_bytes);
        for r in 0..GROUP_ROWS {
            for line in 0..block_bytes.div_ceil(64) {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(r * row_bytes + 64 * line) as *const i8);
            }
        }
        if ty == GgmlType::Q6_K {
            // 128 bytes of low bits, 64 of top bits (formats::q6_k_value), 16 int8 scales, f16 d.
            let low: [[__m256i; 8]; 4] = std::array::from_fn(|k| load_transposed(at.add(32 * k), row_bytes));
            let high: [[__m256i; 8]; 2] = std::array::from_fn(|h| load_transposed(at.add(128 + 32 * h), row_bytes));
            for half in 0..2 {
                for c in 0..8 {
                    for quarter in 0..4 {
                        let nibbles = low[2 * half + quarter % 2][c];
                        let nibbles = if quarter < 2 { nibbles } else { _mm256_srli_epi16::<4>(nibbles) };
                        let top = _mm256_srlv_epi16_emulated(high[half][c], 2 * quarter as i32);
                        let value = _mm256_or_si256(
                            _mm256_and_si256(nibbles, low_nibbles),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(top, low_bits)),
                        );
                        store(&mut block.values[32 * half + 8 * quarter + c], value);
                    }
                }
            }
            let words: [__m256i; 4] = std::array::from_fn(|i| gather(at.add(192 + 4 * i)));
            let scales: [__m256i; 16] = std::array::from_fn(|j| {
                _mm256_srai_epi32::<24>(_mm256_sllv_epi32(words[j / 4], _mm256_set1_epi32(24 - 8 * (j as i32 % 4))))
            });
            for (register, &scale) in block.scales.iter_mut().zip(&scales) {
                let low_half = _mm256_and_si256(scale, _mm256_set1_epi32(0xffff));
                store(register, _mm256_or_si256(low_half, _mm256_slli_epi32::<16>(scale)));
            }
            for p in 0..8 {
                let low_half = _mm256_and_si256(scales[2 * p], _mm256_set1_epi32(0xffff));
                store(&mut block.pairs[p], _mm256_or_si256(low_half, _mm256_slli_epi32::<16>(scales[2 * p + 1])));
            }
            let d = _mm256_srli_epi32::<16>(gather(at.add(206)));
            _mm256_store_ps(block.d.as_mut_ptr(), _mm256_cvtph_ps(pack_low_halves(d)));
            continue;
        }
        // Q4_K, Q5_K: f16 d, f16 dmin, 12 bytes of scales and mins, (Q5_K: 32 bytes of fifth
        // bits,) 128 bytes of nibbles: 32 bytes per pair of sub-blocks.
        let quants = if ty == GgmlType::Q5_K { 48 } else { 16 };
        let fifth =
            if ty == GgmlType::Q5_K { load_transposed(at.add(16), row_bytes) } else { [_mm256_setzero_si256(); 8] };
        for pair in 0..4 {
            let words = load_transposed(at.add(quants + 32 * pair), row_bytes);
            for (c, &word) in words.iter().enumerate() {
                for odd in 0..2 {
                    let sub_block = 2 * pair + odd;
                    let nibbles = if odd == 0 { word } else { _mm256_srli_epi16::<4>(word) };
                    let mut value = _mm256_and_si256(nibbles, low_nibbles);
                    if ty == GgmlType::Q5_K {
                        let bit = _mm256_and_si256(
                            _mm256_srlv_epi32(fifth[c], _mm256_set1_epi32(sub_block as i32)),
                            _mm256_set1_epi8(1),
                        );
                        value = _mm256_or_si256(value, _mm256_slli_epi16::<4>(bit));
                    }
                    store(&mut block.values[8 * sub_block + c], value);
                }
            }
        }
        // (ggml's get_scale_min_k4 for eight rows at once: see k_quants.rs)
        let (w0, w1, w2) = (gather(at.add(4)), gather(at.add(8)), gather(at.add(12)));
        let six_bits = _mm256_set1_epi32(0x3f3f_3f3f);
        let nibble_mask = _mm256_set1_epi32(0x0f0f_0f0f);
        let two_bits = _mm256_set1_epi32(0x0303_0303);
        let high_pairs =
            |word: __m256i| _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(word), two_bits));
        let scales =
            [_mm256_and_si256(w0, six_bits), _mm256_or_si256(_mm256_and_si256(w2, nibble_mask), high_pairs(w0))];
        let mins = [
            _mm256_and_si256(w1, six_bits),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32::<4>(w2), nibble_mask), high_pairs(w1)),
        ];
        for j in 0..8 {
            let scale = byte(scales[j / 4], j as i32 % 4);
            store(&mut block.scales[j], _mm256_or_si256(scale, _mm256_slli_epi32::<16>(scale)));
        }
        for p in 0..4 {
            let (low, high) = (byte(mins[p / 2], 2 * (p as i32 % 2)), byte(mins[p / 2], 2 * (p as i32 % 2) + 1));
            store(&mut block.pairs[p], _mm256_or_si256(low, _mm256_slli_epi32::<16>(high)));
        }
        let halves = gather(at);
        _mm256_store_ps(block.d.as_mut_ptr(), _mm256_cvtph_ps(pack_low_halves(halves)));
        _mm256_store_ps(block.dmin.as_mut_ptr(), _mm256_cvtph_ps(pack_low_halves(_mm256_srli_epi32::<16>(halves))));
    }
}

/// Each int32 lane shifted right by `shift` within its 16-bit halves (AVX2 has no variable
/// 16-bit shift; every lane here shifts alike).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn _mm256_srlv_epi16_emulated(words: __m256i, shift: i32) -> __m256i {
    _mm256_srl_epi16(words, _mm_cvtsi32_si128(shift))
}

/// The low int16 of each int32 lane, packed into 8 int16.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn pack_low_halves(words: __m256i) -> __m128i {
    let low = _mm256_and_si256(words, _mm256_set1_epi32(0xffff));
    let packed = _mm256_packus_epi32(low, low); // per 128-bit half: 4 lanes, twice
    _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(packed))
}

/// The eight rows' sums for `T` tokens whose activations start at block `first_blocks[t]`, into
/// `sums[token][row]`; `K`: the maddubs results an int16 takes before the scale widens them.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile<const T: usize, const K: usize>(
    ty: GgmlType,
    blocks: &[Block],
    activations: &QuantizedActivations,
    first_blocks: [usize; T],
    sums: &mut [[f32; GROUP_ROWS]; TILE_TOKENS],
) {
    // Q4_K, Q5_K: 8 sub-blocks of 32 (8 registers each); Q6_K: 16 of 16 (4 each).
    let (sub_blocks, registers) = if ty == GgmlType::Q6_K { (16, 4) } else { (8, 8) };
    let mut acc = [_mm256_setzero_ps(); T];
    let mut mins = [_mm256_setzero_ps(); T];
    let quants = activations.quants.as_ptr();
    for (b, block) in blocks.iter().enumerate() {
        let mut totals = [_mm256_setzero_si256(); T];
        for j in 0..sub_blocks {
            let scale = _mm256_load_si256(block.scales[j].as_ptr() as *const __m256i);
            for first in (0..registers).step_by(K) {
                let mut partial = [_mm256_setzero_si256(); T];
                for g in registers * j + first..registers * j + first + K {
                    let values = _mm256_load_si256(block.values[g].as_ptr() as *const __m256i);
                    for t in 0..T {
                        let x = quants.add(256 * (first_blocks[t] + b) + 4 * g);
                        let x = _mm256_set1_epi32((x as *const i32).read_unaligned());
                        partial[t] = _mm256_add_epi16(partial[t], _mm256_maddubs_epi16(values, x));
                    }
                }
                for t in 0..T {
                    totals[t] = _mm256_add_epi32(totals[t], _mm256_madd_epi16(partial[t], scale));
                }
            }
        }
        let d = _mm256_load_ps(block.d.as_ptr());
        for t in 0..T {
            let a = first_blocks[t] + b;
            let act_scale = _mm256_set1_ps(*activations.scales.get_unchecked(a));
            // Q6_K: Σ scale * (sum of the 16's activations), taken 32 times off; Q4_K, Q5_K:
            // Σ min * (sum of the 32's activations), the mins term. Exact, as int16 pairs.
            let (sums_of, pairs) = if ty == GgmlType::Q6_K {
                let sums_of_16 = activations.sums_of_16.as_ptr().add(16 * a);
                let mut packed = [0u32; 8];
                for (p, pair) in packed.iter_mut().enumerate() {
                    *pair = (*sums_of_16.add(2 * p) as u32 & 0xffff) | ((*sums_of_16.add(2 * p + 1) as u32) << 16);
                }
                (packed, 8)
            } else {
                let sums_of_32 = activations.sums_of_32.as_ptr().add(8 * a) as *const u32;
                (std::array::from_fn(|p| if p < 4 { sums_of_32.add(p).read_unaligned() } else { 0 }), 4)
            };
            let mut pair_total = _mm256_setzero_si256();
            for (weights, &sums) in block.pairs.iter().zip(&sums_of).take(pairs) {
                let weights = _mm256_load_si256(weights.as_ptr() as *const __m256i);
                pair_total = _mm256_add_epi32(pair_total, _mm256_madd_epi16(weights, _mm256_set1_epi32(sums as i32)));
            }
            if ty == GgmlType::Q6_K {
                let total = _mm256_sub_epi32(totals[t], _mm256_slli_epi32::<5>(pair_total));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, act_scale), _mm256_cvtepi32_ps(total), acc[t]);
            } else {
                let dmin = _mm256_load_ps(block.dmin.as_ptr());
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, act_scale), _mm256_cvtepi32_ps(totals[t]), acc[t]);
                mins[t] = _mm256_fmadd_ps(_mm256_mul_ps(dmin, act_scale), _mm256_cvtepi32_ps(pair_total), mins[t]);
            }
        }
    }
    for t in 0..T {
        let result = if ty.has_mins() { _mm256_sub_ps(acc[t], mins[t]) } else { acc[t] };
        _mm256_storeu_ps(sums[t].as_mut_ptr(), result);
    }
}

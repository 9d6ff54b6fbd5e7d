//! The K-quants' linear layer for several tokens (prefill, batches of decodes) on AVX-512 VNNI:
//! sixteen weight rows interleaved, one row per int32 lane, so that `dpbusd` against a token's
//! four activations broadcast to every lane sums four products of each row, and a sub-block's
//! weights end in one lane. A sub-block's total is then scaled by one `vpmulld` for all sixteen
//! rows, where the two-row kernel (k_quants.rs) spends a `vpdpwssd` and two packing instructions
//! per 128 weights and row, and the block's float work is one multiply-add for sixteen rows.
//!
//! The interleaving is done here, per group of rows and pass over the tokens, into a buffer that
//! stays in the core's L2 (llama.cpp repacks its weights once, at load; this keeps the GGUF's
//! layout, which the decode kernel and everything else read): the rows' bytes transposed in
//! registers (Q5_K's and Q6_K's values unpacked to bytes there, Q4_K's nibbles by the tiles), read
//! back by every token of the pass, while the next group's rows are prefetched. Gives
//! `dot::dot_row_scalar`'s result bit for bit. (On AVX2: k_quant_tiles_avx2.rs.)

use std::arch::x86_64::*;
use std::ops::Range;

use super::activations::QuantizedActivations;
use super::eight_rows::Problem;
use super::formats::GgmlType;

/// Rows interleaved: one per int32 lane of a 512-bit register.
pub(crate) const GROUP_ROWS: usize = 16;
/// Tokens that share each load of the interleaved weights.
const TILE_TOKENS: usize = 4;

/// One Q4_K or Q5_K block of sixteen rows, as the tiles read it.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct BlockWithMins {
    /// Q5_K: register g, lane r holds row r's values (0..31) of elements 4g..4g + 4 (sub-block j
    /// of 32 is registers 8j..8j + 8). Q4_K, the first 32: register 8 * pair + c, lane r holds
    /// bytes 4c..4c + 4 of row r's 32 bytes of sub-blocks 2 * pair (low nibbles) and 2 * pair + 1
    /// (high nibbles), unpacked by the tiles (unpacking here cost more than it saved there).
    values: [[u32; GROUP_ROWS]; 64],
    /// `[sub-block][row]`: the 6-bit scales.
    scales: [[i32; GROUP_ROWS]; 8],
    /// `[pair][row]`: the mins of sub-blocks 2 * pair (low int16) and 2 * pair + 1 (high).
    min_pairs: [[u32; GROUP_ROWS]; 4],
    d: [f32; GROUP_ROWS],
    dmin: [f32; GROUP_ROWS],
}

/// One Q6_K block of sixteen rows, as the tiles read it.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Q6kBlock {
    /// Register g: lane r holds row r's 6-bit values (before the -32 offset) of elements
    /// 4g..4g + 4; sub-block j (of 16) is registers 4j..4j + 4.
    values: [[u32; GROUP_ROWS]; 64],
    /// `[sub-block][row]`: the int8 scales.
    scales: [[i32; GROUP_ROWS]; 16],
    /// `[pair][row]`: the scales of sub-blocks 2 * pair (low int16) and 2 * pair + 1 (high).
    scale_pairs: [[u32; GROUP_ROWS]; 8],
    d: [f32; GROUP_ROWS],
}

/// A group's blocks, interleaved.
enum Interleaved {
    WithMins(Vec<BlockWithMins>),
    Q6k(Vec<Q6kBlock>),
}

/// Writes `out[token * n + row]` (through `write`, bias added) for the problem's tokens and the
/// rows in `rows`, a whole number of groups.
///
/// # Safety
/// The CPU runs AVX2, FMA, F16C and AVX-512 F, BW, VL and VNNI; `problem` is consistent (weight
/// holds n rows of blocks_per_row `ty` blocks, activations m rows of as many Q8_K blocks), `ty`
/// is a K-quant, rows lie in 0..n and their count is a multiple of `GROUP_ROWS`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn run_groups(problem: &Problem, rows: Range<usize>, write: &impl Fn(usize, usize, f32)) {
    let Problem { ty, weight, row_bytes, activations, blocks_per_row, .. } = *problem;
    check_problem(problem, &rows, GROUP_ROWS);
    let mut blocks = match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => {
            Interleaved::WithMins(vec![std::mem::zeroed::<BlockWithMins>(); blocks_per_row])
        }
        GgmlType::Q6_K => Interleaved::Q6k(vec![std::mem::zeroed::<Q6kBlock>(); blocks_per_row]),
        _ => unreachable!("k_quant_tiles takes the K-quants"),
    };
    for first_row in rows.step_by(GROUP_ROWS) {
        let first = weight.as_ptr().add(first_row * row_bytes);
        match &mut blocks {
            Interleaved::WithMins(blocks) => interleave_with_mins(ty, first, row_bytes, blocks),
            Interleaved::Q6k(blocks) => interleave_q6_k(first, row_bytes, blocks),
        }
        for_token_tiles(problem, first_row, write, |first_blocks: [usize; TILE_TOKENS], tokens, sums| {
            let first = |t: usize| first_blocks[t];
            match tokens {
                1 => tile::<1>(ty, &blocks, activations, [first(0)], sums),
                2 => tile::<2>(ty, &blocks, activations, std::array::from_fn(first), sums),
                3 => tile::<3>(ty, &blocks, activations, std::array::from_fn(first), sums),
                _ => tile::<4>(ty, &blocks, activations, first_blocks, sums),
            }
        });
    }
}

/// Panics unless `problem` is what the tiles read (either ISA's): weight holds n rows of
/// blocks_per_row K-quant blocks, activations m rows of as many Q8_K blocks with their sums of
/// 16 and 32, `rows` lie in 0..n and are whole groups of `group_rows`.
pub(crate) fn check_problem(problem: &Problem, rows: &Range<usize>, group_rows: usize) {
    let Problem { ty, weight, row_bytes, activations, first_token, m, n, blocks_per_row, .. } = *problem;
    assert!(ty.block_len() == 256 && first_token < m && rows.end <= n && rows.len().is_multiple_of(group_rows));
    assert!(weight.len() == n * row_bytes && row_bytes == blocks_per_row * ty.block_bytes());
    assert!(activations.quants.len() >= m * blocks_per_row * 256 && activations.scales.len() >= m * blocks_per_row);
    assert!(activations.sums_of_32.len() >= m * blocks_per_row * 8);
    assert!(activations.sums_of_16.len() >= m * blocks_per_row * 16);
    // (row_bytes * (group_rows - 1) fits i32: the gathers' offsets)
    assert!(row_bytes < (i32::MAX as usize) / group_rows);
}

/// The problem's tokens in tiles of up to `TILE` for the `ROWS` rows from `first_row`:
/// `tile(first_blocks, tokens, sums)` puts the sums of `tokens` tokens (whose activations start at
/// `first_blocks[t]`; past `tokens`, the last token's again) in `sums[token][row]`, each then
/// written with its row's bias.
#[inline(always)]
pub(crate) fn for_token_tiles<const ROWS: usize, const TILE: usize>(
    problem: &Problem,
    first_row: usize,
    write: &impl Fn(usize, usize, f32),
    mut tile: impl FnMut([usize; TILE], usize, &mut [[f32; ROWS]; TILE]),
) {
    let Problem { bias, first_token, m, blocks_per_row, .. } = *problem;
    let mut token = first_token;
    while token < m {
        let tokens = (m - token).min(TILE);
        let mut sums = [[0f32; ROWS]; TILE];
        tile(std::array::from_fn(|t| (token + t).min(m - 1) * blocks_per_row), tokens, &mut sums);
        for (t, sums) in sums.iter().enumerate().take(tokens) {
            for (r, &sum) in sums.iter().enumerate() {
                let row = first_row + r;
                write(token + t, row, sum + bias.map_or(0.0, |bias| bias[row]));
            }
        }
        token += tokens;
    }
}

/// `tile_with_mins` or `tile_q6_k`, by the blocks' format.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn tile<const T: usize>(
    ty: GgmlType,
    blocks: &Interleaved,
    activations: &QuantizedActivations,
    first_blocks: [usize; T],
    sums: &mut [[f32; GROUP_ROWS]; TILE_TOKENS],
) {
    match blocks {
        Interleaved::WithMins(blocks) if ty == GgmlType::Q4_K => {
            tile_with_mins::<T, true>(blocks, activations, first_blocks, sums)
        }
        Interleaved::WithMins(blocks) => tile_with_mins::<T, false>(blocks, activations, first_blocks, sums),
        Interleaved::Q6k(blocks) => tile_q6_k::<T>(blocks, activations, first_blocks, sums),
    }
}

/// The byte offsets of sixteen rows `row_bytes` apart.
#[target_feature(enable = "avx2,avx512f")]
#[inline]
unsafe fn row_offsets(row_bytes: usize) -> __m512i {
    _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(row_bytes as i32),
    )
}

/// The next group's rows (contiguous, after the sixteen from `first`): block `b`'s share, so
/// that they have arrived when that group is interleaved. (Past the weights' end for the last
/// group: a prefetch never faults.)
#[inline(always)]
unsafe fn prefetch_next_group(first: *const u8, row_bytes: usize, block_bytes: usize, b: usize) {
    let next = first.wrapping_add(GROUP_ROWS * row_bytes + b * block_bytes);
    for r in 0..GROUP_ROWS {
        for line in 0..block_bytes.div_ceil(64) {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(r * row_bytes + 64 * line) as *const i8);
        }
    }
}

/// Sixteen rows of 64 bytes at `at` (+ r * row_bytes), transposed: `words[w]` lane r = row r's
/// word w.
#[target_feature(enable = "avx2,avx512f")]
#[inline]
unsafe fn load_transposed(at: *const u8, row_bytes: usize) -> [__m512i; 16] {
    let mut rows = [_mm512_setzero_si512(); GROUP_ROWS];
    for (r, row) in rows.iter_mut().enumerate() {
        *row = _mm512_loadu_si512(at.add(r * row_bytes) as *const _);
    }
    transpose_16x16(rows)
}

/// Sixteen rows (from `first`, `row_bytes` apart) of `ty` (Q4_K or Q5_K) blocks into `blocks`,
/// one per block.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn interleave_with_mins(ty: GgmlType, first: *const u8, row_bytes: usize, blocks: &mut [BlockWithMins]) {
    let offsets = row_offsets(row_bytes);
    let block_bytes = ty.block_bytes();
    let quants = if ty == GgmlType::Q5_K { 48 } else { 16 };
    let (low_nibble, one_bit) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(1));
    for (b, block) in blocks.iter_mut().enumerate() {
        let at = first.add(b * block_bytes);
        prefetch_next_group(first, row_bytes, block_bytes, b);
        // Q5_K's fifth bits: word c of the 32 bytes at 16 (bytes 4c..4c + 4), bit j for sub-block j.
        let high_bits =
            if ty == GgmlType::Q5_K { load_transposed(at.add(16), row_bytes) } else { [_mm512_setzero_si512(); 16] };
        for half in 0..2 {
            // Word 8 * pair + c (of this half's 16): bytes 4c.. of the 32 holding sub-blocks
            // 2 * pair (low nibbles) and 2 * pair + 1 (high nibbles).
            let words = load_transposed(at.add(quants + 64 * half), row_bytes);
            if ty == GgmlType::Q4_K {
                for (w, word) in words.iter().enumerate() {
                    _mm512_store_si512(block.values[16 * half + w].as_mut_ptr() as *mut _, *word);
                }
                continue;
            }
            for (w, &word) in words.iter().enumerate() {
                let (pair, c) = (2 * half + w / 8, w % 8);
                for odd in 0..2 {
                    let sub_block = 2 * pair + odd;
                    let nibbles = if odd == 0 { word } else { _mm512_srli_epi16::<4>(word) };
                    let mut value = _mm512_and_si512(nibbles, low_nibble);
                    if ty == GgmlType::Q5_K {
                        let bit = _mm512_and_si512(
                            _mm512_srlv_epi16(high_bits[c], _mm512_set1_epi16(sub_block as i16)),
                            one_bit,
                        );
                        value = _mm512_or_si512(value, _mm512_slli_epi16::<4>(bit));
                    }
                    _mm512_store_si512(block.values[8 * sub_block + c].as_mut_ptr() as *mut _, value);
                }
            }
        }
        // (ggml's get_scale_min_k4 for sixteen rows at once: see k_quants.rs)
        let (w0, w1, w2) = (gather(offsets, at.add(4)), gather(offsets, at.add(8)), gather(offsets, at.add(12)));
        let six_bits = _mm512_set1_epi32(0x3f3f_3f3f);
        let low_nibbles = _mm512_set1_epi32(0x0f0f_0f0f);
        let two_bits = _mm512_set1_epi32(0x0303_0303);
        let scales = [
            _mm512_and_si512(w0, six_bits),
            _mm512_or_si512(
                _mm512_and_si512(w2, low_nibbles),
                _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(w0), two_bits)),
            ),
        ];
        let mins = [
            _mm512_and_si512(w1, six_bits),
            _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi32::<4>(w2), low_nibbles),
                _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(w1), two_bits)),
            ),
        ];
        for j in 0..8 {
            _mm512_store_si512(block.scales[j].as_mut_ptr() as *mut _, byte(scales[j / 4], j as u32 % 4));
        }
        for p in 0..4 {
            let pair = _mm512_or_si512(
                byte(mins[p / 2], 2 * (p as u32 % 2)),
                _mm512_slli_epi32::<16>(byte(mins[p / 2], 2 * (p as u32 % 2) + 1)),
            );
            _mm512_store_si512(block.min_pairs[p].as_mut_ptr() as *mut _, pair);
        }
        let halves = gather(offsets, at);
        _mm512_store_ps(block.d.as_mut_ptr(), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(halves)));
        _mm512_store_ps(
            block.dmin.as_mut_ptr(),
            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(halves))),
        );
    }
}

/// `words[w]` lane r = `rows[r]` lane w.
#[target_feature(enable = "avx2,avx512f")]
#[inline]
unsafe fn transpose_16x16(rows: [__m512i; 16]) -> [__m512i; 16] {
    let mut pairs = [_mm512_setzero_si512(); 16];
    for i in 0..8 {
        pairs[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
        pairs[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
    }
    // quads[4i + j], 128-bit lane l: rows 4i..4i + 4 of word 4l + j.
    let mut quads = [_mm512_setzero_si512(); 16];
    for i in 0..4 {
        quads[4 * i] = _mm512_unpacklo_epi64(pairs[4 * i], pairs[4 * i + 2]);
        quads[4 * i + 1] = _mm512_unpackhi_epi64(pairs[4 * i], pairs[4 * i + 2]);
        quads[4 * i + 2] = _mm512_unpacklo_epi64(pairs[4 * i + 1], pairs[4 * i + 3]);
        quads[4 * i + 3] = _mm512_unpackhi_epi64(pairs[4 * i + 1], pairs[4 * i + 3]);
    }
    // Then the 128-bit lanes: word 4l + j takes lane l of quads[j], quads[4 + j], ... in turn.
    let mut words = [_mm512_setzero_si512(); 16];
    for j in 0..4 {
        let low_01 = _mm512_shuffle_i32x4::<0x44>(quads[j], quads[4 + j]);
        let high_01 = _mm512_shuffle_i32x4::<0xEE>(quads[j], quads[4 + j]);
        let low_23 = _mm512_shuffle_i32x4::<0x44>(quads[8 + j], quads[12 + j]);
        let high_23 = _mm512_shuffle_i32x4::<0xEE>(quads[8 + j], quads[12 + j]);
        words[j] = _mm512_shuffle_i32x4::<0x88>(low_01, low_23);
        words[4 + j] = _mm512_shuffle_i32x4::<0xDD>(low_01, low_23);
        words[8 + j] = _mm512_shuffle_i32x4::<0x88>(high_01, high_23);
        words[12 + j] = _mm512_shuffle_i32x4::<0xDD>(high_01, high_23);
    }
    words
}

/// The 32-bit words at `at` plus each of `offsets` (bytes).
#[target_feature(enable = "avx2,avx512f")]
#[inline]
unsafe fn gather(offsets: __m512i, at: *const u8) -> __m512i {
    _mm512_i32gather_epi32::<1>(offsets, at as *const _)
}

/// Byte `i` of each int32 lane.
#[target_feature(enable = "avx2,avx512f")]
#[inline]
unsafe fn byte(words: __m512i, i: u32) -> __m512i {
    _mm512_and_si512(_mm512_srlv_epi32(words, _mm512_set1_epi32(8 * i as i32)), _mm512_set1_epi32(0xff))
}

/// The sixteen rows' sums for `T` tokens whose activations start at block `first_blocks[t]`,
/// into `sums[token][row]` (Q4_K, whose `values` are `NIBBLES`, and Q5_K).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn tile_with_mins<const T: usize, const NIBBLES: bool>(
    blocks: &[BlockWithMins],
    activations: &QuantizedActivations,
    first_blocks: [usize; T],
    sums: &mut [[f32; GROUP_ROWS]; TILE_TOKENS],
) {
    let low_nibbles = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); T];
    let mut mins = [_mm512_setzero_ps(); T];
    let quants = activations.quants.as_ptr();
    for (b, block) in blocks.iter().enumerate() {
        let mut totals = [_mm512_setzero_si512(); T];
        for pair in 0..4 {
            // Sub-blocks 2 * pair (even) and 2 * pair + 1 (odd).
            let (mut even, mut odd) = ([_mm512_setzero_si512(); T], [_mm512_setzero_si512(); T]);
            for c in 0..8 {
                let (low, high) = if NIBBLES {
                    let packed = _mm512_load_si512(block.values[8 * pair + c].as_ptr() as *const _);
                    (
                        _mm512_and_si512(packed, low_nibbles),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(packed), low_nibbles),
                    )
                } else {
                    (
                        _mm512_load_si512(block.values[16 * pair + c].as_ptr() as *const _),
                        _mm512_load_si512(block.values[16 * pair + 8 + c].as_ptr() as *const _),
                    )
                };
                for t in 0..T {
                    // Elements 4c..4c + 4 of each sub-block, to every lane.
                    let x = quants.add(256 * (first_blocks[t] + b) + 64 * pair + 4 * c);
                    even[t] = _mm512_dpbusd_epi32(even[t], low, _mm512_set1_epi32((x as *const i32).read_unaligned()));
                    odd[t] = _mm512_dpbusd_epi32(
                        odd[t],
                        high,
                        _mm512_set1_epi32((x.add(32) as *const i32).read_unaligned()),
                    );
                }
            }
            let even_scales = _mm512_load_si512(block.scales[2 * pair].as_ptr() as *const _);
            let odd_scales = _mm512_load_si512(block.scales[2 * pair + 1].as_ptr() as *const _);
            for t in 0..T {
                let scaled =
                    _mm512_add_epi32(_mm512_mullo_epi32(even[t], even_scales), _mm512_mullo_epi32(odd[t], odd_scales));
                totals[t] = _mm512_add_epi32(totals[t], scaled);
            }
        }
        let d = _mm512_load_ps(block.d.as_ptr());
        let dmin = _mm512_load_ps(block.dmin.as_ptr());
        for t in 0..T {
            let a = first_blocks[t] + b;
            let act_scale = _mm512_set1_ps(*activations.scales.get_unchecked(a));
            // Σ min * (sum of the 32's activations), exact: two sub-blocks per int16 pair.
            let sums_of_32 = activations.sums_of_32.as_ptr().add(8 * a) as *const i32;
            let mut min_total = _mm512_setzero_si512();
            for p in 0..4 {
                let pairs = _mm512_load_si512(block.min_pairs[p].as_ptr() as *const _);
                let sums = _mm512_set1_epi32(sums_of_32.add(p).read_unaligned());
                min_total = _mm512_dpwssd_epi32(min_total, pairs, sums);
            }
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, act_scale), _mm512_cvtepi32_ps(totals[t]), acc[t]);
            mins[t] = _mm512_fmadd_ps(_mm512_mul_ps(dmin, act_scale), _mm512_cvtepi32_ps(min_total), mins[t]);
        }
    }
    for t in 0..T {
        _mm512_storeu_ps(sums[t].as_mut_ptr(), _mm512_sub_ps(acc[t], mins[t]));
    }
}

/// Sixteen rows (from `first`, `row_bytes` apart) of Q6_K blocks into `blocks`, one per block.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn interleave_q6_k(first: *const u8, row_bytes: usize, blocks: &mut [Q6kBlock]) {
    let offsets = row_offsets(row_bytes);
    let (low_nibbles, two_bits) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x03));
    for (b, block) in blocks.iter_mut().enumerate() {
        let at = first.add(b * 210);
        prefetch_next_group(first, row_bytes, 210, b);
        // Bytes 0-127: the values' low four bits; 128-191: their top two bits (see formats::q6_k_value).
        let low = [load_transposed(at, row_bytes), load_transposed(at.add(64), row_bytes)];
        let high = load_transposed(at.add(128), row_bytes);
        for half in 0..2 {
            for c in 0..8 {
                // Bytes 4c.. of the half's low bits: elements 32 * quarter + 4c.. (quarters 0 and
                // 2 in the first 32 bytes' low and high nibbles, 1 and 3 in the next 32's).
                let (first_32, next_32, top) = (low[half][c], low[half][8 + c], high[8 * half + c]);
                for quarter in 0..4 {
                    let nibbles = if quarter % 2 == 0 { first_32 } else { next_32 };
                    let nibbles = if quarter < 2 { nibbles } else { _mm512_srli_epi16::<4>(nibbles) };
                    let top = _mm512_srlv_epi16(top, _mm512_set1_epi16(2 * quarter as i16));
                    let value = _mm512_or_si512(
                        _mm512_and_si512(nibbles, low_nibbles),
                        _mm512_slli_epi16::<4>(_mm512_and_si512(top, two_bits)),
                    );
                    let group = 32 * half + 8 * quarter + c;
                    _mm512_store_si512(block.values[group].as_mut_ptr() as *mut _, value);
                }
            }
        }
        let words = [
            gather(offsets, at.add(192)),
            gather(offsets, at.add(196)),
            gather(offsets, at.add(200)),
            gather(offsets, at.add(204)),
        ];
        let mut scales = [_mm512_setzero_si512(); 16];
        for (j, scale) in scales.iter_mut().enumerate() {
            // Byte j % 4 of word j / 4, sign-extended.
            let shifted = _mm512_sllv_epi32(words[j / 4], _mm512_set1_epi32(24 - 8 * (j as i32 % 4)));
            *scale = _mm512_srai_epi32::<24>(shifted);
            _mm512_store_si512(block.scales[j].as_mut_ptr() as *mut _, *scale);
        }
        for p in 0..8 {
            let pair = _mm512_or_si512(
                _mm512_and_si512(scales[2 * p], _mm512_set1_epi32(0xffff)),
                _mm512_slli_epi32::<16>(scales[2 * p + 1]),
            );
            _mm512_store_si512(block.scale_pairs[p].as_mut_ptr() as *mut _, pair);
        }
        // (d is the block's last two bytes: the word before them is read, not the next block's)
        let d = _mm512_srli_epi32::<16>(gather(offsets, at.add(206)));
        _mm512_store_ps(block.d.as_mut_ptr(), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d)));
    }
}

/// `tile_with_mins` for Q6_K: each sub-block of 16 summed by four dpbusd on the values as stored, the
/// -32 offset taken off once per block as 32 * Σ scale * (sum of the 16's activations).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn tile_q6_k<const T: usize>(
    blocks: &[Q6kBlock],
    activations: &QuantizedActivations,
    first_blocks: [usize; T],
    sums: &mut [[f32; GROUP_ROWS]; TILE_TOKENS],
) {
    let mut acc = [_mm512_setzero_ps(); T];
    let quants = activations.quants.as_ptr();
    for (b, block) in blocks.iter().enumerate() {
        let mut totals = [_mm512_setzero_si512(); T];
        for j in 0..16 {
            let mut sub_block = [_mm512_setzero_si512(); T];
            for c in 0..4 {
                let values = _mm512_load_si512(block.values[4 * j + c].as_ptr() as *const _);
                for t in 0..T {
                    let x = quants.add(256 * (first_blocks[t] + b) + 16 * j + 4 * c);
                    sub_block[t] = _mm512_dpbusd_epi32(
                        sub_block[t],
                        values,
                        _mm512_set1_epi32((x as *const i32).read_unaligned()),
                    );
                }
            }
            let scales = _mm512_load_si512(block.scales[j].as_ptr() as *const _);
            for t in 0..T {
                totals[t] = _mm512_add_epi32(totals[t], _mm512_mullo_epi32(sub_block[t], scales));
            }
        }
        let d = _mm512_load_ps(block.d.as_ptr());
        for t in 0..T {
            let a = first_blocks[t] + b;
            // The sums of the 16s (|sum| <= 16 * 127) as int16 pairs, each pair to every lane.
            let sums_of_16 = _mm512_loadu_si512(activations.sums_of_16.as_ptr().add(16 * a) as *const _);
            let mut pairs = [0u32; 8];
            _mm256_storeu_si256(pairs.as_mut_ptr() as *mut __m256i, _mm512_cvtepi32_epi16(sums_of_16));
            let mut offset = _mm512_setzero_si512();
            for (p, &pair) in pairs.iter().enumerate() {
                let scale_pairs = _mm512_load_si512(block.scale_pairs[p].as_ptr() as *const _);
                offset = _mm512_dpwssd_epi32(offset, scale_pairs, _mm512_set1_epi32(pair as i32));
            }
            let total = _mm512_sub_epi32(totals[t], _mm512_slli_epi32::<5>(offset));
            let act_scale = _mm512_set1_ps(*activations.scales.get_unchecked(a));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, act_scale), _mm512_cvtepi32_ps(total), acc[t]);
        }
    }
    for t in 0..T {
        _mm512_storeu_ps(sums[t].as_mut_ptr(), acc[t]);
    }
}

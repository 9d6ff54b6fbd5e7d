//! Q4_K's linear layer for many tokens (prefill, batches of decodes) on AVX-512 VNNI: sixteen
//! weight rows interleaved, one row per int32 lane, so that `dpbusd` against a token's four
//! activations broadcast to every lane sums four products of each row, and a sub-block's 32
//! weights end in one lane. A sub-block's total is then scaled by one `vpmulld` for all sixteen
//! rows, where the two-row kernel (k_quants.rs) spends a `vpdpwssd` and two packing instructions
//! per 128 weights and row, and the block's float work is one multiply-add for sixteen rows.
//!
//! The interleaving is done here, per group of rows and pass over the tokens, into a buffer that
//! stays in the core's L2 (llama.cpp repacks its weights once, at load; this keeps the GGUF's
//! layout, which the decode kernel and everything else read): 16 rows x 144 bytes a block, read
//! back by every token of the pass. Gives `dot::dot_row_scalar`'s result bit for bit.

use std::arch::x86_64::*;
use std::ops::Range;

use super::eight_rows::Problem;
use super::formats::GgmlType;

/// Rows interleaved: one per int32 lane of a 512-bit register.
pub(crate) const GROUP_ROWS: usize = 16;
/// Tokens that share each load of the interleaved weights.
const TILE_TOKENS: usize = 4;

/// One block of sixteen rows, as the tiles read it.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct InterleavedBlock {
    /// Register 8 * pair + c: lane r holds bytes 4c..4c + 4 of row r's 32 bytes of sub-blocks
    /// 2 * pair (low nibbles) and 2 * pair + 1 (high nibbles).
    nibbles: [[u32; GROUP_ROWS]; 32],
    /// `[sub-block][row]`: the 6-bit scales.
    scales: [[i32; GROUP_ROWS]; 8],
    /// `[pair][row]`: the mins of sub-blocks 2 * pair (low int16) and 2 * pair + 1 (high).
    min_pairs: [[u32; GROUP_ROWS]; 4],
    d: [f32; GROUP_ROWS],
    dmin: [f32; GROUP_ROWS],
}

/// Writes `out[token * n + row]` (through `write`, bias added) for the problem's tokens and the
/// rows in `rows`, a whole number of groups.
///
/// # Safety
/// The CPU runs AVX2, FMA, F16C and AVX-512 F, BW, VL and VNNI; `problem` is consistent (weight
/// holds n rows of blocks_per_row Q4_K blocks, activations m rows of as many Q8_K blocks), rows lie
/// in 0..n and their count is a multiple of `GROUP_ROWS`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn run_groups_q4_k(problem: &Problem, rows: Range<usize>, write: &impl Fn(usize, usize, f32)) {
    let Problem { ty, weight, row_bytes, activations, bias, first_token, m, n, blocks_per_row } = *problem;
    assert!(ty == GgmlType::Q4_K && first_token < m && rows.end <= n && rows.len().is_multiple_of(GROUP_ROWS));
    assert!(weight.len() == n * row_bytes && row_bytes == blocks_per_row * ty.block_bytes());
    assert!(activations.quants.len() >= m * blocks_per_row * 256 && activations.scales.len() >= m * blocks_per_row);
    assert!(activations.sums_of_32.len() >= m * blocks_per_row * 8);
    // (row_bytes * 15 fits i32: the gathers' offsets)
    assert!(row_bytes < (i32::MAX as usize) / GROUP_ROWS);
    let mut blocks = vec![std::mem::zeroed::<InterleavedBlock>(); blocks_per_row];
    for first_row in rows.step_by(GROUP_ROWS) {
        interleave(weight.as_ptr().add(first_row * row_bytes), row_bytes, &mut blocks);
        let mut token = first_token;
        while token < m {
            let tokens = (m - token).min(TILE_TOKENS);
            let first_blocks = |t: usize| (token + t).min(m - 1) * blocks_per_row;
            let mut sums = [[0f32; GROUP_ROWS]; TILE_TOKENS];
            match tokens {
                1 => tile::<1>(&blocks, activations, [first_blocks(0)], &mut sums),
                2 => tile::<2>(&blocks, activations, std::array::from_fn(first_blocks), &mut sums),
                3 => tile::<3>(&blocks, activations, std::array::from_fn(first_blocks), &mut sums),
                _ => tile::<4>(&blocks, activations, std::array::from_fn(first_blocks), &mut sums),
            }
            for (t, sums) in sums.iter().enumerate().take(tokens) {
                for (r, &sum) in sums.iter().enumerate() {
                    let row = first_row + r;
                    write(token + t, row, sum + bias.map_or(0.0, |bias| bias[row]));
                }
            }
            token += tokens;
        }
    }
}

/// Sixteen rows (from `first`, `row_bytes` apart) of Q4_K blocks into `blocks`, one per block.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn interleave(first: *const u8, row_bytes: usize, blocks: &mut [InterleavedBlock]) {
    let offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(row_bytes as i32),
    );
    for (b, block) in blocks.iter_mut().enumerate() {
        let at = first.add(b * 144);
        // The next group's rows (contiguous, after these), a block's share at a time, so that
        // they have arrived when it is interleaved. (Past the weights' end for the last group: a
        // prefetch never faults.)
        let next = first.wrapping_add(GROUP_ROWS * row_bytes);
        for r in 0..GROUP_ROWS {
            for line in 0..3 {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(r * row_bytes + b * 144 + 64 * line) as *const i8);
            }
        }
        for half in 0..2 {
            let mut rows = [_mm512_setzero_si512(); GROUP_ROWS];
            for (r, row) in rows.iter_mut().enumerate() {
                *row = _mm512_loadu_si512(at.add(r * row_bytes + 16 + 64 * half) as *const _);
            }
            let words = transpose_16x16(rows);
            for (w, word) in words.iter().enumerate() {
                _mm512_store_si512(block.nibbles[16 * half + w].as_mut_ptr() as *mut _, *word);
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
/// into `sums[token][row]`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn tile<const T: usize>(
    blocks: &[InterleavedBlock],
    activations: &super::activations::QuantizedActivations,
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
            let (mut even, mut odd) = ([_mm512_setzero_si512(); T], [_mm512_setzero_si512(); T]);
            for c in 0..8 {
                let packed = _mm512_load_si512(block.nibbles[8 * pair + c].as_ptr() as *const _);
                let low = _mm512_and_si512(packed, low_nibbles);
                let high = _mm512_and_si512(_mm512_srli_epi16::<4>(packed), low_nibbles);
                for t in 0..T {
                    // Elements 4c..4c + 4 of sub-blocks 2 * pair and 2 * pair + 1, to every lane.
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
                min_total =
                    _mm512_dpwssd_epi32(min_total, pairs, _mm512_set1_epi32(sums_of_32.add(p).read_unaligned()));
            }
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, act_scale), _mm512_cvtepi32_ps(totals[t]), acc[t]);
            mins[t] = _mm512_fmadd_ps(_mm512_mul_ps(dmin, act_scale), _mm512_cvtepi32_ps(min_total), mins[t]);
        }
    }
    for t in 0..T {
        _mm512_storeu_ps(sums[t].as_mut_ptr(), _mm512_sub_ps(acc[t], mins[t]));
    }
}

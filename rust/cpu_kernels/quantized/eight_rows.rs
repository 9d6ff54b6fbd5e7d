//! The linear layer over the 32-element block formats (Q4_0, Q4_1, Q8_0), eight weight rows at a
//! time: each block of the eight rows is unpacked once for up to four tokens, and the eight
//! integer block totals land in one register's lanes, so a block costs each (row, token) a few
//! instructions where one row at a time cost ten. On AVX2 (maddubs) and AVX-512 VNNI (dpbusd),
//! picked at run time; both give `dot::dot_row_scalar`'s result bit for bit.
//!
//! Rows p and p + 4 share a register: its low half holds row p's 16 weights of a half-block, its
//! high half row p + 4's, against the token's half-block broadcast to both halves. Two horizontal
//! adds of the four pairs leave rows 0-7 in lanes 0-7.

use std::arch::x86_64::*;
use std::ops::Range;

use super::activations::QuantizedActivations;
use super::formats::GgmlType;

/// Rows one pass reads together.
pub(crate) const GROUP_ROWS: usize = 8;
/// Tokens that share one unpacking of a group's block (four accumulator pairs stay in AVX2's 16
/// registers), and on AVX-512 (32 registers) eight.
const TILE_TOKENS: usize = 4;
const WIDE_TILE_TOKENS: usize = 8;

/// The integer dot product instructions the kernel runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int8Path {
    /// AVX2's maddubs + madd (with FMA and F16C).
    Avx2,
    /// AVX-512 VNNI's dpbusd on 256-bit registers (and, for the K-quants, k_quants.rs's 512-bit
    /// kernel, which takes AVX-512 BW too: every VNNI CPU has it).
    Avx512Vnni,
}

impl Int8Path {
    /// The fastest path this CPU runs, if any.
    pub(crate) fn best() -> Option<Int8Path> {
        Int8Path::ALL.into_iter().rev().find(|path| path.is_supported())
    }

    pub(crate) const ALL: [Int8Path; 2] = [Int8Path::Avx2, Int8Path::Avx512Vnni];

    pub(crate) fn is_supported(self) -> bool {
        let avx2 = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        match self {
            Int8Path::Avx2 => avx2,
            Int8Path::Avx512Vnni => {
                avx2 && std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512vl")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512vnni")
            }
        }
    }
}

/// What every group of a call reads and where it writes.
pub(crate) struct Problem<'a> {
    pub ty: GgmlType,
    pub weight: &'a [u8],
    pub row_bytes: usize,
    pub activations: &'a QuantizedActivations,
    pub bias: Option<&'a [f32]>,
    /// The tokens computed: first_token..m (the activations hold at least m rows).
    pub first_token: usize,
    /// (end of the tokens, output features, blocks per row)
    pub m: usize,
    pub n: usize,
    pub blocks_per_row: usize,
}

/// Writes `out[token * n + row]` for every token and the rows in `rows`, through `write`.
///
/// # Safety
/// `path.is_supported()`; `problem` is consistent (weight holds n rows of blocks_per_row `ty`
/// blocks, activations m rows of as many blocks), `ty` is Q4_0, Q4_1 or Q8_0, rows lie in 0..n.
pub(crate) unsafe fn run_rows(
    path: Int8Path,
    problem: &Problem,
    rows: Range<usize>,
    write: &impl Fn(usize, usize, f32),
) {
    match path {
        Int8Path::Avx2 => run_rows_avx2(problem, rows, write),
        Int8Path::Avx512Vnni => run_rows_vnni(problem, rows, write),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_rows_avx2(problem: &Problem, rows: Range<usize>, write: &impl Fn(usize, usize, f32)) {
    run_rows_for::<false>(problem, rows, write)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn run_rows_vnni(problem: &Problem, rows: Range<usize>, write: &impl Fn(usize, usize, f32)) {
    run_rows_for::<true>(problem, rows, write)
}

/// One inlined copy per format, so each inner loop is compiled for its constant format.
#[inline(always)]
unsafe fn run_rows_for<const VNNI: bool>(problem: &Problem, rows: Range<usize>, write: &impl Fn(usize, usize, f32)) {
    match problem.ty {
        GgmlType::Q4_0 => run_groups::<VNNI>(GgmlType::Q4_0, problem, rows, write),
        GgmlType::Q4_1 => run_groups::<VNNI>(GgmlType::Q4_1, problem, rows, write),
        GgmlType::Q8_0 => run_groups::<VNNI>(GgmlType::Q8_0, problem, rows, write),
        _ => unreachable!("eight_rows takes the 32-element block formats"),
    }
}

#[inline(always)]
unsafe fn run_groups<const VNNI: bool>(
    ty: GgmlType,
    problem: &Problem,
    rows: Range<usize>,
    write: &impl Fn(usize, usize, f32),
) {
    let Problem { weight, row_bytes, activations, bias, first_token, m, n, blocks_per_row, .. } = *problem;
    assert!(weight.len() == n * row_bytes && rows.end <= n && row_bytes == blocks_per_row * ty.block_bytes());
    assert!(activations.quants.len() >= m * blocks_per_row * 32 && activations.scales.len() >= m * blocks_per_row);
    assert!(first_token < m);
    for group in rows.clone().step_by(GROUP_ROWS) {
        // Rows past n repeat the last row; their results are not written.
        let starts: [*const u8; GROUP_ROWS] =
            std::array::from_fn(|r| weight.as_ptr().add((group + r).min(n - 1) * row_bytes));
        let emit = |first_token: usize, values: &[[f32; GROUP_ROWS]]| {
            for (t, values) in values.iter().enumerate() {
                for (r, &value) in values.iter().enumerate().take(rows.end - group) {
                    write(first_token + t, group + r, value + bias.map_or(0.0, |bias| bias[group + r]));
                }
            }
        };
        // While the first tile reads this group, the next group's bytes (contiguous: rows are)
        // are prefetched, spread evenly over its blocks, so they arrive before they are read.
        let group_bytes = GROUP_ROWS * row_bytes;
        let next_group = starts[0].wrapping_add(group_bytes);
        let lines_per_block = group_bytes.div_ceil(64 * blocks_per_row);
        let mut token = first_token;
        while token < m {
            let prefetch = (next_group, if token == first_token { lines_per_block } else { 0 });
            let tile = Tile { ty, starts, num_blocks: blocks_per_row, activations, first_token: token, prefetch };
            token += match m - token {
                1 => tile.run::<1, VNNI>(&emit),
                2 => tile.run::<2, VNNI>(&emit),
                3 => tile.run::<3, VNNI>(&emit),
                4..WIDE_TILE_TOKENS => tile.run::<TILE_TOKENS, VNNI>(&emit),
                // AVX-512's 32 registers hold eight tokens' sums beside the unpacked weights.
                _ if VNNI => tile.run::<WIDE_TILE_TOKENS, VNNI>(&emit),
                _ => tile.run::<TILE_TOKENS, VNNI>(&emit),
            };
        }
    }
}

/// One group of rows for the tokens from `first_token` on.
struct Tile<'a> {
    ty: GgmlType,
    starts: [*const u8; GROUP_ROWS],
    num_blocks: usize,
    activations: &'a QuantizedActivations,
    first_token: usize,
    prefetch: (*const u8, usize),
}

impl Tile<'_> {
    /// Sums `T` tokens, hands them to `emit` (first token, `[token][row]`), returns `T`.
    #[inline(always)]
    unsafe fn run<const T: usize, const VNNI: bool>(&self, emit: &impl Fn(usize, &[[f32; GROUP_ROWS]])) -> usize {
        let mut first_blocks = [0; T];
        for (t, first) in first_blocks.iter_mut().enumerate() {
            *first = (self.first_token + t) * self.num_blocks;
        }
        let sums =
            group_tile::<T, VNNI>(self.ty, self.starts, self.num_blocks, self.activations, first_blocks, self.prefetch);
        emit(self.first_token, &sums);
        T
    }
}

/// `[token][row]` sums (before bias) of eight rows starting at `starts` and `T` tokens whose
/// activations start at block `first_blocks[t]`, in `dot_row_scalar`'s float order.
#[inline(always)]
unsafe fn group_tile<const T: usize, const VNNI: bool>(
    ty: GgmlType,
    starts: [*const u8; GROUP_ROWS],
    num_blocks: usize,
    activations: &QuantizedActivations,
    first_blocks: [usize; T],
    (prefetch_from, prefetch_lines): (*const u8, usize),
) -> [[f32; GROUP_ROWS]; T] {
    let block_bytes = ty.block_bytes();
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    let mut mins = [_mm256_setzero_ps(); T];
    for b in 0..num_blocks {
        let block = |r: usize| starts[r].add(b * block_bytes);
        for line in b * prefetch_lines..(b + 1) * prefetch_lines {
            // (past the weights' end for the last group: a prefetch never faults)
            _mm_prefetch::<_MM_HINT_T0>(prefetch_from.wrapping_add(64 * line) as *const i8);
        }
        let (weight_scales, weight_mins) = group_scales(block);
        // (Loops, not closures: a closure is compiled without the caller's target features, so
        // the intrinsics in it would become calls.)
        let mut pairs = [[_mm256_setzero_si256(); 2]; 4];
        for (p, pair) in pairs.iter_mut().enumerate() {
            *pair = weight_pair::<VNNI>(ty, block(p), block(p + 4));
        }
        for t in 0..T {
            let a = first_blocks[t] + b;
            let x = activations.quants.as_ptr().add(a * 32);
            let x_low = _mm256_broadcastsi128_si256(_mm_loadu_si128(x as *const __m128i));
            let x_high = _mm256_broadcastsi128_si256(_mm_loadu_si128(x.add(16) as *const __m128i));
            let mut sums = [_mm256_setzero_si256(); 4];
            for (sum, &pair) in sums.iter_mut().zip(&pairs) {
                *sum = pair_sums::<VNNI>(ty, pair, x_low, x_high, ones);
            }
            let mut totals =
                _mm256_hadd_epi32(_mm256_hadd_epi32(sums[0], sums[1]), _mm256_hadd_epi32(sums[2], sums[3]));
            // Weights read unsigned carry an offset: take it back times the block's sum of x.
            let offset = match ty {
                GgmlType::Q4_0 => 8,
                GgmlType::Q8_0 if VNNI => 128,
                _ => 0,
            };
            if offset != 0 {
                totals = _mm256_sub_epi32(totals, _mm256_set1_epi32(offset * *activations.block_sums.get_unchecked(a)));
            }
            let scale = _mm256_mul_ps(weight_scales, _mm256_set1_ps(*activations.scales.get_unchecked(a)));
            acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(totals), acc[t]);
            if ty == GgmlType::Q4_1 {
                mins[t] = _mm256_fmadd_ps(weight_mins, _mm256_set1_ps(*activations.sums.get_unchecked(a)), mins[t]);
            }
        }
    }
    let mut values = [[0f32; GROUP_ROWS]; T];
    for t in 0..T {
        let total = if ty == GgmlType::Q4_1 { _mm256_add_ps(acc[t], mins[t]) } else { acc[t] };
        _mm256_storeu_ps(values[t].as_mut_ptr(), total);
    }
    values
}

/// The eight rows' block scales d, and Q4_1's mins m (garbage for the other formats: unused),
/// widened from f16 in lane order.
#[inline(always)]
unsafe fn group_scales(block: impl Fn(usize) -> *const u8) -> (__m256, __m256) {
    // Each block starts with f16 d and (Q4_1) f16 m; every format's block has 4 bytes there.
    let word = |r: usize| (block(r) as *const i32).read_unaligned();
    let low = _mm_setr_epi32(word(0), word(1), word(2), word(3));
    let high = _mm_setr_epi32(word(4), word(5), word(6), word(7));
    // [d0 m0 d1 m1 d2 m2 d3 m3] -> [d0 d1 d2 d3 m0 m1 m2 m3]
    let split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    let (low, high) = (_mm_shuffle_epi8(low, split), _mm_shuffle_epi8(high, split));
    (_mm256_cvtph_ps(_mm_unpacklo_epi64(low, high)), _mm256_cvtph_ps(_mm_unpackhi_epi64(low, high)))
}

/// Rows p (low halves) and p + 4 (high halves) of a block: [elements 0-15, elements 16-31], as
/// maddubs or dpbusd take them (unsigned: Q4_0 as its nibble, Q8_0 on VNNI as q + 128; Q8_0 on
/// AVX2 signed, for the sign trick).
#[inline(always)]
unsafe fn weight_pair<const VNNI: bool>(ty: GgmlType, low: *const u8, high: *const u8) -> [__m256i; 2] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            // Byte j holds element j (low nibble) and element j + 16 (high nibble).
            let packed = load_two(low, high, if ty == GgmlType::Q4_1 { 4 } else { 2 });
            let nibble = _mm256_set1_epi8(0x0f);
            [_mm256_and_si256(packed, nibble), _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble)]
        }
        _ => {
            let (first, second) = (load_two(low, high, 2), load_two(low, high, 18));
            if VNNI {
                let flip = _mm256_set1_epi8(-128);
                [_mm256_xor_si256(first, flip), _mm256_xor_si256(second, flip)]
            } else {
                [first, second]
            }
        }
    }
}

/// 16 bytes at `low + offset` in the low half, at `high + offset` in the high half.
#[inline(always)]
unsafe fn load_two(low: *const u8, high: *const u8, offset: usize) -> __m256i {
    _mm256_loadu2_m128i(high.add(offset) as *const __m128i, low.add(offset) as *const __m128i)
}

/// Per lane, sums of four of each row's products w * x: lanes 0-3 row p's, 4-7 row p + 4's.
#[inline(always)]
unsafe fn pair_sums<const VNNI: bool>(
    ty: GgmlType,
    [w_low, w_high]: [__m256i; 2],
    x_low: __m256i,
    x_high: __m256i,
    ones: __m256i,
) -> __m256i {
    if VNNI {
        return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w_low, x_low), w_high, x_high);
    }
    if ty == GgmlType::Q8_0 {
        // maddubs takes |w| unsigned and x with w's sign; each pair fills most of int16, so the
        // halves are widened apart.
        return _mm256_add_epi32(signed_sums(w_low, x_low, ones), signed_sums(w_high, x_high, ones));
    }
    // 4-bit weights: |pair| <= 2 * 15 * 127, so both halves' pairs add in int16.
    _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w_low, x_low), _mm256_maddubs_epi16(w_high, x_high)), ones)
}

/// Sums of four products of signed weights and x: maddubs takes |w| unsigned and x with w's sign.
#[inline(always)]
unsafe fn signed_sums(w: __m256i, x: __m256i, ones: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones)
}

//! The small-M linear layer over weights kept as GGUF blocks, and their dequantization.

use super::activations::{quantize_activations_on, ActivationScheme};
use super::dot::dot_rows;
use super::formats::{dequantize_block, GgmlType};
use crate::cpu_kernels::layer_ops::for_row_chunks;
use crate::cpu_kernels::simd::{with_isa, Isa};
use crate::errors::{Error, Result};

#[cfg(target_arch = "x86_64")]
pub(crate) use super::eight_rows::Int8Path;
#[cfg(not(target_arch = "x86_64"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int8Path {}
#[cfg(not(target_arch = "x86_64"))]
impl Int8Path {
    pub(crate) fn best() -> Option<Int8Path> {
        None
    }
}

/// Fewest output features a thread takes: below this, waking another thread costs more than it saves.
const MIN_ROWS_PER_THREAD: usize = 16;
/// Tokens that share one read of a weight row (4 accumulators fit AVX2's 16 registers).
const TOKENS_PER_PASS: usize = 4;

fn invalid(field: &'static str, message: String) -> Result<()> {
    Err(Error::InvalidConfig { field, message })
}

/// out `[m, n]` = x `[m, k]` @ dequantize(weight)^T + bias, with weight `n` rows of `k / block_len`
/// `ty` blocks (`[n, row_bytes]` bytes, GGUF's layout). x is quantized to 8 bits per block first
/// (`ActivationScheme::for_weights`), and each output is an integer dot product per block
/// (llama.cpp's scheme); bias, if any, is added last. Work is split over `n` on torch's thread
/// team. `isa`: `Isa::best()`, or `Isa::Portable` for the scalar reference (the same bits). Each
/// output is the same function of its row and its token whatever `m` and the threads are, so a
/// token's result does not depend on the batch it is in.
#[allow(clippy::too_many_arguments)]
pub fn quantized_linear(
    out: &mut [f32],
    x: &[f32],
    weight: &[u8],
    bias: Option<&[f32]>,
    ty: GgmlType,
    shape: (usize, usize, usize),
    num_threads: usize,
    isa: Isa,
) -> Result<()> {
    let path = if isa == Isa::Portable { None } else { Int8Path::best() };
    quantized_linear_on(path, out, x, weight, bias, ty, shape, num_threads)
}

/// Whether `quantized_linear` on `ty` beats dequantizing for a float32 GEMM at every token count
/// here: the blocks of 32 (eight_rows.rs) always, the K-quants on AVX2 and AVX-512 VNNI (from a
/// few tokens on, interleaved tiles: k_quant_tiles.rs, k_quant_tiles_avx2.rs).
pub fn kernel_at_every_token_count(ty: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    let k_quants = Int8Path::best().is_some();
    #[cfg(not(target_arch = "x86_64"))]
    let k_quants = false;
    ty.block_len() == 32 || k_quants
}

/// Bytes of 8-bit activations a pass over the weights takes: every group of rows reads all of
/// them, so they must stay in the core's L2 (1 MB on Zen 4). A 2048-token prefill step
/// in one pass read 8-22 MB of them per group of rows, from L3 or DRAM (Q4_K at 2048 tokens:
/// 149-166 GMAC/s on two threads, 181-198 in passes).
const ACTIVATION_BYTES_PER_PASS: usize = 512 << 10;

/// Fewest tokens for which a K-quant takes the interleaved tiles (k_quant_tiles.rs): interleaving
/// a group's blocks costs about what a few tokens' products do (Q5_K's and Q6_K's more: their
/// values are unpacked there). On Llama 2 7B's shapes, 4 tokens: Q4_K's tiles 0.7-1.0x the
/// two-row kernel's time, Q6_K's 1.2-1.5x; 16 tokens: Q6_K's 0.7-0.75x.
fn min_tokens_for_k_quant_tiles(ty: GgmlType) -> usize {
    if ty == GgmlType::Q4_K {
        4
    } else {
        8
    }
}

/// Tokens per pass over the weights for rows of `k` inputs: a multiple of 8 (the widest tile).
fn tokens_per_pass_over_weights(k: usize) -> usize {
    (ACTIVATION_BYTES_PER_PASS / k.max(1)).max(8) / 8 * 8
}

/// `quantized_linear` on the integer path `path` (None: the scalar reference).
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantized_linear_on(
    path: Option<Int8Path>,
    out: &mut [f32],
    x: &[f32],
    weight: &[u8],
    bias: Option<&[f32]>,
    ty: GgmlType,
    (m, n, k): (usize, usize, usize),
    num_threads: usize,
) -> Result<()> {
    let use_simd = path.is_some();
    let row_bytes = ty.row_bytes(k)?;
    if weight.len() != n * row_bytes {
        invalid("weight", format!("has {} bytes, want {n} rows of {row_bytes} ({} {})", weight.len(), k, ty.name()))?;
    }
    if x.len() != m * k {
        invalid("x", format!("has {} elements, want {m} x {k}", x.len()))?;
    }
    if out.len() != m * n {
        invalid("out", format!("has {} elements, want {m} x {n}", out.len()))?;
    }
    if let Some(bias) = bias.filter(|bias| bias.len() != n) {
        invalid("bias", format!("has {} elements, want {n}", bias.len()))?;
    }
    // (every integer path runs on AVX2, FMA and F16C: the activations' quantizer takes them too)
    let activations = quantize_activations_on(use_simd, ActivationScheme::for_weights(ty), x);
    let blocks_per_row = k / ty.block_len();
    let columns = SharedColumns(out.as_mut_ptr());
    // The blocks of 32 take eight rows at a time on either integer path (eight_rows.rs), the
    // K-quants two on AVX-512 VNNI (k_quants.rs); each thread's rows are whole groups.
    #[cfg(target_arch = "x86_64")]
    let k_quant_tiles = ty.block_len() == 256 && m >= min_tokens_for_k_quant_tiles(ty);
    if let Some(path) = path.filter(|&path| ty.block_len() == 32 || path == Int8Path::Avx512Vnni || k_quant_tiles) {
        use super::eight_rows::{run_rows, Problem, GROUP_ROWS};
        let problem =
            Problem { ty, weight, row_bytes, activations: &activations, bias, first_token: 0, m, n, blocks_per_row };
        let block_tokens = tokens_per_pass_over_weights(k);
        // The K-quants for several tokens: sixteen rows interleaved at a time (k_quant_tiles.rs), the rows
        // past the last whole sixteen on the two-row kernel (the same bits).
        let tiles = k_quant_tiles;
        let (group, fewest) = if ty.block_len() == 32 {
            (GROUP_ROWS, 2 * GROUP_ROWS)
        } else if tiles && path == Int8Path::Avx2 {
            (super::k_quant_tiles_avx2::GROUP_ROWS, MIN_ROWS_PER_THREAD)
        } else if tiles {
            (super::k_quant_tiles::GROUP_ROWS, MIN_ROWS_PER_THREAD)
        } else {
            (2, MIN_ROWS_PER_THREAD)
        };
        let per_thread = n.div_ceil(num_threads.max(1)).next_multiple_of(group).max(fewest);
        let chunks: Vec<_> = (0..n).step_by(per_thread).map(|start| start..(start + per_thread).min(n)).collect();
        for_row_chunks(chunks, num_threads, |rows: std::ops::Range<usize>| {
            // SAFETY: token < m and row < n, so inside `out`; each row belongs to one chunk, claimed by
            // one thread. The problem was checked above; `path` came from `Int8Path::best()`, and a
            // block of 256 here is a K-quant on AVX-512 VNNI, or on AVX2 in tiles (the tiles: whole groups).
            let write = |token: usize, row: usize, value: f32| unsafe { columns.write(token * n + row, value) };
            for first_token in (0..m).step_by(block_tokens) {
                let problem = Problem { first_token, m: (first_token + block_tokens).min(m), ..problem };
                unsafe {
                    if ty.block_len() == 32 {
                        run_rows(path, &problem, rows.clone(), &write)
                    } else if tiles && path == Int8Path::Avx2 {
                        // (the rows past the last whole eight: one at a time, x86.rs)
                        let whole = rows.start + rows.len() / group * group;
                        super::k_quant_tiles_avx2::run_groups_avx2(&problem, rows.start..whole, &write);
                        for row in whole..rows.end {
                            let weights = &weight[row * row_bytes..(row + 1) * row_bytes];
                            for token in problem.first_token..problem.m {
                                let first = [token * blocks_per_row];
                                let [[value]] = dot_rows(ty, [weights], &activations, first, true);
                                write(token, row, value + bias.map_or(0.0, |bias| bias[row]));
                            }
                        }
                    } else if tiles {
                        let whole = rows.start + rows.len() / group * group;
                        super::k_quant_tiles::run_groups(&problem, rows.start..whole, &write);
                        if whole < rows.end {
                            super::k_quants::run_rows_k_quants(&problem, whole..rows.end, &write);
                        }
                    } else {
                        super::k_quants::run_rows_k_quants(&problem, rows.clone(), &write)
                    }
                };
            }
        });
        return Ok(());
    }
    // One run of rows per thread: each streams its weights from memory in one sequence. (Rows
    // claimed 16 at a time, in turn, made a decode step of the embedded model ~25% slower: every
    // claim moved the shared counter's cache line between cores, and the hardware prefetcher
    // restarted at every chunk.)
    let per_thread = n.div_ceil(num_threads.max(1)).next_multiple_of(2).max(MIN_ROWS_PER_THREAD);
    let chunks: Vec<_> = (0..n).step_by(per_thread).map(|start| start..(start + per_thread).min(n)).collect();
    for_row_chunks(chunks, num_threads, |rows: std::ops::Range<usize>| {
        let weights = |row: usize| &weight[row * row_bytes..(row + 1) * row_bytes];
        let write = |row: usize, token: usize, value: f32| {
            // SAFETY: token < m and row < n, so inside `out`; each row (output column) belongs to
            // one chunk, claimed by one thread, so no element is written twice.
            unsafe { columns.write(token * n + row, value + bias.map_or(0.0, |bias| bias[row])) };
        };
        // Groups of TOKENS_PER_PASS tokens share each read of a row.
        let whole_passes = m - m % TOKENS_PER_PASS;
        for row in rows.clone() {
            for token in (0..whole_passes).step_by(TOKENS_PER_PASS) {
                let first_blocks: [usize; TOKENS_PER_PASS] = std::array::from_fn(|t| (token + t) * blocks_per_row);
                let [values] = dot_rows(ty, [weights(row)], &activations, first_blocks, use_simd);
                values.into_iter().enumerate().for_each(|(t, value)| write(row, token + t, value));
            }
        }
        // The tokens left over (every token, at one) take rows in pairs, so that two sums overlap.
        for token in whole_passes..m {
            let first = [token * blocks_per_row];
            let mut row = rows.start;
            while row + 1 < rows.end {
                let [[a], [b]] = dot_rows(ty, [weights(row), weights(row + 1)], &activations, first, use_simd);
                write(row, token, a);
                write(row + 1, token, b);
                row += 2;
            }
            if row < rows.end {
                write(row, token, dot_rows(ty, [weights(row)], &activations, first, use_simd)[0][0]);
            }
        }
    });
    Ok(())
}

/// `out`'s pointer, shared by the threads that write its disjoint columns.
struct SharedColumns(*mut f32);
// SAFETY: the threads write disjoint elements (see `quantized_linear_on`).
unsafe impl Sync for SharedColumns {}

impl SharedColumns {
    /// # Safety
    /// `index` is inside the slice, and no other thread touches that element.
    unsafe fn write(&self, index: usize, value: f32) {
        self.0.add(index).write(value)
    }
}

/// out = the float32 values of `blocks` (whole `ty` blocks), on up to `num_threads` threads.
pub fn dequantize(ty: GgmlType, blocks: &[u8], out: &mut [f32], num_threads: usize) -> Result<()> {
    if !blocks.len().is_multiple_of(ty.block_bytes()) {
        invalid(
            "blocks",
            format!("has {} bytes, not whole {} blocks of {}", blocks.len(), ty.name(), ty.block_bytes()),
        )?;
    }
    let num_blocks = blocks.len() / ty.block_bytes();
    if out.len() != num_blocks * ty.block_len() {
        invalid("out", format!("has {} elements, want {num_blocks} blocks of {}", out.len(), ty.block_len()))?;
    }
    const BLOCKS_PER_CHUNK: usize = 256;
    let chunks: Vec<_> = blocks
        .chunks(BLOCKS_PER_CHUNK * ty.block_bytes())
        .zip(out.chunks_mut(BLOCKS_PER_CHUNK * ty.block_len()))
        .collect();
    let isa = Isa::best();
    for_row_chunks(chunks, num_threads, |(blocks, out): (&[u8], &mut [f32])| {
        with_isa(
            isa,
            #[inline(always)]
            || {
                for (block, values) in blocks.chunks_exact(ty.block_bytes()).zip(out.chunks_exact_mut(ty.block_len())) {
                    dequantize_block(ty, block, values);
                }
            },
        )
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_kernels::quantized::formats::f32_to_f16;

    /// A deterministic generator (xorshift), so tests need no crate.
    struct Random(u64);
    impl Random {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn uniform(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    /// Random blocks with sane f16 scales (small positive d, dmin; the 6-bit and int8 scales any).
    fn random_blocks(ty: GgmlType, num_blocks: usize, random: &mut Random) -> Vec<u8> {
        let mut bytes: Vec<u8> = (0..num_blocks * ty.block_bytes()).map(|_| random.next() as u8).collect();
        for block in bytes.chunks_exact_mut(ty.block_bytes()) {
            let mut half =
                |offset: usize, value: f32| block[offset..offset + 2].copy_from_slice(&f32_to_f16(value).to_le_bytes());
            match ty {
                GgmlType::Q6_K => half(208, 0.01 * (1.0 + random.uniform())),
                GgmlType::Q4_1 | GgmlType::Q4_K | GgmlType::Q5_K => {
                    half(0, 0.02 * (1.0 + random.uniform()));
                    half(2, 0.02 * random.uniform());
                }
                _ => half(0, 0.02 * (1.0 + random.uniform())),
            }
        }
        bytes
    }

    fn dequantized(ty: GgmlType, weight: &[u8]) -> Vec<f32> {
        let mut values = vec![0f32; weight.len() / ty.block_bytes() * ty.block_len()];
        dequantize(ty, weight, &mut values, 2).unwrap();
        values
    }

    #[test]
    fn avx2_equals_the_scalar_reference_bit_for_bit() {
        let mut random = Random(0x9e37_79b9_7f4a_7c15);
        for ty in GgmlType::ALL {
            let (m, n, k) = (5, 7, 2 * 256);
            let weight = random_blocks(ty, n * k / ty.block_len(), &mut random);
            let x: Vec<f32> = (0..m * k).map(|_| random.uniform() * 3.0).collect();
            let bias: Vec<f32> = (0..n).map(|_| random.uniform()).collect();
            let run = |isa: Isa, threads: usize| {
                let mut out = vec![0f32; m * n];
                quantized_linear(&mut out, &x, &weight, Some(&bias), ty, (m, n, k), threads, isa).unwrap();
                out
            };
            let reference = run(Isa::Portable, 1);
            if Isa::best() != Isa::Portable {
                assert_eq!(run(Isa::best(), 1), reference, "{ty:?}");
            }
            assert_eq!(run(Isa::best(), 3), reference, "{ty:?} threaded");
        }
    }

    /// Every integer path this CPU runs against the scalar reference, on shapes that leave partial
    /// groups of rows and partial tiles of tokens, several passes over the weights, and on the
    /// largest products the formats allow.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_int8_path_equals_the_scalar_reference_bit_for_bit() {
        let mut random = Random(7);
        let paths: Vec<_> = Int8Path::ALL.into_iter().filter(|path| path.is_supported()).collect();
        assert!(!paths.is_empty() || !std::is_x86_feature_detected!("avx2"));
        for ty in GgmlType::ALL {
            // (the last: more tokens than one pass over the weights takes, 32 of 16384 inputs)
            let passes = (45, 9, 16384 / ty.block_len());
            assert!(tokens_per_pass_over_weights(16384) < 45);
            // (the K-quants' interleaved tiles from min_tokens_for_k_quant_tiles, whole groups of 16
            // rows; the rest of the rows on the two-row kernel)
            let tiles = (13, 53, 3);
            assert!(tiles.0 >= min_tokens_for_k_quant_tiles(ty) && tiles.1 % 16 != 0);
            for (m, n, blocks) in [
                (1, 1, 1),
                (1, 8, 1),
                (2, 13, 2),
                (3, 17, 3),
                (4, 24, 5),
                (5, 31, 18),
                (9, 40, 2),
                (9, 16, 2),
                tiles,
                passes,
                (45, 17, 16384 / ty.block_len()),
            ] {
                let k = blocks * ty.block_len();
                let mut weight = random_blocks(ty, n * blocks, &mut random);
                let mut x: Vec<f32> = (0..m * k).map(|_| random.uniform() * 3.0).collect();
                if n == 8 || n == 16 {
                    // The largest products: every code (and K-quant scale) at its extreme, every x
                    // at +-amax.
                    let (extreme, codes) = match ty {
                        GgmlType::Q8_0 => (0x80, 2..34),
                        GgmlType::Q4_0 => (0xff, 2..18),
                        GgmlType::Q4_1 => (0xff, 4..20),
                        GgmlType::Q4_K => (0xff, 4..144),
                        GgmlType::Q5_K => (0xff, 4..176),
                        GgmlType::Q6_K => (0xff, 0..192),
                    };
                    for block in weight.chunks_exact_mut(ty.block_bytes()) {
                        block[codes.clone()].fill(extreme);
                        if ty == GgmlType::Q6_K {
                            block[192..208].fill(0x80);
                        }
                    }
                    x.iter_mut().enumerate().for_each(|(i, x)| *x = if (i / 32) % 2 == 0 { 5.0 } else { -5.0 });
                }
                let bias: Vec<f32> = (0..n).map(|_| random.uniform()).collect();
                let run = |path: Option<Int8Path>, threads: usize| {
                    let mut out = vec![0f32; m * n];
                    quantized_linear_on(path, &mut out, &x, &weight, Some(&bias), ty, (m, n, k), threads).unwrap();
                    out
                };
                let reference = run(None, 1);
                for &path in &paths {
                    for threads in [1, 3] {
                        assert_eq!(
                            run(Some(path), threads),
                            reference,
                            "{ty:?} {path:?} {m}x{n}x{k} {threads} threads"
                        );
                    }
                }
            }
        }
    }

    /// A token's outputs do not depend on which other tokens share the call.
    #[test]
    fn a_tokens_result_does_not_depend_on_its_batch() {
        let mut random = Random(11);
        for ty in GgmlType::ALL {
            let (m, n, k) = (11, 19, 256);
            let weight = random_blocks(ty, n * k / ty.block_len(), &mut random);
            let x: Vec<f32> = (0..m * k).map(|_| random.uniform()).collect();
            let mut all = vec![0f32; m * n];
            quantized_linear(&mut all, &x, &weight, None, ty, (m, n, k), 2, Isa::best()).unwrap();
            for token in 0..m {
                let mut one = vec![0f32; n];
                let row = &x[token * k..(token + 1) * k];
                quantized_linear(&mut one, row, &weight, None, ty, (1, n, k), 1, Isa::best()).unwrap();
                assert_eq!(one, all[token * n..(token + 1) * n], "{ty:?} token {token}");
            }
        }
    }

    #[test]
    fn matches_float64_on_the_dequantized_weights_within_activation_rounding() {
        let mut random = Random(42);
        for ty in GgmlType::ALL {
            let (m, n, k) = (3, 9, 512);
            let weight = random_blocks(ty, n * k / ty.block_len(), &mut random);
            let x: Vec<f32> = (0..m * k).map(|_| random.uniform()).collect();
            let mut out = vec![0f32; m * n];
            quantized_linear(&mut out, &x, &weight, None, ty, (m, n, k), 2, Isa::best()).unwrap();
            let w = dequantized(ty, &weight);
            for token in 0..m {
                let row_x = &x[token * k..(token + 1) * k];
                // Rounding x to 8 bits moves each element by at most half a step (amax / 254 per block).
                let step_bound = row_x
                    .chunks(ty.block_len())
                    .map(|block| block.iter().fold(0f32, |amax, value| amax.max(value.abs())) as f64 / 254.0)
                    .fold(0.0, f64::max);
                for row in 0..n {
                    let row_w = &w[row * k..(row + 1) * k];
                    let exact: f64 = row_x.iter().zip(row_w).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let bound = 1.01 * step_bound * row_w.iter().map(|&v| v.abs() as f64).sum::<f64>() + 1e-3;
                    let got = out[token * n + row] as f64;
                    assert!((got - exact).abs() <= bound, "{ty:?} [{token}, {row}]: {got} vs {exact} (bound {bound})");
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors_not_panics() {
        let weight = vec![0u8; 2 * 20];
        let mut out = vec![0f32; 2];
        assert!(
            quantized_linear(&mut out, &[0.0; 32], &weight, None, GgmlType::Q4_1, (1, 2, 32), 1, Isa::best()).is_ok()
        );
        assert!(
            quantized_linear(&mut out, &[0.0; 30], &weight, None, GgmlType::Q4_1, (1, 2, 30), 1, Isa::best()).is_err()
        );
        assert!(quantized_linear(&mut out, &[0.0; 32], &weight[1..], None, GgmlType::Q4_1, (1, 2, 32), 1, Isa::best())
            .is_err());
        assert!(quantized_linear(
            &mut out,
            &[0.0; 32],
            &weight,
            Some(&[0.0]),
            GgmlType::Q4_1,
            (1, 2, 32),
            1,
            Isa::best()
        )
        .is_err());
        assert!(dequantize(GgmlType::Q4_1, &weight[1..], &mut [0.0; 64], 1).is_err());
        assert!(dequantize(GgmlType::Q4_1, &weight, &mut [0.0; 63], 1).is_err());
    }
}

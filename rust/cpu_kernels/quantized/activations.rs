//! Activations quantized to 8 bits the way llama.cpp's reference quantizers do (ggml-quants.c,
//! `quantize_row_q8_0_ref`, `_q8_1_ref`, `_q8_K_ref`), so the weights' dot products run on integers:
//! Q8_0 for Q4_0 and Q8_0 weights, Q8_1 for Q4_1, Q8_K for the K-quants (Q4_K, Q5_K, Q6_K).

use super::formats::{f16_to_f32, f32_to_f16, GgmlType};

/// The 8-bit scheme a weight format's dot product takes.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationScheme {
    /// Blocks of 32: d = amax / 127 stored as f16, q = roundf(x / d) (ties away from zero).
    Q8_0,
    /// Q8_0 plus s = f16(d * sum(q)), which carries Q4_1's min term.
    Q8_1,
    /// Blocks of 256: d = max / -127 as f32 (max: the value of largest magnitude), q =
    /// nearest_int(x / d) (ties to even) capped at 127, and sums of each 16 q.
    Q8_K,
}

impl ActivationScheme {
    pub fn for_weights(ty: GgmlType) -> ActivationScheme {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q8_0 => ActivationScheme::Q8_0,
            GgmlType::Q4_1 => ActivationScheme::Q8_1,
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => ActivationScheme::Q8_K,
        }
    }
}

/// Rows of activations quantized block by block (rows are whole blocks, so block b of row m is
/// block m * blocks_per_row + b).
pub struct QuantizedActivations {
    pub block_len: usize,
    /// Each block's scale, as the dot product reads it (f16 schemes: already widened).
    pub scales: Vec<f32>,
    /// Q8_1's s per block (widened from f16); empty for the other schemes.
    pub sums: Vec<f32>,
    /// Q8_K's sums of each 16 q (16 per block); empty for the other schemes.
    pub sums_of_16: Vec<i32>,
    /// Q8_K's sums of each 32 q (8 per block, |sum| <= 32 * 127), for Q4_K's mins; empty for the
    /// other schemes.
    pub sums_of_32: Vec<i16>,
    /// Q8_0's and Q8_1's sum of q per block (exact), for weights read with an offset; empty for Q8_K.
    pub block_sums: Vec<i32>,
    pub quants: Vec<i8>,
}

/// Quantizes `values` (whole blocks) with `scheme`: with AVX2 where the CPU has it (the same
/// bits as the scalar code, which is ~10-20x slower: its rounding is a libm call per value).
pub fn quantize_activations(scheme: ActivationScheme, values: &[f32]) -> QuantizedActivations {
    quantize_activations_on(true, scheme, values)
}

fn avx2_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `quantize_activations` with AVX2 (`simd`, where the CPU has AVX2, FMA and F16C) or the scalar
/// reference.
pub(crate) fn quantize_activations_on(simd: bool, scheme: ActivationScheme, values: &[f32]) -> QuantizedActivations {
    let simd = simd && avx2_supported();
    let block_len = if scheme == ActivationScheme::Q8_K { 256 } else { 32 };
    assert!(values.len().is_multiple_of(block_len));
    let num_blocks = values.len() / block_len;
    let mut quantized = QuantizedActivations {
        block_len,
        scales: Vec::with_capacity(num_blocks),
        sums: Vec::new(),
        sums_of_16: Vec::new(),
        sums_of_32: Vec::new(),
        block_sums: Vec::new(),
        quants: vec![0; values.len()],
    };
    for (block, quants) in values.chunks_exact(block_len).zip(quantized.quants.chunks_exact_mut(block_len)) {
        if scheme == ActivationScheme::Q8_K {
            let first = quantized.sums_of_16.len();
            quantized.sums_of_16.resize(first + 16, 0);
            let sums_of_16 = &mut quantized.sums_of_16[first..];
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `simd` only where the CPU has AVX2, FMA and F16C (checked above); 256 values and quants.
            let scale = if simd {
                unsafe { x86::quantize_q8_k(block, quants, sums_of_16) }
            } else {
                quantize_q8_k(block, quants, sums_of_16)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let scale = quantize_q8_k(block, quants, sums_of_16);
            quantized.scales.push(scale);
            let sums_of_16 = &quantized.sums_of_16[first..];
            quantized.sums_of_32.extend(sums_of_16.chunks_exact(2).map(|pair| (pair[0] + pair[1]) as i16));
        } else {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above; 32 values and quants.
            let (scale, sum) =
                if simd { unsafe { x86::quantize_q8_0(block, quants) } } else { quantize_q8_0(block, quants) };
            #[cfg(not(target_arch = "x86_64"))]
            let (scale, sum) = quantize_q8_0(block, quants);
            quantized.scales.push(f16_to_f32(f32_to_f16(scale)));
            quantized.block_sums.push(sum);
            if scheme == ActivationScheme::Q8_1 {
                quantized.sums.push(f16_to_f32(f32_to_f16(sum as f32 * scale)));
            }
        }
    }
    quantized
}

/// One Q8_K block: its quants and sums of each 16 written, its scale returned.
fn quantize_q8_k(block: &[f32], quants: &mut [i8], sums_of_16: &mut [i32]) -> f32 {
    let (max, _) =
        block.iter().fold((0f32, 0f32), |(max, amax), &x| if x.abs() > amax { (x, x.abs()) } else { (max, amax) });
    let scale = if max == 0.0 {
        0.0
    } else {
        let inverse_scale = -127.0 / max;
        for (q, &x) in quants.iter_mut().zip(block) {
            *q = ((inverse_scale * x).round_ties_even() as i32).min(127) as i8;
        }
        1.0 / inverse_scale
    };
    for (sum, sixteen) in sums_of_16.iter_mut().zip(quants.chunks_exact(16)) {
        *sum = sixteen.iter().map(|&q| q as i32).sum();
    }
    scale
}

/// One Q8_0 block of 32: its quants written, (scale before f16 rounding, sum of quants) returned.
fn quantize_q8_0(block: &[f32], quants: &mut [i8]) -> (f32, i32) {
    let amax = block.iter().fold(0f32, |amax, &x| amax.max(x.abs()));
    let scale = amax / 127.0;
    let inverse_scale = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    for (q, &x) in quants.iter_mut().zip(block) {
        *q = (x * inverse_scale).round() as i8;
    }
    (scale, quants.iter().map(|&q| q as i32).sum())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The scalar quantizers' bits with AVX2: |x| and its maximum on 8 lanes (a NaN value is
    //! skipped, as `f32::max` and the scalar `>` skip it), products rounded by `round_ps` (to
    //! nearest even, or truncation plus a half-away-from-zero step), NaN products zeroed (as
    //! `NaN as i32`), and sums of quants by `sad_epu8` on the biased bytes.
    use std::arch::x86_64::*;

    /// |x| of 8 lanes, the largest |x| so far (a NaN |x| leaves it: max_ps returns its second operand).
    #[inline(always)]
    unsafe fn abs_max(values: &[f32]) -> (f32, __m256) {
        let sign = _mm256_set1_ps(-0.0);
        let mut amax = _mm256_setzero_ps();
        for eight in values.chunks_exact(8) {
            amax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(eight.as_ptr())), amax);
        }
        let half = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps::<1>(amax));
        let half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        let half = _mm_max_ss(half, _mm_shuffle_ps::<1>(half, half));
        (_mm_cvtss_f32(half), sign)
    }

    /// Four vectors of 8 integral floats in [-128, 127] as 32 int8, in element order.
    #[inline(always)]
    unsafe fn pack_32(rounded: [__m256; 4]) -> __m256i {
        let ints = rounded.map(|r| _mm256_cvttps_epi32(r));
        let words = [_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3])];
        // (the packs work within 128-bit halves: the permute puts the bytes back in order)
        _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words[0], words[1]), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// Sums of each 8 of 32 int8 (4 lanes of int64).
    #[inline(always)]
    unsafe fn sums_of_8(bytes: __m256i) -> [i64; 4] {
        let biased = _mm256_sad_epu8(_mm256_xor_si256(bytes, _mm256_set1_epi8(-128)), _mm256_setzero_si256());
        let mut sums = [0i64; 4];
        _mm256_storeu_si256(sums.as_mut_ptr() as *mut __m256i, biased);
        sums.map(|sum| sum - 8 * 128)
    }

    /// `super::quantize_q8_k`'s bits.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `block` and `quants` hold 256 values, `sums_of_16` 16.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_q8_k(block: &[f32], quants: &mut [i8], sums_of_16: &mut [i32]) -> f32 {
        assert!(block.len() == 256 && quants.len() == 256 && sums_of_16.len() == 16);
        let (amax, sign) = abs_max(block);
        if amax == 0.0 {
            sums_of_16.fill(0);
            quants.fill(0);
            return 0.0;
        }
        // The first value of that magnitude (the scalar fold keeps the first).
        let target = _mm256_set1_ps(amax);
        let mut max = 0.0;
        for (i, eight) in block.chunks_exact(8).enumerate() {
            let magnitudes = _mm256_andnot_ps(sign, _mm256_loadu_ps(eight.as_ptr()));
            let hits = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(magnitudes, target));
            if hits != 0 {
                max = block[8 * i + hits.trailing_zeros() as usize];
                break;
            }
        }
        let inverse_scale = -127.0 / max;
        let factor = _mm256_set1_ps(inverse_scale);
        let (limit, floor) = (_mm256_set1_ps(127.0), _mm256_set1_ps(-128.0));
        for (part, (values, out)) in block.chunks_exact(32).zip(quants.chunks_exact_mut(32)).enumerate() {
            let rounded: [__m256; 4] = std::array::from_fn(|i| {
                let product = _mm256_mul_ps(factor, _mm256_loadu_ps(values.as_ptr().add(8 * i)));
                // min(127) (a NaN stays: min_ps returns its second operand), then 0 for NaN and
                // below -128: the scalar's `as i32` makes those 0 and i32::MIN, whose low byte is 0.
                // (Products leave [-127, 127] only where the scale overflowed: a max below ~1e-36.)
                let rounded =
                    _mm256_min_ps(limit, _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(product));
                _mm256_and_ps(rounded, _mm256_cmp_ps::<_CMP_GE_OQ>(rounded, floor))
            });
            let bytes = pack_32(rounded);
            _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, bytes);
            let sums = sums_of_8(bytes);
            sums_of_16[2 * part] = (sums[0] + sums[1]) as i32;
            sums_of_16[2 * part + 1] = (sums[2] + sums[3]) as i32;
        }
        1.0 / inverse_scale
    }

    /// `super::quantize_q8_0`'s bits.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `block` and `quants` hold 32 values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_q8_0(block: &[f32], quants: &mut [i8]) -> (f32, i32) {
        assert!(block.len() == 32 && quants.len() == 32);
        let (amax, sign) = abs_max(block);
        let scale = amax / 127.0;
        let factor = _mm256_set1_ps(if scale != 0.0 { 1.0 / scale } else { 0.0 });
        let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
        let (limit, floor) = (_mm256_set1_ps(127.0), _mm256_set1_ps(-128.0));
        let rounded: [__m256; 4] = std::array::from_fn(|i| {
            let product = _mm256_mul_ps(_mm256_loadu_ps(block.as_ptr().add(8 * i)), factor);
            // Half away from zero (f32::round): the truncation, one more step away from zero where
            // the (exact) remainder is at least a half.
            let truncated = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(product);
            let remainder = _mm256_andnot_ps(sign, _mm256_sub_ps(product, truncated));
            let step = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(remainder, half), one);
            let rounded = _mm256_add_ps(truncated, _mm256_or_ps(step, _mm256_and_ps(product, sign)));
            // `as i8` saturates (an overflowed scale makes products infinite) and takes NaN to 0:
            // max_ps and min_ps keep a NaN second operand, the ordered mask zeroes it.
            let clamped = _mm256_min_ps(limit, _mm256_max_ps(floor, rounded));
            _mm256_and_ps(clamped, _mm256_cmp_ps::<_CMP_ORD_Q>(clamped, clamped))
        });
        let bytes = pack_32(rounded);
        _mm256_storeu_si256(quants.as_mut_ptr() as *mut __m256i, bytes);
        (scale, sums_of_8(bytes).iter().sum::<i64>() as i32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_rounds_ties_away_from_zero_and_q8_k_to_even() {
        // amax 127: scale 1, so x / d is x itself.
        let mut values = vec![0f32; 32];
        (values[0], values[1], values[2]) = (127.0, 2.5, -2.5);
        let q8_0 = quantize_activations(ActivationScheme::Q8_0, &values);
        assert_eq!((q8_0.scales[0], q8_0.quants[1], q8_0.quants[2]), (1.0, 3, -3));
        let mut values = vec![0f32; 256];
        (values[0], values[1], values[2]) = (-127.0, 2.5, -2.5);
        let q8_k = quantize_activations(ActivationScheme::Q8_K, &values);
        assert_eq!((q8_k.scales[0], q8_k.quants[0], q8_k.quants[1], q8_k.quants[2]), (1.0, -127, 2, -2));
        assert_eq!(q8_k.sums_of_16[0], -127);
    }

    /// The AVX2 quantizers give the scalar reference's bits, on values that reach every branch:
    /// ties at .5 (after scaling), magnitudes tied between signs, zeros and negative zeros, NaN,
    /// infinities, and tiny maxima whose scale overflows.
    #[test]
    fn simd_quantizers_give_the_scalar_bits() {
        if !avx2_supported() {
            eprintln!("no AVX2 here: the scalar quantizers alone");
            return;
        }
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let specials = [
            0.0,
            -0.0,
            0.5,
            -0.5,
            2.5,
            -2.5,
            127.0,
            -127.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-39,
            -1e-39,
            1e-37,
            f32::MIN_POSITIVE,
            3e38,
            -3e38,
        ];
        for case in 0..3000 {
            let mut values = vec![0f32; 512];
            let magnitude = [1.0, 1e-3, 1e30, 1e-38, 127.0][case % 5];
            for value in values.iter_mut() {
                let bits = next();
                *value = match bits % 8 {
                    0 => specials[(bits >> 8) as usize % specials.len()],
                    1 => ((bits >> 8) % 255) as f32 - 127.0 + 0.5, // (x.5 after a scale of 1)
                    _ => ((bits >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * magnitude,
                };
            }
            if case % 7 == 0 {
                values.iter_mut().for_each(|value| *value = if value.is_nan() { 1.0 } else { *value });
            }
            if case % 11 == 0 {
                let first = (next() % 256) as usize;
                (values[first], values[(first + 37) % 256]) = (-4.0, 4.0); // (tied magnitudes, either order)
            }
            for scheme in [ActivationScheme::Q8_0, ActivationScheme::Q8_1, ActivationScheme::Q8_K] {
                let (simd, scalar) =
                    (quantize_activations_on(true, scheme, &values), quantize_activations_on(false, scheme, &values));
                assert_eq!(simd.quants, scalar.quants, "{scheme:?} case {case}");
                assert_eq!(
                    simd.scales.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    scalar.scales.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "{scheme:?} case {case}"
                );
                assert_eq!(
                    simd.sums.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    scalar.sums.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "{scheme:?} case {case}"
                );
                assert_eq!(
                    (&simd.sums_of_16, &simd.sums_of_32, &simd.block_sums),
                    (&scalar.sums_of_16, &scalar.sums_of_32, &scalar.block_sums),
                    "{scheme:?} case {case}"
                );
            }
        }
    }

    #[test]
    fn zero_blocks_quantize_to_zero() {
        let q8_1 = quantize_activations(ActivationScheme::Q8_1, &[0.0; 64]);
        assert_eq!((q8_1.scales.clone(), q8_1.sums.clone()), (vec![0.0; 2], vec![0.0; 2]));
        assert!(q8_1.quants.iter().all(|&q| q == 0));
    }
}

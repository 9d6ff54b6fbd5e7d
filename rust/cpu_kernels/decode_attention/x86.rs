//! The decode kernel's x86 loads and dot products: cache elements widened to f32 (bfloat16 and
//! float8 exactly) and 16-lane dot products, for the AVX-512 and AVX2 paths.

use std::arch::x86_64::*;

use super::Element;
use crate::cpu_kernels::simd::ElementKind;

/// 16 cache elements at `p`, widened to f32 exactly (bf16: zero-extend, shift into the
/// high half; float8: through an IEEE half, see `e5m2x16` and `e4m3x16`).
#[inline(always)]
unsafe fn load16<T: Element>(p: *const T) -> __m512 {
    match T::KIND {
        ElementKind::F32 => _mm512_loadu_ps(p as *const f32),
        ElementKind::Bf16 => {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i))))
        }
        ElementKind::Fp8E4m3 => e4m3x16(p as *const u8),
        ElementKind::Fp8E5m2 => e5m2x16(p as *const u8),
    }
}

/// 16 e5m2 codes: each is the high byte of an IEEE half (same sign, exponent width and
/// bias), so the half -> f32 conversion widens it exactly, subnormals, infinities and NaNs
/// included.
#[inline(always)]
unsafe fn e5m2x16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i))))
}

/// 16 e4m3 codes: with the sign moved to bit 15 and the magnitude to bits 7..13, a half
/// reads value * 2^-8, subnormals included (a half's exponent has one more bit, bias 15 =
/// 7 + 8), so the exact half -> f32 conversion times 256 widens them. The NaN code reads
/// as +-480, beyond e4m3's largest value (448), and is replaced.
#[inline(always)]
unsafe fn e4m3x16(p: *const u8) -> __m512 {
    let codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
    // The arithmetic shift also copies the sign into bit 14, which the mask clears.
    let halves =
        _mm256_and_si256(_mm256_srai_epi16::<1>(_mm256_slli_epi16::<8>(codes)), _mm256_set1_epi16(0xbfffu16 as i16));
    let value = _mm512_mul_ps(_mm512_cvtph_ps(halves), _mm512_set1_ps(256.0));
    let nan = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(value), _mm512_set1_ps(480.0));
    _mm512_mask_mov_ps(value, nan, _mm512_set1_ps(f32::NAN))
}

#[inline(always)]
unsafe fn load8<T: Element>(p: *const T) -> __m256 {
    match T::KIND {
        ElementKind::F32 => _mm256_loadu_ps(p as *const f32),
        ElementKind::Bf16 => {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))))
        }
        ElementKind::Fp8E4m3 => e4m3x8(p as *const u8),
        ElementKind::Fp8E5m2 => e5m2x8(p as *const u8),
    }
}

/// `e5m2x16` for 8 codes, with AVX2 and F16C.
#[inline(always)]
unsafe fn e5m2x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_slli_epi16::<8>(_mm_cvtepu8_epi16(_mm_loadl_epi64(p as *const __m128i))))
}

/// `e4m3x16` for 8 codes, with AVX2 and F16C.
#[inline(always)]
unsafe fn e4m3x8(p: *const u8) -> __m256 {
    let codes = _mm_cvtepu8_epi16(_mm_loadl_epi64(p as *const __m128i));
    let halves = _mm_and_si128(_mm_srai_epi16::<1>(_mm_slli_epi16::<8>(codes)), _mm_set1_epi16(0xbfffu16 as i16));
    let value = _mm256_mul_ps(_mm256_cvtph_ps(halves), _mm256_set1_ps(256.0));
    let magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0), value);
    let nan = _mm256_cmp_ps::<_CMP_EQ_OQ>(magnitude, _mm256_set1_ps(480.0));
    _mm256_blendv_ps(value, _mm256_set1_ps(f32::NAN), nan)
}

/// dst = src through `load16`; equal lengths, a multiple of 16; needs AVX-512F.
#[inline(always)]
pub unsafe fn widen16<T: Element>(src: &[T], dst: &mut [f32]) {
    for i in (0..src.len()).step_by(16) {
        _mm512_storeu_ps(dst.as_mut_ptr().add(i), load16(src.as_ptr().add(i)));
    }
}

/// dst = src through `load8`; equal lengths, a multiple of 8; needs AVX2.
#[inline(always)]
pub unsafe fn widen8<T: Element>(src: &[T], dst: &mut [f32]) {
    for i in (0..src.len()).step_by(8) {
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), load8(src.as_ptr().add(i)));
    }
}

/// Every element of `codes` (a multiple of 16 long) through `load16`, for tests.
#[cfg(test)]
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn widen_all_avx512<T: Element>(codes: &[T]) -> Vec<f32> {
    let mut out = vec![0.0f32; codes.len()];
    widen16(codes, &mut out);
    out
}

/// Every element of `codes` (a multiple of 8 long) through `load8`, for tests.
#[cfg(test)]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn widen_all_avx2<T: Element>(codes: &[T]) -> Vec<f32> {
    let mut out = vec![0.0f32; codes.len()];
    widen8(codes, &mut out);
    out
}

/// a . b for lengths that are multiples of 16, two accumulators; needs AVX-512F.
#[inline(always)]
pub unsafe fn dot16<T: Element>(a: &[f32], b: &[T]) -> f32 {
    let (mut even, mut odd) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut i = 0;
    while i + 32 <= a.len() {
        even = _mm512_fmadd_ps(_mm512_loadu_ps(a.as_ptr().add(i)), load16(b.as_ptr().add(i)), even);
        odd = _mm512_fmadd_ps(_mm512_loadu_ps(a.as_ptr().add(i + 16)), load16(b.as_ptr().add(i + 16)), odd);
        i += 32;
    }
    if i < a.len() {
        even = _mm512_fmadd_ps(_mm512_loadu_ps(a.as_ptr().add(i)), load16(b.as_ptr().add(i)), even);
    }
    _mm512_reduce_add_ps(_mm512_add_ps(even, odd))
}

/// a . b for lengths that are multiples of 8, two accumulators; needs AVX2 and FMA.
#[inline(always)]
pub unsafe fn dot8<T: Element>(a: &[f32], b: &[T]) -> f32 {
    let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 16 <= a.len() {
        even = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), load8(b.as_ptr().add(i)), even);
        odd = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i + 8)), load8(b.as_ptr().add(i + 8)), odd);
        i += 16;
    }
    if i < a.len() {
        even = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), load8(b.as_ptr().add(i)), even);
    }
    let sum = _mm256_add_ps(even, odd);
    let quad = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
}

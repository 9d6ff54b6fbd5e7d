// Shared by every pagedkv kernel: dtypes, header-free conversions, 16-byte vector loads.
//
// The kernels are compiled by NVRTC (through CuPy) with no CUDA headers on the include
// path, so half/bfloat16 conversions are written out here. With PAGEDKV_EMULATION the same
// source compiles as host C++ against emu/cuda_emu.h, which is how CI checks the kernels'
// results without a GPU.
#pragma once

#ifdef PAGEDKV_EMULATION
#include "emu/cuda_emu.h"
#endif

namespace pagedkv {

// Element types: DT (queries, outputs, new keys/values) is F32, F16 or BF16; CT (the KV cache)
// is DT or a float8 format (kv_cache_dtype="fp8"), widened to float on reading.
enum DType { F32 = 0, F16 = 1, BF16 = 2, FP8_E4M3 = 3, FP8_E5M2 = 4 };

template <int DT> struct Element { using type = unsigned short; };  // f16 and bf16 bits
template <> struct Element<F32> { using type = float; };
template <> struct Element<FP8_E4M3> { using type = unsigned char; };
template <> struct Element<FP8_E5M2> { using type = unsigned char; };

struct alignas(16) Vec16 { unsigned int x, y, z, w; };  // one 16-byte load or store

__device__ __forceinline__ float neg_infinity() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float half_to_float(unsigned short h) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  unsigned int sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    float magnitude = (float)mantissa * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return __uint_as_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
#endif
}

__device__ __forceinline__ unsigned short float_to_half(float f) {
#ifdef __CUDA_ARCH__
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  unsigned int bits = __float_as_uint(f), sign = (bits >> 16) & 0x8000u;
  unsigned int magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);  // NaN
  if (magnitude >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // rounds to inf
  if (magnitude < 0x38800000u) {  // subnormal half: round magnitude / 2^-24 to nearest even
    float scaled = __uint_as_float(magnitude) * 16777216.0f;
    unsigned int whole = (unsigned int)scaled;
    float rest = scaled - (float)whole;
    if (rest > 0.5f || (rest == 0.5f && (whole & 1u))) whole++;
    return (unsigned short)(sign | whole);
  }
  unsigned int rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
  return (unsigned short)(sign | ((rounded - 0x38000000u) >> 13));
#endif
}

__device__ __forceinline__ float bf16_to_float(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }

__device__ __forceinline__ unsigned short float_to_bf16(float f) {
  unsigned int bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return (unsigned short)(bits >> 16);
}

// e5m2 is the high byte of an IEEE half (same sign, exponent width and bias): exact.
__device__ __forceinline__ float e5m2_to_float(unsigned char code) { return half_to_float((unsigned short)(code << 8)); }

// e4m3 with its sign moved to bit 15 and its magnitude to bits 7..13 reads as a half of
// value * 2^-8, subnormals included (a half's exponent has one more bit, bias 15 = 7 + 8).
__device__ __forceinline__ float e4m3_to_float(unsigned char code) {
  if ((code & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u);  // the NaN code
  return half_to_float((unsigned short)(((code & 0x80u) << 8) | ((code & 0x7fu) << 7))) * 256.f;
}

// The float8 code nearest f (ties to even) of a format with MANTISSA mantissa bits and exponent
// bias BIAS, saturating at max_code (infinities too); NaN becomes nan_code. As rust/cpu_kernels/fp8.rs.
template <int MANTISSA, int BIAS>
__device__ __forceinline__ unsigned char float_to_fp8(float f, unsigned int max_code, unsigned int nan_code) {
  const unsigned int bits = __float_as_uint(f), sign = (bits >> 24) & 0x80u;
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (unsigned char)(sign | nan_code);
  const unsigned int magnitude_bits = min(bits & 0x7fffffffu, 0x7f7fffffu);
  // Below the smallest normal exponent the spacing stays that of the subnormals.
  const int exponent = max((int)(magnitude_bits >> 23) - 127, 1 - BIAS);
  const float quantum = __uint_as_float((unsigned int)(exponent - MANTISSA + 127) << 23);
  // Quanta from the exponent's first value (a power-of-two division: exact); a mantissa that
  // rounds up to the next power of two carries into the exponent by itself.
  const unsigned int steps = (unsigned int)rintf(__uint_as_float(magnitude_bits) / quantum);
  const unsigned int code = ((unsigned int)(exponent + BIAS - 1) << MANTISSA) + steps;
  return (unsigned char)(sign | min(code, max_code));
}

template <int DT> __device__ __forceinline__ float to_float(typename Element<DT>::type x);
template <> __device__ __forceinline__ float to_float<F32>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<F16>(unsigned short x) { return half_to_float(x); }
template <> __device__ __forceinline__ float to_float<BF16>(unsigned short x) { return bf16_to_float(x); }
template <> __device__ __forceinline__ float to_float<FP8_E4M3>(unsigned char x) { return e4m3_to_float(x); }
template <> __device__ __forceinline__ float to_float<FP8_E5M2>(unsigned char x) { return e5m2_to_float(x); }

template <int DT> __device__ __forceinline__ typename Element<DT>::type from_float(float x);
template <> __device__ __forceinline__ float from_float<F32>(float x) { return x; }
template <> __device__ __forceinline__ unsigned short from_float<F16>(float x) { return float_to_half(x); }
template <> __device__ __forceinline__ unsigned short from_float<BF16>(float x) { return float_to_bf16(x); }
template <> __device__ __forceinline__ unsigned char from_float<FP8_E4M3>(float x) { return float_to_fp8<3, 7>(x, 0x7eu, 0x7fu); }
template <> __device__ __forceinline__ unsigned char from_float<FP8_E5M2>(float x) { return float_to_fp8<2, 15>(x, 0x7bu, 0x7eu); }

// Elements per 16-byte vector: 4 floats, 8 halves or 16 float8 codes.
template <int DT> struct VecWidth { static constexpr int value = 16 / (int)sizeof(typename Element<DT>::type); };

// 16 bytes at `source` (16-byte aligned), as they are: loads are issued early and kept narrow
// (4 registers) until used, so more of them fit in flight.
template <typename T>
__device__ __forceinline__ Vec16 load_raw(const T* source) { return *reinterpret_cast<const Vec16*>(source); }

// The VecWidth<DT> elements of a 16-byte vector, widened to floats.
template <int DT>
__device__ __forceinline__ void widen(const Vec16& raw, float* out) {
  const typename Element<DT>::type* elements = reinterpret_cast<const typename Element<DT>::type*>(&raw);
#pragma unroll
  for (int i = 0; i < VecWidth<DT>::value; ++i) out[i] = to_float<DT>(elements[i]);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// Ada and Hopper convert two e4m3 codes to two exact halves in one instruction.
template <>
__device__ __forceinline__ void widen<FP8_E4M3>(const Vec16& raw, float* out) {
  const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int w = 0; w < 4; ++w)
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      unsigned int halves;
      const unsigned short codes = (unsigned short)(words[w] >> (16 * pair));
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(codes));
      out[4 * w + 2 * pair] = half_to_float((unsigned short)(halves & 0xffffu));
      out[4 * w + 2 * pair + 1] = half_to_float((unsigned short)(halves >> 16));
    }
}
#endif

// Loads 16 bytes at `source` (16-byte aligned) and widens them to floats.
template <int DT>
__device__ __forceinline__ void load_vec(const typename Element<DT>::type* source, float* out) {
  widen<DT>(load_raw(source), out);
}

// Loads N elements at `source` (16-byte aligned, N a multiple of the vector width) as floats.
template <int DT, int N>
__device__ __forceinline__ void load_elements(const typename Element<DT>::type* source, float* out) {
#pragma unroll
  for (int i = 0; i < N; i += VecWidth<DT>::value) load_vec<DT>(source + i, out + i);
}

template <typename T>
__device__ __forceinline__ T warp_xor_sum(T value, int first_mask, int last_mask) {
#pragma unroll
  for (int mask = first_mask; mask >= last_mask; mask >>= 1) value += __shfl_xor_sync(0xffffffffu, value, mask);
  return value;
}

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int mask = 16; mask >= 1; mask >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, mask));
  return value;
}

}  // namespace pagedkv

// Dynamic shared memory as a float array (a plain pointer under emulation).
#ifdef PAGEDKV_EMULATION
#define PAGEDKV_SHARED_FLOATS(name) float* name = emu::dynamic_shared_memory()
#else
#define PAGEDKV_SHARED_FLOATS(name) extern __shared__ float name[]
#endif

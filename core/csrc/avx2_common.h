// Scalar and 8-lane helpers shared by the AVX2 translation units
// (kernels_avx2.cpp, ops_avx2.cpp). Include it from those files only: every
// helper has internal linkage, so no AVX2 code can be merged into objects
// built for baseline x86-64.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace loom_cpu {
namespace {

// ---------------------------------------------------------------------------
// Scalars and small vectors

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  if (f != f) {
    return 0x7FC0;
  }
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += ((u >> 16) & 1) + 0x7FFFu;
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t v) {
  return _cvtsh_ss(v);
}

inline uint16_t f32_to_f16(float f) {
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

inline float load_scalar(const void* base, int dtype, size_t i) {
  switch (dtype) {
    case kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case kF16:
      return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

inline void store_scalar(void* base, int dtype, size_t i, float v) {
  switch (dtype) {
    case kBF16:
      static_cast<uint16_t*>(base)[i] = f32_to_bf16(v);
      break;
    case kF16:
      static_cast<uint16_t*>(base)[i] = f32_to_f16(v);
      break;
    default:
      static_cast<float*>(base)[i] = v;
  }
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  lo = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, lo);
  lo = _mm_add_ss(lo, sh);
  return _mm_cvtss_f32(lo);
}

inline __m256 load_bf16x8(const uint16_t* p) {
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

inline __m256 load_f16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

}  // namespace
}  // namespace loom_cpu

#include <immintrin.h>

#include "activations.h"
#include "avx2_common.h"

namespace loom_cpu {

namespace {

// exp(x) for x <= 0 (and NaN): 2^(x log2 e) split at the nearest integer, a
// degree-6 polynomial in the fraction (Cephes constants, as MLX's CPU exp),
// the integer shifted into the exponent; 0 below -88, NaN kept.
inline __m256 exp_nonpositive(__m256 x_in) {
  const __m256 x = _mm256_mul_ps(x_in, _mm256_set1_ps(1.442695f));
  const __m256 ipart = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, ipart);
  const __m256 p = exp2_fraction(f);
  // Clamp the integer part before the shift (a NaN or far-negative lane
  // must not wrap the exponent); those lanes are replaced below.
  const __m256 safe = _mm256_max_ps(ipart, _mm256_set1_ps(-127.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(safe), _mm256_set1_epi32(127)), 23);
  __m256 r = _mm256_mul_ps(_mm256_castsi256_ps(e), p);
  r = _mm256_blendv_ps(
      r, _mm256_setzero_ps(), _mm256_cmp_ps(x_in, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
  return _mm256_blendv_ps(r, x_in, _mm256_cmp_ps(x_in, x_in, _CMP_UNORD_Q));
}

// tanh(|u|) = (1 - e) / (1 + e), e = exp(-2|u|) in (0, 1]; the sign put back.
// An infinite u gives e = 0 and +-1; a NaN stays NaN.
inline __m256 tanh8(__m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 au = _mm256_andnot_ps(sign, u);
  const __m256 e = exp_nonpositive(_mm256_mul_ps(_mm256_set1_ps(-2.0f), au));
  const __m256 t_abs = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_or_ps(t_abs, _mm256_and_ps(sign, u));
}

inline __m256 gelu_tanh_mul8(__m256 x, __m256 up) {
  const __m256 one = _mm256_set1_ps(1.0f);
  // MLX's order: sqrt(2/pi) * (x + 0.044715 * x^3).
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 inner = _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044715f), x3));
  const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), inner);
  const __m256 t = tanh8(u);
  const __m256 half_x = _mm256_mul_ps(_mm256_set1_ps(0.5f), x);
  return _mm256_mul_ps(_mm256_mul_ps(half_x, _mm256_add_ps(one, t)), up);
}

}  // namespace

void gelu_tanh_mul(const float* gate, const float* up, float* out, size_t i0, size_t i1) {
  map_lanes2(gate, up, out, i0, i1, gelu_tanh_mul8);
}

void softcap(const float* x, float cap, float* out, size_t i0, size_t i1) {
  const __m256 c = _mm256_set1_ps(cap);
  // map_lanes2 over x twice: the second operand is unused.
  map_lanes2(x, x, out, i0, i1, [c](__m256 v, __m256) {
    return _mm256_mul_ps(tanh8(_mm256_div_ps(v, c)), c);
  });
}

}  // namespace loom_cpu

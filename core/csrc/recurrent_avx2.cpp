#include <immintrin.h>

#include "recurrent.h"

namespace loom_cpu {

namespace {

inline float hsum(__m256 v) {
  const __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

}  // namespace

void gated_delta_head_step(
    const float* q,
    const float* k,
    const float* v,
    float g,
    float beta,
    float* s,
    float* y,
    int Dv,
    int Dk) {
  const int D8 = Dk - Dk % 8;
  const __m256 vg = _mm256_set1_ps(g);
  for (int i = 0; i < Dv; ++i) {
    float* row = s + static_cast<size_t>(i) * Dk;
    // Decay the row and read it out against the key.
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < D8; j += 8) {
      const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(row + j), vg);
      _mm256_storeu_ps(row + j, r);
      acc = _mm256_fmadd_ps(r, _mm256_loadu_ps(k + j), acc);
    }
    float kv = hsum(acc);
    for (int j = D8; j < Dk; ++j) {
      row[j] *= g;
      kv += row[j] * k[j];
    }
    const float delta = (v[i] - kv) * beta;
    // The rank-one update, and the row read out against the query.
    const __m256 vd = _mm256_set1_ps(delta);
    acc = _mm256_setzero_ps();
    for (int j = 0; j < D8; j += 8) {
      const __m256 r = _mm256_fmadd_ps(_mm256_loadu_ps(k + j), vd, _mm256_loadu_ps(row + j));
      _mm256_storeu_ps(row + j, r);
      acc = _mm256_fmadd_ps(r, _mm256_loadu_ps(q + j), acc);
    }
    float out = hsum(acc);
    for (int j = D8; j < Dk; ++j) {
      row[j] += k[j] * delta;
      out += row[j] * q[j];
    }
    y[i] = out;
  }
}

}  // namespace loom_cpu

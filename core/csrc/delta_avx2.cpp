// The gated delta rule's steps for one (batch row, value head), compiled for
// AVX2/FMA (runs after the CPU check, like the other kernels). Each dot
// product sums in eight fixed lanes, then the lanes in a fixed tree, so a
// result depends only on its inputs: a padded row equals the row alone, and
// a replay equals the forward's state over the same steps.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "native_delta.h"

namespace loom_cpu {

namespace {

inline float lanes_sum(__m256 a) {
  __m128 lo = _mm256_castps256_ps128(a);
  __m128 hi = _mm256_extractf128_ps(a, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

}  // namespace

void gated_delta_head(const DeltaHead& h) {
  const int Dk = h.Dk;
  const int full = Dk / 8 * 8;
  // Where the state is read from: the state before the chunk until a step
  // has run, then s in place. Reading it there (rather than copying it to
  // s first) spares a pass over every row's state each decode step.
  const float* from = h.s_in;
  for (int t = 0; t < h.T; ++t) {
    const float* q = h.q + t * h.qk_step;
    const float* k = h.k + t * h.qk_step;
    const float* v = h.v + t * h.v_step;
    float* y = h.y + t * h.v_step;
    if (h.mask != nullptr && !h.mask[t]) {
      for (int i = 0; i < h.Dv; ++i) {
        y[i] = 0.0f;
      }
      continue;
    }
    const float decay = h.g[t * h.g_step];
    const float rate = h.beta[t * h.g_step];
    const __m256 vdecay = _mm256_set1_ps(decay);
    for (int i = 0; i < h.Dv; ++i) {
      float* s = h.s + static_cast<long>(i) * Dk;
      const float* src = from + static_cast<long>(i) * Dk;
      __m256 acc = _mm256_setzero_ps();
      int j = 0;
      for (; j < full; j += 8) {
        const __m256 sj = _mm256_mul_ps(_mm256_loadu_ps(src + j), vdecay);
        _mm256_storeu_ps(s + j, sj);
        acc = _mm256_fmadd_ps(sj, _mm256_loadu_ps(k + j), acc);
      }
      float kv = lanes_sum(acc);
      for (; j < Dk; ++j) {
        s[j] = src[j] * decay;
        kv += s[j] * k[j];
      }
      const float d = (v[i] - kv) * rate;
      const __m256 vd = _mm256_set1_ps(d);
      __m256 out = _mm256_setzero_ps();
      j = 0;
      for (; j < full; j += 8) {
        const __m256 sj = _mm256_fmadd_ps(_mm256_loadu_ps(k + j), vd, _mm256_loadu_ps(s + j));
        _mm256_storeu_ps(s + j, sj);
        out = _mm256_fmadd_ps(sj, _mm256_loadu_ps(q + j), out);
      }
      float o = lanes_sum(out);
      for (; j < Dk; ++j) {
        s[j] += k[j] * d;
        o += s[j] * q[j];
      }
      y[i] = o;
    }
    from = h.s;
  }
  if (from != h.s) {
    // No step ran (every one masked): the state passes through unchanged.
    std::memcpy(h.s, from, sizeof(float) * static_cast<size_t>(h.Dv) * Dk);
  }
}

void conv_silu_rows(const float* x, const float* w, float* y, int C, int K, int t0, int t1) {
  for (int t = t0; t < t1; ++t) {
    float* out = y + static_cast<long>(t) * C;
    for (int c = 0; c < C; ++c) {
      out[c] = 0.0f;
    }
    for (int j = 0; j < K; ++j) {
      const float* in = x + static_cast<long>(t + j) * C;
      for (int c = 0; c < C; ++c) {
        out[c] += in[c] * w[static_cast<long>(c) * K + j];
      }
    }
    for (int c = 0; c < C; ++c) {
      out[c] = out[c] / (1.0f + std::exp(-out[c]));
    }
  }
}

}  // namespace loom_cpu

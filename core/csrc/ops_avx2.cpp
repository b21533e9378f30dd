// RMS norm, rotary embedding, softmax attention and the SwiGLU gate: AVX2 +
// FMA + F16C, fp32 arithmetic. Built with the same flags and the same rule as
// kernels_avx2.cpp: no C++ library header with templates or inline
// functions, helpers with internal linkage only.
//
// Numerics: inputs become fp32 exactly (bf16/fp16), every sum accumulates in
// fp32, outputs are rounded once to their dtype (bf16 as MLX rounds it).
// These are not MLX's operation orders, so results differ from MLX's
// fallbacks by fp32 rounding (the tests bound it), never by a dtype: MLX's
// half-precision fallbacks round intermediate results, these do not. The
// SwiGLU gate is the exception: it repeats MLX's own operations (below).

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "avx2_common.h"
#include "ops.h"

namespace loom_cpu {
namespace {

// x[0:n] (in dtype) into dst as fp32.
inline void row_to_f32(const void* x, int dtype, size_t first, int n, float* dst) {
  to_f32(
      static_cast<const char*>(x) + first * (dtype == kF32 ? 4 : 2), dtype, dst,
      static_cast<size_t>(n));
}

inline void row_store(void* out, int dtype, size_t first, const float* src, int n) {
  if (dtype == kF32) {
    __builtin_memcpy(static_cast<float*>(out) + first, src, sizeof(float) * n);
    return;
  }
  for (int i = 0; i < n; ++i) {
    store_scalar(out, dtype, first + i, src[i]);
  }
}

inline float dot(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  }
  float s = hsum(acc);
  for (; i < n; ++i) {
    s = __builtin_fmaf(a[i], b[i], s);
  }
  return s;
}

// y += a * x
inline void axpy(float a, const float* x, float* y, int n) {
  const __m256 av = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) {
    y[i] = __builtin_fmaf(a, x[i], y[i]);
  }
}


}  // namespace

void rms_norm_rows(const NormJob& job, int r0, int r1) {
  const int D = job.D;
  alignas(32) float buf[kMaxNormWidth];
  alignas(32) float w[kMaxNormWidth];
  if (job.w != nullptr) {
    row_to_f32(job.w, job.w_dtype, 0, D, w);
  }
  for (int r = r0; r < r1; ++r) {
    const size_t first = static_cast<size_t>(r) * D;
    row_to_f32(job.x, job.x_dtype, first, D, buf);
    const float ms = dot(buf, buf, D) / static_cast<float>(D);
    const float inv = 1.0f / __builtin_sqrtf(ms + job.eps);
    const __m256 iv = _mm256_set1_ps(inv);
    int i = 0;
    if (job.w != nullptr) {
      for (; i + 8 <= D; i += 8) {
        _mm256_storeu_ps(
            buf + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(buf + i), iv), _mm256_loadu_ps(w + i)));
      }
      for (; i < D; ++i) {
        buf[i] = buf[i] * inv * w[i];
      }
    } else {
      for (; i + 8 <= D; i += 8) {
        _mm256_storeu_ps(buf + i, _mm256_mul_ps(_mm256_loadu_ps(buf + i), iv));
      }
      for (; i < D; ++i) {
        buf[i] = buf[i] * inv;
      }
    }
    row_store(job.out, job.out_dtype, first, buf, D);
  }
}

void rope_rows(const RopeJob& job, int r0, int r1) {
  const int D = job.D;
  const int half = job.dims / 2;
  const int per_offset = job.n_offsets > 1 ? job.R / job.n_offsets : job.R;
  alignas(32) float buf[kMaxRopeWidth];
  alignas(32) float cosv[kMaxRopeWidth / 2];
  alignas(32) float sinv[kMaxRopeWidth / 2];
  // Positions outermost: every head of a row shares its angles, so they are
  // computed once per position (per offset group), not once per head.
  // Positions are int64 here so no offset can overflow; `have` marks whether
  // cosv/sinv hold the angles of `angles_for` (no position value doubles as
  // "none yet": a sentinel of -1 once skipped the first computation).
  for (int l = 0; l < job.L; ++l) {
    int64_t angles_for = 0;
    bool have = false;
    for (int r = r0; r < r1; ++r) {
      const int64_t position =
          static_cast<int64_t>(job.offsets[job.n_offsets > 1 ? r / per_offset : 0]) + l;
      if (!have || position != angles_for) {
        have = true;
        angles_for = position;
        const float pos = static_cast<float>(position) * job.scale;
        for (int i = 0; i < half; ++i) {
          const float theta = pos * job.inv_freq[i];
          cosv[i] = __builtin_cosf(theta);
          sinv[i] = __builtin_sinf(theta);
        }
      }
      const size_t first = (static_cast<size_t>(r) * job.L + l) * D;
      row_to_f32(job.x, job.x_dtype, first, D, buf);
      if (job.traditional) {
        for (int i = 0; i < half; ++i) {
          const float a = buf[2 * i];
          const float b = buf[2 * i + 1];
          buf[2 * i] = a * cosv[i] - b * sinv[i];
          buf[2 * i + 1] = a * sinv[i] + b * cosv[i];
        }
      } else {
        for (int i = 0; i < half; ++i) {
          const float a = buf[i];
          const float b = buf[i + half];
          buf[i] = a * cosv[i] - b * sinv[i];
          buf[i + half] = a * sinv[i] + b * cosv[i];
        }
      }
      row_store(job.out, job.x_dtype, first, buf, D);
    }
  }
}

size_t attention_scratch_floats(const AttentionJob& job) {
  // One query row, its scores, the output accumulator, and one key and one
  // value row converted from half precision.
  return static_cast<size_t>(job.D) + job.S + job.Dv + job.D + job.Dv + 32;
}

void attention_heads(const AttentionJob& job, int t0, int t1, float* scratch) {
  const int D = job.D;
  const int Dv = job.Dv;
  const int S = job.S;
  const int L = job.L;
  const int rep = job.Hq / job.Hkv;
  float* qrow = scratch;
  float* scores = qrow + D;
  float* acc = scores + S;
  float* krow = acc + Dv;
  float* vrow = krow + D;
  const bool f32 = job.dtype == kF32;
  const size_t esize = f32 ? 4 : 2;
  for (int t = t0; t < t1; ++t) {
    const int b = t / job.Hq;
    const int h = t % job.Hq;
    const int hk = h / rep;
    const char* kbase = static_cast<const char*>(job.k) +
        (b * job.k_strides[0] + hk * job.k_strides[1]) * esize;
    const char* vbase = static_cast<const char*>(job.v) +
        (b * job.v_strides[0] + hk * job.v_strides[1]) * esize;
    int keys = S;
    if (job.lengths != nullptr) {
      const int32_t n = job.lengths[job.n_lengths == 1 ? 0 : b];
      keys = n < 0 ? 0 : (n > S ? S : n);
    }
    for (int l = 0; l < L; ++l) {
      const size_t qfirst = (static_cast<size_t>(t) * L + l) * D;
      row_to_f32(job.q, job.dtype, qfirst, D, qrow);
      int visible = job.causal ? (keys - L + l + 1) : keys;
      visible = visible < 0 ? 0 : visible;
      const float* mrow =
          job.mask != nullptr ? job.mask + (static_cast<size_t>(t) * L + l) * S : nullptr;
      float top = -__builtin_inff();
      for (int s = 0; s < visible; ++s) {
        const char* kp = kbase + s * job.k_strides[2] * esize;
        const float* kr = reinterpret_cast<const float*>(kp);
        if (!f32) {
          to_f32(kp, job.dtype, krow, static_cast<size_t>(D));
          kr = krow;
        }
        float sc = dot(qrow, kr, D) * job.scale;
        if (mrow != nullptr) {
          sc += mrow[s];
        }
        scores[s] = sc;
        top = sc > top ? sc : top;
      }
      for (int i = 0; i < Dv; ++i) {
        acc[i] = 0.0f;
      }
      float total = 0.0f;
      if (top != -__builtin_inff()) {
        for (int s = 0; s < visible; ++s) {
          const float p = __builtin_expf(scores[s] - top);
          total += p;
          const char* vp = vbase + s * job.v_strides[2] * esize;
          const float* vr = reinterpret_cast<const float*>(vp);
          if (!f32) {
            to_f32(vp, job.dtype, vrow, static_cast<size_t>(Dv));
            vr = vrow;
          }
          axpy(p, vr, acc, Dv);
        }
      }
      // A row that sees no key (fully masked) comes out as zeros rather than
      // NaN.
      const float inv = total > 0.0f ? 1.0f / total : 0.0f;
      for (int i = 0; i < Dv; ++i) {
        acc[i] *= inv;
      }
      row_store(job.out, job.out_dtype, (static_cast<size_t>(t) * L + l) * Dv, acc, Dv);
    }
  }
}

namespace {

// MLX's CPU exp (mlx/backend/cpu/simd/math.h), lane for lane: 2^(x log2 e)
// split at the nearest integer (halves rounded up), a degree-6 polynomial (Cephes constants) in
// the fractional part, the integer part shifted into the exponent; NaN kept,
// +inf above 88, 0 below -88.
inline __m256 mlx_exp(__m256 x_init) {
  const __m256 x = _mm256_mul_ps(x_init, _mm256_set1_ps(1.442695f));
  // MLX adds a double 0.5, so the rounding to the nearest integer happens
  // in double (a float add would round x + 0.5 itself just below a half).
  const __m256d half = _mm256_set1_pd(0.5);
  const __m256d lo = _mm256_floor_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), half));
  const __m256d hi = _mm256_floor_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), half));
  const __m256 ipart = _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
  const __m256 fpart = _mm256_sub_ps(x, ipart);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.0f));
  const __m256i epart =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
  __m256 r = _mm256_mul_ps(_mm256_castsi256_ps(epart), p);
  r = _mm256_blendv_ps(r, x_init, _mm256_cmp_ps(x_init, x_init, _CMP_UNORD_Q));
  r = _mm256_blendv_ps(
      r, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(x_init, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  r = _mm256_blendv_ps(
      r, _mm256_setzero_ps(), _mm256_cmp_ps(x_init, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
  return r;
}

// MLX's CPU sigmoid: y = 1 / (1 + exp(|x|)), then y for x < 0 and 1 - y else.
inline __m256 mlx_sigmoid(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, mlx_exp(ax)));
  return _mm256_blendv_ps(_mm256_sub_ps(one, y), y, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}

}  // namespace

void silu_mul(const float* gate, const float* up, float* out, size_t i0, size_t i1) {
  size_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 silu = _mm256_mul_ps(g, mlx_sigmoid(g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  if (i < i1) {
    // The tail through the same lanes (padded with zeros, stored partially).
    float g[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float u[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float r[8];
    const size_t n = i1 - i;
    for (size_t j = 0; j < n; ++j) {
      g[j] = gate[i + j];
      u[j] = up[i + j];
    }
    const __m256 gv = _mm256_loadu_ps(g);
    _mm256_storeu_ps(r, _mm256_mul_ps(_mm256_mul_ps(gv, mlx_sigmoid(gv)), _mm256_loadu_ps(u)));
    for (size_t j = 0; j < n; ++j) {
      out[i + j] = r[j];
    }
  }
}

void log_softmax_rows(const float* x, float* out, int V, int r0, int r1) {
  float exps[256];
  for (int r = r0; r < r1; ++r) {
    const float* row = x + static_cast<size_t>(r) * V;
    float* dst = out + static_cast<size_t>(r) * V;
    // The maximum: order does not matter for it (but NaN wins, as in MLX).
    __m256 vmax = _mm256_set1_ps(-__builtin_inff());
    __m256 nan = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= V; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      vmax = _mm256_max_ps(v, vmax);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    float top = lanes[0];
    for (int j = 1; j < 8; ++j) {
      top = lanes[j] > top ? lanes[j] : top;
    }
    bool has_nan = _mm256_movemask_ps(nan) != 0;
    for (; i < V; ++i) {
      has_nan = has_nan || row[i] != row[i];
      top = row[i] > top ? row[i] : top;
    }
    if (has_nan) {
      top = __builtin_nanf("");
    }
    // exp(x - max) eight at a time, summed one by one in column order.
    const __m256 vtop = _mm256_set1_ps(top);
    float sum = 0.0f;
    for (int k0 = 0; k0 < V; k0 += 256) {
      const int n = V - k0 < 256 ? V - k0 : 256;
      int j = 0;
      for (; j + 8 <= n; j += 8) {
        _mm256_storeu_ps(exps + j, mlx_exp(_mm256_sub_ps(_mm256_loadu_ps(row + k0 + j), vtop)));
      }
      if (j < n) {
        float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int t = 0; t < n - j; ++t) {
          tail[t] = row[k0 + j + t] - top;
        }
        _mm256_storeu_ps(tail, mlx_exp(_mm256_loadu_ps(tail)));
        for (int t = 0; t < n - j; ++t) {
          exps[j + t] = tail[t];
        }
      }
      for (int t = 0; t < n; ++t) {
        sum += exps[t];
      }
    }
    const bool inf = top == __builtin_inff() || top == -__builtin_inff();
    const float lse = inf ? top : __builtin_logf(sum) + top;
    const __m256 vlse = _mm256_set1_ps(lse);
    i = 0;
    for (; i + 8 <= V; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_sub_ps(_mm256_loadu_ps(row + i), vlse));
    }
    for (; i < V; ++i) {
      dst[i] = row[i] - lse;
    }
  }
}

}  // namespace loom_cpu

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

// dot(a, b) and y += a * x with b / x stored as SD (kF32, kBF16 or kF16):
// each half-precision element widened exactly as to_f32 widens it, then the
// same lanes and fused multiply-adds, so a cache row stored in half
// precision gives the bits of its widened copy without converting it into a
// buffer first (that round trip made decode over a float16 cache slower than
// over a float32 one twice its bytes: 2048-token Llama context, 51 against
// 55 tokens/s).
template <int SD>
inline float dot_stored(const float* a, const void* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_dense8<SD>(b, i), acc);
  }
  float s = hsum(acc);
  for (; i < n; ++i) {
    s = __builtin_fmaf(a[i], load_scalar(b, SD, i), s);
  }
  return s;
}

template <int SD>
inline void axpy_stored(float a, const void* x, float* y, int n) {
  const __m256 av = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, load_dense8<SD>(x, i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) {
    y[i] = __builtin_fmaf(a, load_scalar(x, SD, i), y[i]);
  }
}

inline float dot(const float* a, const float* b, int n) {
  return dot_stored<kF32>(a, b, n);
}

// y += a * x
inline void axpy(float a, const float* x, float* y, int n) {
  axpy_stored<kF32>(a, x, y, n);
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

// Attention is tiled: a block of query rows (kQueryBlock) walks the keys in
// blocks (kKeyBlock), so each key and value row is read (and converted from
// half precision) once per query block instead of once per query row, and
// four query rows share each key row's loads. Every row's arithmetic is
// still exactly the one-row algorithm: its scores (the same dot product,
// lane for lane), their maximum, then exp(score - max) summed and
// accumulated over the keys in ascending order, divided once. The maximum is
// found in a first sweep over the key blocks; the second sweep recomputes
// the scores (bit-identical) unless the block's scores fit kKeepScores
// floats, when the first sweep keeps them. So a row's output does not
// depend on L, on the query block it falls in, on how a prompt was chunked,
// on the batch or on the thread count, and decode (L == 1) is the algorithm
// it always was; scratch is bounded by the blocks, never L * S.
constexpr int kQueryBlock = 8;
constexpr int kKeyBlock = 64;
constexpr int kKeepScores = 16384;
// Query heads that share a key-value head and take one row each (decode
// with grouped-query attention) run together, up to this many: each block
// of keys is read once for the group, from memory or the L2, and every head
// of the group meets it while it sits in the L1.
constexpr int kMaxGroup = 8;

size_t attention_scratch_floats(const AttentionJob& job) {
  const size_t qb = kQueryBlock;
  if (job.L == 1) {
    // Per head of a group (rows_stored): one query row, the accumulator,
    // its scores (half-precision keys and values are widened in registers).
    const int rep = job.Hkv > 0 ? job.Hq / job.Hkv : 1;
    const size_t group = static_cast<size_t>(rep < kMaxGroup ? rep : kMaxGroup);
    return group * (static_cast<size_t>(job.D + job.Dv) + job.S) + 32;
  }
  return qb * job.D + qb * job.Dv + static_cast<size_t>(kKeepScores) +
      static_cast<size_t>(kKeyBlock) * (job.D + job.Dv) + 64;
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
  const __m256 p = exp2_fraction(fpart);
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

// out[i] = exp(in[i] - top) for i < n, by mlx_exp eight lanes at a time,
// added to `total` in index order and returned: the weights of a row's
// keys, the same in decode and in every prefill chunking (a masked key,
// -inf, weighs 0). MLX's exp rather than the C library's: a call per score
// kept the loop from overlapping anything.
inline float exp_weights(const float* in, float* out, int n, float top, float total) {
  const __m256 vtop = _mm256_set1_ps(top);
  alignas(32) float p[8];
  for (int i = 0; i < n; i += 8) {
    const int w = n - i < 8 ? n - i : 8;
    __m256 x;
    if (w == 8) {
      x = _mm256_loadu_ps(in + i);
    } else {
      for (int j = 0; j < 8; ++j) {
        p[j] = j < w ? in[i + j] : top;
      }
      x = _mm256_load_ps(p);
    }
    _mm256_store_ps(p, mlx_exp(_mm256_sub_ps(x, vtop)));
    for (int j = 0; j < w; ++j) {
      total += p[j];
      out[i + j] = p[j];
    }
  }
  return total;
}

// A score as the kernel always computed it: scaled (one rounding), then the
// additive mask added (another). The empty asm keeps the product a rounded
// float, so the compiler cannot contract the two into one fused multiply-add
// in one path and not the other (it did: the blocked and one-row paths
// differed by that rounding before this was spelled out).
inline float masked_score(float dot_qk, float scale, const float* mrow, int s, size_t stride) {
  float sc = dot_qk * scale;
  if (mrow == nullptr) {
    return sc;
  }
  __asm__("" : "+x"(sc));
  return sc + mrow[s * stride];
}

// Scores of query rows q[0..n) (row stride D) against one key row, each
// exactly dot(q_i, k, D): the same lanes, the same fused multiply-adds in
// the same order, the same horizontal sum and tail; four rows share the
// key's loads.
inline void dot_rows(const float* q, int n, const float* k, int D, float* out, size_t out_stride) {
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    const float* q0 = q + static_cast<size_t>(i) * D;
    const float* q1 = q0 + D;
    const float* q2 = q1 + D;
    const float* q3 = q2 + D;
    __m256 a0 = _mm256_setzero_ps();
    __m256 a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps();
    __m256 a3 = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= D; j += 8) {
      const __m256 kv = _mm256_loadu_ps(k + j);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + j), kv, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + j), kv, a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + j), kv, a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + j), kv, a3);
    }
    float s0 = hsum(a0);
    float s1 = hsum(a1);
    float s2 = hsum(a2);
    float s3 = hsum(a3);
    for (; j < D; ++j) {
      s0 = __builtin_fmaf(q0[j], k[j], s0);
      s1 = __builtin_fmaf(q1[j], k[j], s1);
      s2 = __builtin_fmaf(q2[j], k[j], s2);
      s3 = __builtin_fmaf(q3[j], k[j], s3);
    }
    out[(i + 0) * out_stride] = s0;
    out[(i + 1) * out_stride] = s1;
    out[(i + 2) * out_stride] = s2;
    out[(i + 3) * out_stride] = s3;
  }
  for (; i < n; ++i) {
    out[i * out_stride] = dot(q + static_cast<size_t>(i) * D, k, D);
  }
}

// acc[0..Dv) += p[s] * v_s, for s = 0 .. n - 1 in that order: per element
// exactly axpy(p[s], v_s, acc, Dv) called n times, with the accumulator held
// in registers (up to 64 columns at a time) instead of reloaded for every key.
template <int W>
LOOM_HOT void accumulate_cols(
    const float* p, int n, const float* const* vrows, int c, float* acc) {
  __m256 a[W];
  for (int j = 0; j < W; ++j) {
    a[j] = _mm256_loadu_ps(acc + c + 8 * j);
  }
  for (int s = 0; s < n; ++s) {
    const __m256 pv = _mm256_set1_ps(p[s]);
    const float* v = vrows[s] + c;
    for (int j = 0; j < W; ++j) {
      a[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * j), a[j]);
    }
  }
  for (int j = 0; j < W; ++j) {
    _mm256_storeu_ps(acc + c + 8 * j, a[j]);
  }
}

inline void accumulate(const float* p, int n, const float* const* vrows, float* acc, int Dv) {
  // Eight (or four) independent accumulators keep the fused multiply-adds
  // throughput-bound rather than waiting on one register's latency.
  int c = 0;
  for (; c + 64 <= Dv; c += 64) {
    accumulate_cols<8>(p, n, vrows, c, acc);
  }
  for (; c + 32 <= Dv; c += 32) {
    accumulate_cols<4>(p, n, vrows, c, acc);
  }
  for (; c + 8 <= Dv; c += 8) {
    accumulate_cols<1>(p, n, vrows, c, acc);
  }
  for (; c < Dv; ++c) {
    float a = acc[c];
    for (int s = 0; s < n; ++s) {
      a = __builtin_fmaf(p[s], vrows[s][c], a);
    }
    acc[c] = a;
  }
}

// dot_stored(q, k_j, D) for eight key rows k_j = k + j * stride bytes (D a
// multiple of 8), bit for bit: each key's lanes take the same fused
// multiply-adds in the same order, and the eight horizontal sums run as one
// tree of the same additions (lanes i + 4 first, then pairs, then the two
// halves: hsum's order), so one key's chain of dependent multiply-adds no
// longer waits alone. The sums come back in key order.
template <int SD>
LOOM_HOT __m256 dot8_stored(const float* q, const char* k, size_t stride, int D) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) {
    a[j] = _mm256_setzero_ps();
  }
  for (int i = 0; i < D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) {
      a[j] = _mm256_fmadd_ps(qv, load_dense8<SD>(k + j * stride, i), a[j]);
    }
  }
  // p[j] = [key j's lanes 0-3 + lanes 4-7 | key j + 4's]
  __m256 p[4];
  for (int j = 0; j < 4; ++j) {
    p[j] = _mm256_add_ps(
        _mm256_permute2f128_ps(a[j], a[j + 4], 0x20), _mm256_permute2f128_ps(a[j], a[j + 4], 0x31));
  }
  // hadd adds neighbouring lanes: [s0 + s1, s2 + s3] per key, then their sum.
  return _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
}

// acc[0..Dv) += p[s] * v_s for s = 0 .. n - 1 in that order, v_s the value
// row v + s * stride bytes stored as SD: per element exactly
// axpy_stored(p[s], v_s, acc, Dv) called n times, with the accumulator held
// in registers (up to 64 columns at a time) and half-precision rows widened
// in registers, as accumulate does for fp32 rows.
template <int W, int SD>
LOOM_HOT void accumulate_stored_cols(
    const float* p, int n, const char* v, size_t stride, int c, float* acc) {
  __m256 a[W];
  for (int j = 0; j < W; ++j) {
    a[j] = _mm256_loadu_ps(acc + c + 8 * j);
  }
  for (int s = 0; s < n; ++s) {
    const __m256 pv = _mm256_set1_ps(p[s]);
    const char* row = v + s * stride;
    for (int j = 0; j < W; ++j) {
      a[j] = _mm256_fmadd_ps(pv, load_dense8<SD>(row, c + 8 * j), a[j]);
    }
  }
  for (int j = 0; j < W; ++j) {
    _mm256_storeu_ps(acc + c + 8 * j, a[j]);
  }
}

template <int SD>
void accumulate_stored(const float* p, int n, const char* v, size_t stride, float* acc, int Dv) {
  int c = 0;
  for (; c + 64 <= Dv; c += 64) {
    accumulate_stored_cols<8, SD>(p, n, v, stride, c, acc);
  }
  for (; c + 32 <= Dv; c += 32) {
    accumulate_stored_cols<4, SD>(p, n, v, stride, c, acc);
  }
  for (; c + 8 <= Dv; c += 8) {
    accumulate_stored_cols<1, SD>(p, n, v, stride, c, acc);
  }
  for (; c < Dv; ++c) {
    float a = acc[c];
    for (int s = 0; s < n; ++s) {
      a = __builtin_fmaf(p[s], load_scalar(v + s * stride, SD, c), a);
    }
    acc[c] = a;
  }
}

// Decode's one query row per head, for G heads t .. t + G - 1 of one batch
// row that share a key-value head: the scores of eight keys at a time
// (dot8_stored), then every weight, then the values accumulated in
// registers per block of keys. Each head's arithmetic is exactly the
// one-head algorithm, in the same order (its scores key by key, their
// maximum, its weights, its blocks of values): only the loops over heads
// moved inside the loops over keys, so a head's output does not depend on
// the group it ran in. The blocked path computes exactly this for every row
// (tested); with one row its query-block bookkeeping was measured ~25 %
// slower. One token over 2048 fp32 keys, 16 heads of 64 (8 KV heads), two
// threads, keys and values from cache, heads one at a time: 200 us with one
// key's dot product and the exp and the value update interleaved per key,
// 183 us with the scores first (of which the scores ~70, the C library's
// exp ~45 and the values ~60).
template <int SD>
__attribute__((noinline)) void rows_stored(
    const AttentionJob& job, int t, int G, int b, int h, int keys, const char* kbase,
    const char* vbase, size_t esize, float* scratch) {
  const int D = job.D;
  const int Dv = job.Dv;
  // Per head g: its query row, its accumulator and its scores.
  float* qrows = scratch;
  float* accs = qrows + static_cast<size_t>(G) * D;
  float* scores_at = accs + static_cast<size_t>(G) * Dv;
  auto scores_of = [&](int g) { return scores_at + static_cast<size_t>(g) * keys; };
  const float* mrows[kMaxGroup];
  float top[kMaxGroup];
  for (int g = 0; g < G; ++g) {
    row_to_f32(job.q, job.dtype, static_cast<size_t>(t + g) * D, D, qrows + static_cast<size_t>(g) * D);
    mrows[g] = job.mask != nullptr
        ? job.mask + b * job.m_strides[0] + (h + g) * job.m_strides[1]
        : nullptr;
    top[g] = -__builtin_inff();
  }
  const size_t kstride = job.k_strides[2] * esize;
  int s = 0;
  if (D % 8 == 0) {
    alignas(32) float d8[8];
    if (job.mask == nullptr) {
      // The scaled score is one rounding either way (masked_score's).
      const __m256 scale = _mm256_set1_ps(job.scale);
      __m256 top8[kMaxGroup];
      for (int g = 0; g < G; ++g) {
        top8[g] = _mm256_set1_ps(-__builtin_inff());
      }
      for (; s + 8 <= keys; s += 8) {
        for (int g = 0; g < G; ++g) {
          const __m256 sc = _mm256_mul_ps(
              dot8_stored<SD>(qrows + static_cast<size_t>(g) * D, kbase + s * kstride, kstride, D),
              scale);
          _mm256_storeu_ps(scores_of(g) + s, sc);
          // max_ps(a, b) is a > b ? a : b, lane by lane: the scalar loop's
          // `sc > top ? sc : top`, so a NaN score leaves the maximum alone
          // here as there.
          top8[g] = _mm256_max_ps(sc, top8[g]);
        }
      }
      for (int g = 0; g < G; ++g) {
        _mm256_store_ps(d8, top8[g]);
        for (int j = 0; j < 8; ++j) {
          top[g] = d8[j] > top[g] ? d8[j] : top[g];
        }
      }
    } else {
      for (; s + 8 <= keys; s += 8) {
        for (int g = 0; g < G; ++g) {
          _mm256_store_ps(
              d8, dot8_stored<SD>(qrows + static_cast<size_t>(g) * D, kbase + s * kstride, kstride, D));
          float* scores = scores_of(g);
          for (int j = 0; j < 8; ++j) {
            const float sc = masked_score(d8[j], job.scale, mrows[g], s + j, job.m_strides[3]);
            scores[s + j] = sc;
            top[g] = sc > top[g] ? sc : top[g];
          }
        }
      }
    }
  }
  for (; s < keys; ++s) {
    for (int g = 0; g < G; ++g) {
      const float sc = masked_score(
          dot_stored<SD>(qrows + static_cast<size_t>(g) * D, kbase + s * kstride, D), job.scale,
          mrows[g], s, job.m_strides[3]);
      scores_of(g)[s] = sc;
      top[g] = sc > top[g] ? sc : top[g];
    }
  }
  float total[kMaxGroup];
  for (int g = 0; g < G; ++g) {
    float* acc = accs + static_cast<size_t>(g) * Dv;
    for (int i = 0; i < Dv; ++i) {
      acc[i] = 0.0f;
    }
    total[g] = 0.0f;
    if (top[g] != -__builtin_inff()) {
      // Every weight first, then the values in blocks of keys.
      total[g] = exp_weights(scores_of(g), scores_of(g), keys, top[g], total[g]);
    }
  }
  const size_t vstride = job.v_strides[2] * esize;
  for (int s0 = 0; s0 < keys; s0 += kKeyBlock) {
    const int n = keys - s0 < kKeyBlock ? keys - s0 : kKeyBlock;
    for (int g = 0; g < G; ++g) {
      if (top[g] != -__builtin_inff()) {
        accumulate_stored<SD>(scores_of(g) + s0, n, vbase + s0 * vstride, vstride,
                              accs + static_cast<size_t>(g) * Dv, Dv);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    float* acc = accs + static_cast<size_t>(g) * Dv;
    const float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
    for (int i = 0; i < Dv; ++i) {
      acc[i] *= inv;
    }
    row_store(job.out, job.out_dtype, static_cast<size_t>(t + g) * Dv, acc, Dv);
  }
}

void group_rows(
    const AttentionJob& job, int t, int G, int b, int h, int keys, const char* kbase,
    const char* vbase, size_t esize, float* scratch) {
  if (job.kv_dtype == kF32) {
    rows_stored<kF32>(job, t, G, b, h, keys, kbase, vbase, esize, scratch);
  } else if (job.kv_dtype == kF16) {
    rows_stored<kF16>(job, t, G, b, h, keys, kbase, vbase, esize, scratch);
  } else {
    rows_stored<kBF16>(job, t, G, b, h, keys, kbase, vbase, esize, scratch);
  }
}

}  // namespace

void attention_heads(const AttentionJob& job, int t0, int t1, float* scratch) {
  const int D = job.D;
  const int Dv = job.Dv;
  const int S = job.S;
  const int L = job.L;
  const int rep = job.Hq / job.Hkv;
  float* qblk = scratch;                       // [kQueryBlock][D]
  float* acc = qblk + kQueryBlock * D;         // [kQueryBlock][Dv]
  float* scores = acc + kQueryBlock * Dv;      // kKeepScores
  float* kblk = scores + kKeepScores;          // [kKeyBlock][D]
  float* vblk = kblk + kKeyBlock * D;          // [kKeyBlock][Dv]
  float top[kQueryBlock];
  float total[kQueryBlock];
  int visible[kQueryBlock];
  float probs[kKeyBlock];
  const float* vrows[kKeyBlock];
  const float* mrow[kQueryBlock];
  const bool kv_f32 = job.kv_dtype == kF32;
  const size_t esize = kv_f32 ? 4 : 2;
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
    // Key row s of this head as fp32: in place when stored so, else
    // converted into the block buffer (row s - s0).
    auto key_row = [&](int s, int s0) -> const float* {
      const char* kp = kbase + s * job.k_strides[2] * esize;
      if (kv_f32) {
        return reinterpret_cast<const float*>(kp);
      }
      float* dst = kblk + static_cast<size_t>(s - s0) * D;
      to_f32(kp, job.kv_dtype, dst, static_cast<size_t>(D));
      return dst;
    };
    auto value_row = [&](int s, int s0) -> const float* {
      const char* vp = vbase + s * job.v_strides[2] * esize;
      if (kv_f32) {
        return reinterpret_cast<const float*>(vp);
      }
      float* dst = vblk + static_cast<size_t>(s - s0) * Dv;
      to_f32(vp, job.kv_dtype, dst, static_cast<size_t>(Dv));
      return dst;
    };
    if (L == 1) {
      // This head and the next ones of the range that share its key-value
      // head (and batch row), up to kMaxGroup.
      int G = rep - h % rep;
      G = G < t1 - t ? G : t1 - t;
      G = G < kMaxGroup ? G : kMaxGroup;
      group_rows(job, t, G, b, h, keys, kbase, vbase, esize, scratch);
      t += G - 1;
      continue;
    }
    for (int l0 = 0; l0 < L; l0 += kQueryBlock) {
      const int nq = L - l0 < kQueryBlock ? L - l0 : kQueryBlock;
      int span = 0;
      for (int i = 0; i < nq; ++i) {
        const int l = l0 + i;
        row_to_f32(job.q, job.dtype, (static_cast<size_t>(t) * L + l) * D, D, qblk + i * D);
        int vis = job.causal ? (keys - L + l + 1) : keys;
        vis = vis < 0 ? 0 : vis;
        visible[i] = vis;
        span = vis > span ? vis : span;
        mrow[i] = job.mask != nullptr
            ? job.mask + b * job.m_strides[0] + h * job.m_strides[1] + l * job.m_strides[2]
            : nullptr;
        top[i] = -__builtin_inff();
        total[i] = 0.0f;
      }
      // Kept: row i's score of key s at scores[i * span + s]; else the key
      // block's, at scores[i * kKeyBlock + s - s0].
      const bool keep = static_cast<long long>(nq) * span <= kKeepScores;
      const size_t rs = keep ? static_cast<size_t>(span) : kKeyBlock;
      // The scores of keys [s0, s1) for every row of the block (a row's
      // entries past its visible keys are computed and never read), and
      // each row's running maximum (order does not matter for a maximum).
      auto block_scores = [&](int s0, int s1) {
        const size_t c0 = keep ? s0 : 0;
        for (int s = s0; s < s1; ++s) {
          dot_rows(qblk, nq, key_row(s, s0), D, scores + c0 + (s - s0), rs);
        }
        for (int i = 0; i < nq; ++i) {
          float* row = scores + i * rs + (static_cast<ptrdiff_t>(c0) - s0);
          const float* mr = mrow[i];
          const int end = visible[i] < s1 ? visible[i] : s1;
          float m = top[i];
          for (int s = s0; s < end; ++s) {
            const float sc = masked_score(row[s], job.scale, mr, s, job.m_strides[3]);
            row[s] = sc;
            m = sc > m ? sc : m;
          }
          top[i] = m;
        }
      };
      for (int s0 = 0; s0 < span; s0 += kKeyBlock) {
        block_scores(s0, span - s0 < kKeyBlock ? span : s0 + kKeyBlock);
      }
      for (int i = 0; i < nq * Dv; ++i) {
        acc[i] = 0.0f;
      }
      for (int s0 = 0; s0 < span; s0 += kKeyBlock) {
        const int s1 = span - s0 < kKeyBlock ? span : s0 + kKeyBlock;
        if (!keep) {
          block_scores(s0, s1);
        }
        const size_t c0 = keep ? s0 : 0;
        for (int s = s0; s < s1; ++s) {
          vrows[s - s0] = value_row(s, s0);
        }
        for (int i = 0; i < nq; ++i) {
          // A row that sees no key adds nothing (it comes out as zeros).
          const float m = top[i];
          const int end = visible[i] < s1 ? visible[i] : s1;
          if (end <= s0 || m == -__builtin_inff()) {
            continue;
          }
          const float* row = scores + i * rs + c0;
          total[i] = exp_weights(row, probs, end - s0, m, total[i]);
          accumulate(probs, end - s0, vrows, acc + i * Dv, Dv);
        }
      }
      for (int i = 0; i < nq; ++i) {
        // A fully masked row comes out as zeros rather than NaN.
        const float inv = total[i] > 0.0f ? 1.0f / total[i] : 0.0f;
        float* a = acc + i * Dv;
        for (int j = 0; j < Dv; ++j) {
          a[j] *= inv;
        }
        row_store(job.out, job.out_dtype, (static_cast<size_t>(t) * L + l0 + i) * Dv, a, Dv);
      }
    }
  }
}

namespace {


// MLX's CPU sigmoid: y = 1 / (1 + exp(|x|)), then y for x < 0 and 1 - y else.
inline __m256 mlx_sigmoid(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, mlx_exp(ax)));
  return _mm256_blendv_ps(_mm256_sub_ps(one, y), y, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}

}  // namespace

void silu_mul(const float* gate, const float* up, float* out, size_t i0, size_t i1) {
  map_lanes2(gate, up, out, i0, i1, [](__m256 g, __m256 u) {
    return _mm256_mul_ps(_mm256_mul_ps(g, mlx_sigmoid(g)), u);
  });
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

// Scalar and 8-lane helpers shared by the AVX2 translation units
// (kernels_avx2.cpp, kernels_int8_avx2.cpp, ops_avx2.cpp, activations_avx2.cpp). Include it from
// those files only: every helper has internal linkage, so no AVX2 code can be merged into objects
// built for baseline x86-64.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "kernels.h"

// The per-chunk helpers of the hot loops are passed as lambdas into shared
// loop templates; GCC at -O3 left them as calls (measured: the fp32 4-bit
// row kernel 14 % slower than when written out by hand), so they are forced
// inline.
#define LOOM_HOT inline __attribute__((always_inline))

namespace loom_cpu {
namespace {

// ---------------------------------------------------------------------------
// Scalars and small vectors

// out[i] = f(a[i], b[i]) for i in [i0, i1), `f` taking and giving eight lanes:
// the element-wise gates (SwiGLU, GeGLU). The tail runs through the same
// lanes (padded with zeros, stored partially), so every element meets the
// same operations wherever it falls.
template <class F>
LOOM_HOT void map_lanes2(const float* a, const float* b, float* out, size_t i0, size_t i1, F f) {
  size_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    _mm256_storeu_ps(out + i, f(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  }
  if (i < i1) {
    float av[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float bv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float r[8];
    const size_t n = i1 - i;
    for (size_t j = 0; j < n; ++j) {
      av[j] = a[i + j];
      bv[j] = b[i + j];
    }
    _mm256_storeu_ps(r, f(_mm256_loadu_ps(av), _mm256_loadu_ps(bv)));
    for (size_t j = 0; j < n; ++j) {
      out[i + j] = r[j];
    }
  }
}

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

// 2^f for the fraction f of an exp split at an integer: the degree-6
// polynomial (Cephes constants) MLX's CPU exp evaluates, in its order. The
// native exps differ only in how they split x and treat the ends.
inline __m256 exp2_fraction(__m256 f) {
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  return _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
}

inline __m256 load_bf16x8(const uint16_t* p) {
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

inline __m256 load_f16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// ---------------------------------------------------------------------------
// Shared pieces of the matrix products

// Eight consecutive dense weights of row `row` starting at column k, as fp32.
template <int WD>
inline __m256 load_dense8(const void* row, int k) {
  if constexpr (WD == kBF16) {
    return load_bf16x8(static_cast<const uint16_t*>(row) + k);
  } else if constexpr (WD == kF16) {
    return load_f16x8(static_cast<const uint16_t*>(row) + k);
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(row) + k);
  }
}

// f.template operator()<R>() for the compile-time R equal to `rows`, for
// rows in 1..MAX (0: nothing): a pass template instantiated per activation
// row count, chosen at run time, without a case per count.
template <int MAX, class F>
LOOM_HOT void with_rows(int rows, F&& f) {
  if constexpr (MAX > 0) {
    if (rows == MAX) {
      f.template operator()<MAX>();
    } else {
      with_rows<MAX - 1>(rows, f);
    }
  }
}

// A thread's scratch buffer for the int8 kernels, 64-byte aligned, kept
// between calls (one per use, thread_local in each kernel file). The
// extension's Scratch (native_common.h) cannot serve here: it brings MLX's
// headers into files built for one instruction set.
struct AlignedBuffer {
  void* data = nullptr;
  size_t bytes = 0;
  ~AlignedBuffer() { std::free(data); }
  void* get(size_t n) {
    if (n > bytes) {
      std::free(data);
      bytes = 0;
      data = std::aligned_alloc(64, (n + 63) / 64 * 64);
      if (data == nullptr) {
        throw std::bad_alloc();
      }
      bytes = n;
    }
    return data;
  }
};

// Eight vectors as the columns of the 8x8 matrix whose rows they were.
LOOM_HOT void transpose8(__m256* r) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}

// Groups a table of group_table8 has room for: a whole number of eights.
inline size_t table_groups(int groups) {
  return static_cast<size_t>(groups + 7) / 8 * 8;
}

// Whether group_table8 may read eight values from group groups & ~7 of row
// `last` of a matrix of `rows` rows of `groups` values each (its rows
// consecutive up to `last`): the read stays inside the matrix.
inline bool table_reads_fit(int last, int groups, int rows) {
  return static_cast<size_t>(last) * groups + (groups & ~7) + 8 <= static_cast<size_t>(rows) * groups;
}

// The per-group values (scales or biases, dtype SD) of eight weight rows as
// fp32, group-major: out[g * stride + i] = rows[i][g], `out` holding
// table_groups(groups) groups. The int8 kernels keep
// one weight row per lane, so each group's eight (or sixteen) scales become
// one vector load. `over` says that eight values may be read from any row's
// group g8 = groups & ~7 on (table_reads_fit): the last groups then take the
// same transpose, the lanes past a row's end discarded; otherwise they are
// read one at a time. (For rows of up to 448 columns at group size 64, the
// routed experts' down products, those are all of a row's groups.)
template <int SD>
void group_table8(const void* const* rows, int groups, float* out, int stride, bool over) {
  const int g8 = groups & ~7;
  const int end = over ? groups : g8;
  for (int g = 0; g < end; g += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) {
      r[i] = load_dense8<SD>(rows[i], g);
    }
    transpose8(r);
    // All eight, also past the last group: `out` has room for a whole
    // number of eights (a store loop of a variable count became a copy
    // through memory per group).
    for (int j = 0; j < 8; ++j) {
      _mm256_storeu_ps(out + static_cast<size_t>(g + j) * stride, r[j]);
    }
  }
  for (int g = end > g8 ? groups : g8; g < groups; ++g) {
    for (int i = 0; i < 8; ++i) {
      out[static_cast<size_t>(g) * stride + i] = load_scalar(rows[i], SD, g);
    }
  }
}

// sum_g bias[g] * xsum[m][g] for every activation row: eight groups per
// vector step (lanes reduced at the end), the remainder one at a time.
template <int MT, int SD>
inline void bias_terms(const float* const* xsums, const void* brow, int groups, float* out) {
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm256_setzero_ps();
  }
  const int g8 = groups & ~7;
  for (int g = 0; g < g8; g += 8) {
    const __m256 b = load_dense8<SD>(brow, g);
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm256_fmadd_ps(b, _mm256_loadu_ps(xsums[m] + g), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    float s = hsum(acc[m]);
    for (int g = g8; g < groups; ++g) {
      s = __builtin_fmaf(load_scalar(brow, SD, g), xsums[m][g], s);
    }
    out[m] = s;
  }
}

// The group structure of a 4-bit affine row, shared by the fp32 and the
// int8-activation kernels. `chunk(k, part)` writes, per activation row, the
// eight-lane partial sums of the 64 codes from column k (lanes 0-3 and 4-7
// hold the chunk's two halves of 32 codes); `last(k, part)` the scalar sum
// of the 32 codes from k, for a row of an odd number of 32-code groups.
// Groups of 64 or 128 take whole chunks, summed in order and scaled once;
// with groups of 32 a chunk holds two groups, scaled by a vector of their
// two scales. Then the bias terms: res = sum s * partial + sum b * xsum.
template <int MT, int SD, class Chunk64, class Chunk32>
LOOM_HOT void affine4_groups(
    Chunk64&& chunk,
    Chunk32&& last,
    const float* const* xsums,
    const void* srow,
    const void* brow,
    int K,
    int group_size,
    float* res) {
  __m256 tot[MT];
  float tail[MT];
  float bsum[MT];
  for (int m = 0; m < MT; ++m) {
    tot[m] = _mm256_setzero_ps();
    tail[m] = 0.0f;
  }
  const int groups = K / group_size;
  __m256 part[MT];
  if (group_size >= 64) {
    for (int g = 0; g < groups; ++g) {
      const int k0 = g * group_size;
      __m256 acc[MT];
      chunk(k0, acc);
      for (int k = k0 + 64; k < k0 + group_size; k += 64) {
        chunk(k, part);
        for (int m = 0; m < MT; ++m) {
          acc[m] = _mm256_add_ps(acc[m], part[m]);
        }
      }
      const __m256 sv = _mm256_set1_ps(load_scalar(srow, SD, g));
      for (int m = 0; m < MT; ++m) {
        tot[m] = _mm256_fmadd_ps(sv, acc[m], tot[m]);
      }
    }
  } else {
    const int K64 = K & ~63;
    for (int k = 0; k < K64; k += 64) {
      chunk(k, part);
      const int g = k / 32;
      const __m256 sv = _mm256_set_m128(
          _mm_set1_ps(load_scalar(srow, SD, g + 1)), _mm_set1_ps(load_scalar(srow, SD, g)));
      for (int m = 0; m < MT; ++m) {
        tot[m] = _mm256_fmadd_ps(sv, part[m], tot[m]);
      }
    }
    if (K64 < K) {
      float sums[MT];
      last(K64, sums);
      const float s = load_scalar(srow, SD, groups - 1);
      for (int m = 0; m < MT; ++m) {
        tail[m] = s * sums[m];
      }
    }
  }
  bias_terms<MT, SD>(xsums, brow, groups, bsum);
  for (int m = 0; m < MT; ++m) {
    res[m] = (hsum(tot[m]) + tail[m]) + bsum[m];
  }
}

// The last 32 codes of a 4-bit row against fp32 activations, on 128-bit
// vectors (x permuted as prepare_affine_x does): the `last` of
// affine4_groups for the AVX2 and AVX-512 fp32 kernels alike.
template <int MT>
LOOM_HOT void affine4_last32(
    const float* const* xs, const uint8_t* wrow, int k, float* sums) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + k / 2));
  __m128 acc[MT];
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm_setzero_ps();
  }
  for (int c = 0; c < 8; ++c) {
    const __m128 qf = _mm_cvtepi32_ps(_mm_and_si128(_mm_srli_epi32(v, 4 * c), _mm_set1_epi32(0xF)));
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm_fmadd_ps(_mm_loadu_ps(xs[m] + k + 4 * c), qf, acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m128 h = _mm_add_ps(acc[m], _mm_movehl_ps(acc[m], acc[m]));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    sums[m] = _mm_cvtss_f32(h);
  }
}

// Weight rows are prefetched this many rows ahead by the matrix-vector
// kernels. Their products are reads of memory, and the hardware prefetcher
// alone keeps too few lines in flight for three streams per thread (codes,
// scales, biases): over a 350M 4-bit model's matrices, two threads, one
// pass took 21 ms without and 19 ms with (fp32 activations), 16 and 13.5 ms
// (int8 activations).
constexpr size_t kAheadRows = 8;

// Prefetch the row kAheadRows past `wrow` (row_bytes long) and its scales
// and biases (sb_bytes each per row); the caller checks that row exists.
inline void prefetch_ahead(
    const void* wrow, size_t row_bytes, const void* srow, const void* brow, size_t sb_bytes) {
  const char* ahead = static_cast<const char*>(wrow) + kAheadRows * row_bytes;
  for (size_t o = 0; o < row_bytes; o += 64) {
    _mm_prefetch(ahead + o, _MM_HINT_T0);
  }
  _mm_prefetch(static_cast<const char*>(srow) + kAheadRows * sb_bytes, _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(brow) + kAheadRows * sb_bytes, _MM_HINT_T0);
}

// Adds the product's bias (if any) to one output and stores it.
inline void finish(const Product& p, int m, int n, float v) {
  if (p.bias != nullptr) {
    v += load_scalar(p.bias, p.b_dtype, n);
  }
  store_scalar(p.out, p.out_dtype, static_cast<size_t>(m) * p.N + n, v);
}

}  // namespace
}  // namespace loom_cpu

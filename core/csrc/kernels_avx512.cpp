// 4-bit affine matrix-vector products against fp32 activations on AVX-512
// (the `cpu-native` set's decode, batched decode and verify windows), and
// the micro-kernel of the fp32 GEMM (its prefill) at the end of the file.
//
// Why a second kernel: the AVX2 kernel (affine4_chunk in kernels_avx2.cpp)
// turns 64 codes into floats with seven shifts, seven masks and eight
// integer-to-float conversions before its eight multiply-adds per
// activation row; at one row that decoding is most of the instructions, and
// a one-row product runs at about half the machine's read rate. Here a
// 512-bit register carries two of the AVX2 kernel's 8-lane accumulators
// side by side, so a pair of code vectors is one variable shift of the
// chunk's words (broadcast to both halves) and one 16-entry table lookup
// (vpermps, which reads the low four bits of each index lane: no mask, and
// the table holds 0..15 as exact floats, the values the conversion gives).
//
// Bit-identical to the AVX2 kernel: the low eight lanes of each 512-bit
// accumulator are the AVX2 kernel's a[m][0] (codes 8j + 0, 2, 4, 6 against
// their activations) and the high eight its a[m][1] (codes 8j + 1, 3, 5,
// 7), each lane meeting the same multiply and fused multiply-adds in the
// same order; the two halves are then added exactly as the AVX2 kernel adds
// a[m][0] and a[m][1], and the group structure, tail and bias terms are the
// same code (affine4_groups, affine4_last32, bias_terms in avx2_common.h).
//
// Compiled with -mavx512f -mavx512bw -mavx512vl (plus AVX2, FMA and F16C,
// and the same floating-point options as kernels_avx2.cpp), and called only
// when cpu_features.cpp found AVX-512 and the OS saves the zmm state. No
// library header with inline code is included, and every helper has
// internal linkage.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "avx2_common.h"
#include "kernels.h"

namespace loom_cpu {
namespace {

// Activation rows per pass. The codes of a chunk are decoded once per pass
// and meet every row of it; eight accumulators of 512 bits leave room for
// the table, the words and the decoded pair.
constexpr int kMaxMT = 8;

// One chunk of 64 4-bit codes against MT activation rows; part[m] as
// affine4_chunk in kernels_avx2.cpp writes it (lane j sums codes 8j..8j+7).
template <int MT>
LOOM_HOT void affine4_chunk512(
    const float* const* xs, const uint8_t* wrow, int k, const __m512& table, __m256* part) {
  const __m512i words = _mm512_broadcast_i64x4(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + k / 2)));
  // Pair c: nibble 2c of word j in lane j, nibble 2c + 1 in lane 8 + j.
  const __m512i shift0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
  __m512 a[MT];
  {
    const __m512 q = _mm512_permutexvar_ps(_mm512_srlv_epi32(words, shift0), table);
    for (int m = 0; m < MT; ++m) {
      a[m] = _mm512_mul_ps(_mm512_loadu_ps(xs[m] + k), q);
    }
  }
  for (int c = 1; c < 4; ++c) {
    const __m512i shift = _mm512_add_epi32(shift0, _mm512_set1_epi32(8 * c));
    const __m512 q = _mm512_permutexvar_ps(_mm512_srlv_epi32(words, shift), table);
    for (int m = 0; m < MT; ++m) {
      a[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[m] + k + 16 * c), q, a[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    const __m256 lo = _mm512_castps512_ps256(a[m]);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[m]), 1));
    part[m] = _mm256_add_ps(lo, hi);
  }
}

template <int MT, int SD>
void affine4_row512(
    const float* const* xs,
    const float* const* xsums,
    const uint8_t* wrow,
    const void* srow,
    const void* brow,
    int K,
    int group_size,
    const __m512& table,
    float* res) {
  affine4_groups<MT, SD>(
      [&](int k, __m256* part) { affine4_chunk512<MT>(xs, wrow, k, table, part); },
      [&](int k, float* sums) { affine4_last32<MT>(xs, wrow, k, sums); },
      xsums,
      srow,
      brow,
      K,
      group_size,
      res);
}

template <int MT>
void gemv4_pass512(const Product& p, const float* xsum, int m0, int n0, int n1) {
  const float* xs[MT];
  const int K = p.K;
  const int groups = K / p.group_size;
  const float* xsums[MT];
  for (int m = 0; m < MT; ++m) {
    xs[m] = p.x + static_cast<size_t>(m0 + m) * K;
    xsums[m] = xsum + static_cast<size_t>(m0 + m) * groups;
  }
  const __m512 table = _mm512_setr_ps(
      0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f, 8.0f, 9.0f, 10.0f, 11.0f, 12.0f, 13.0f,
      14.0f, 15.0f);
  const size_t row_bytes = static_cast<size_t>(K) / 2;
  const size_t s_esize = p.s_dtype == kF32 ? 4 : 2;
  float res[MT];
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wrow = static_cast<const uint8_t*>(p.w) + static_cast<size_t>(n) * row_bytes;
    const void* srow = static_cast<const char*>(p.scales) + static_cast<size_t>(n) * groups * s_esize;
    const void* brow = static_cast<const char*>(p.biases) + static_cast<size_t>(n) * groups * s_esize;
    if (n + static_cast<int>(kAheadRows) < n1) {
      prefetch_ahead(wrow, row_bytes, srow, brow, groups * s_esize);
    }
    switch (p.s_dtype) {
      case kBF16:
        affine4_row512<MT, kBF16>(xs, xsums, wrow, srow, brow, K, p.group_size, table, res);
        break;
      case kF16:
        affine4_row512<MT, kF16>(xs, xsums, wrow, srow, brow, K, p.group_size, table, res);
        break;
      default:
        affine4_row512<MT, kF32>(xs, xsums, wrow, srow, brow, K, p.group_size, table, res);
    }
    for (int m = 0; m < MT; ++m) {
      finish(p, m0 + m, n, res[m]);
    }
  }
}

template <int MT>
void gemv4_tail512(const Product& p, const float* xsum, int m, int n0, int n1) {
  if constexpr (MT > 0) {
    if (p.M - m == MT) {
      gemv4_pass512<MT>(p, xsum, m, n0, n1);
    } else {
      gemv4_tail512<MT - 1>(p, xsum, m, n0, n1);
    }
  }
}

// --- The GEMM's micro-kernel on AVX-512 ------------------------------------
//
// The blocked GEMM (gemm_rows in kernels_avx2.cpp) packs a block of weight
// rows into fp32 panels of 16 and runs a micro-kernel over them. On AVX2 it
// is 6 rows x 16 columns, two 8-lane registers a row; here a row's 32
// columns (two panels) are two 16-lane registers, and a tile is up to 12
// rows. Each output is still one fused multiply-add chain over k in order,
// started from the tile's value (the same operations on the same values as
// the AVX2 kernel's lanes), so the results are bit-identical; only the
// number of lanes per instruction changes.

constexpr int kGemmMR = 12;
constexpr int kPanel = 16;  // kNR of kernels_avx2.cpp: floats per panel row

// c[MR][16 * NP] (row stride ldc) += a[MR rows, stride lda][0:kc] . the NP
// panels at p0 (and p0 + panel_floats), each [kc][16].
template <int MR, int NP>
LOOM_HOT void gemm_micro512(
    const float* a, size_t lda, const float* p0, size_t panel_floats, int kc, float* c, size_t ldc) {
  __m512 acc[MR][NP];
  for (int i = 0; i < MR; ++i) {
    for (int h = 0; h < NP; ++h) {
      acc[i][h] = _mm512_loadu_ps(c + i * ldc + h * kPanel);
    }
  }
  for (int k = 0; k < kc; ++k) {
    __m512 b[NP];
    for (int h = 0; h < NP; ++h) {
      b[h] = _mm512_load_ps(p0 + h * panel_floats + static_cast<size_t>(k) * kPanel);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(a[i * lda + k]);
      for (int h = 0; h < NP; ++h) {
        acc[i][h] = _mm512_fmadd_ps(av, b[h], acc[i][h]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int h = 0; h < NP; ++h) {
      _mm512_storeu_ps(c + i * ldc + h * kPanel, acc[i][h]);
    }
  }
}

template <int MR>
void gemm_rows512(const float* a, size_t lda, const float* panels, int kc, int padded, float* c, size_t ldc) {
  const size_t panel_floats = static_cast<size_t>(kPanel) * kc;
  int j = 0;
  for (; j + 2 * kPanel <= padded; j += 2 * kPanel) {
    gemm_micro512<MR, 2>(a, lda, panels + (j / kPanel) * panel_floats, panel_floats, kc, c + j, ldc);
  }
  if (j < padded) {
    gemm_micro512<MR, 1>(a, lda, panels + (j / kPanel) * panel_floats, panel_floats, kc, c + j, ldc);
  }
}

}  // namespace

void gemm_block_avx512(
    const float* a, size_t lda, int M, const float* panels, int kc, int padded, float* c, size_t ldc) {
  int m = 0;
  for (; m + kGemmMR <= M; m += kGemmMR) {
    gemm_rows512<kGemmMR>(a + m * lda, lda, panels, kc, padded, c + m * ldc, ldc);
  }
  with_rows<kGemmMR - 1>(M - m, [&]<int MR>() {
    gemm_rows512<MR>(a + m * lda, lda, panels, kc, padded, c + m * ldc, ldc);
  });
}

void gemv4_rows_avx512(const Product& p, const float* xsum, int n0, int n1) {
  int m = 0;
  for (; m + kMaxMT <= p.M; m += kMaxMT) {
    gemv4_pass512<kMaxMT>(p, xsum, m, n0, n1);
  }
  if (m < p.M) {
    gemv4_tail512<kMaxMT - 1>(p, xsum, m, n0, n1);
  }
}

}  // namespace loom_cpu

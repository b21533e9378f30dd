// The SIMD kernels: AVX2 + FMA + F16C, fp32 arithmetic throughout.
//
// This translation unit is compiled with -mavx2 -mfma -mf16c and includes no
// C++ library header that defines templates or inline functions, and all of
// its helpers have internal linkage: no AVX2 instruction can leak into code
// that runs before the CPU check (see cpu_features.cpp).
//
// Numerics (the bounds the tests assert are derived from these):
// * every weight is first turned into one fp32 value: bf16/fp16 exactly, an
//   affine code as fma(scale, q, bias) -- one rounding;
// * products accumulate in fp32 with fused multiply-adds;
// * bf16/fp16 outputs are rounded once, to nearest even (bf16 exactly as
//   MLX's own conversion rounds, NaN included).

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "avx2_common.h"
#include "kernels.h"

namespace loom_cpu {
namespace {

template <int WD>
inline float load_dense1(const void* row, int k) {
  return load_scalar(row, WD, static_cast<size_t>(k));
}

// Eight affine codes starting at code index k of a row (k a multiple of 8),
// as exact fp32 integers.
template <int BITS>
inline __m256 load_codes8(const uint8_t* row, int k) {
  if constexpr (BITS == 4) {
    uint32_t word;
    std::memcpy(&word, row + k / 2, 4);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    __m256i q = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts),
        _mm256_set1_epi32(0xF));
    return _mm256_cvtepi32_ps(q);
  } else if constexpr (BITS == 8) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  } else if constexpr (BITS == 2) {
    uint16_t half;
    std::memcpy(&half, row + k / 4, 2);
    const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    __m256i q = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(half)), shifts),
        _mm256_set1_epi32(0x3));
    return _mm256_cvtepi32_ps(q);
  } else {
    // 3, 5 and 6 bits: eight codes span BITS bytes of the little-endian
    // stream, starting on a byte boundary (k * BITS is a multiple of 8).
    uint64_t bitsrc = 0;
    std::memcpy(&bitsrc, row + (static_cast<size_t>(k) * BITS) / 8, BITS);
    alignas(32) int32_t q[8];
    for (int i = 0; i < 8; ++i) {
      q[i] = static_cast<int32_t>((bitsrc >> (i * BITS)) & ((1u << BITS) - 1));
    }
    return _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(q)));
  }
}

// ---------------------------------------------------------------------------
// Matrix-vector: one weight row at a time against up to four activation rows.
//
// Per activation row the sum runs in blocks: 64 columns for dense weights,
// one quantization group for affine ones. Inside a block one 8-lane
// accumulator takes the 8-column chunks in order; the block's partial is
// then added to the row total (dense) or multiplied by the group's scale and
// added (affine, see below). At the end the total is reduced across lanes and
// the scalar parts are added. This order depends neither on how many rows
// share a pass nor on the thread, so batched rows equal solo rows bit for bit.
//
// Affine rows use  sum_k x_k (s q_k + b) = s * sum_k x_k q_k + b * sum_k x_k
// per group, with the group sums of x computed once per call: the inner loop
// is then one multiply-add per code, and the bias terms one vector dot
// product per row. 4-bit codes are decoded 64 at a time without crossing
// lanes (load_codes64_4bit), so x is permuted once per call into that order.

constexpr int kMaxMT = 4;
constexpr int kDenseBlock = 64;

template <int MT, int WD>
void dense_row(const float* const* xs, const void* wrow, int K, float* res) {
  __m256 tot[MT];
  for (int m = 0; m < MT; ++m) {
    tot[m] = _mm256_setzero_ps();
  }
  const int K8 = K & ~7;
  for (int k0 = 0; k0 < K8; k0 += kDenseBlock) {
    const int k1 = (k0 + kDenseBlock) < K8 ? (k0 + kDenseBlock) : K8;
    __m256 acc[MT];
    {
      const __m256 w = load_dense8<WD>(wrow, k0);
      for (int m = 0; m < MT; ++m) {
        acc[m] = _mm256_mul_ps(_mm256_loadu_ps(xs[m] + k0), w);
      }
    }
    for (int k = k0 + 8; k < k1; k += 8) {
      const __m256 w = load_dense8<WD>(wrow, k);
      for (int m = 0; m < MT; ++m) {
        acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[m] + k), w, acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) {
      tot[m] = _mm256_add_ps(tot[m], acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    float s = hsum(tot[m]);
    for (int kk = K8; kk < K; ++kk) {
      s = __builtin_fmaf(xs[m][kk], load_dense1<WD>(wrow, kk), s);
    }
    res[m] = s;
  }
}

// Sixty-four 4-bit codes (32 bytes, eight little-endian words) as eight
// vectors of 32-bit integers without crossing lanes: vector i holds, in
// lane j, code 8j + i (nibble i of word j). prepare_affine_x puts x in the
// same order, so each vector meets the activations of its own codes.
inline void load_codes64_4bit(const uint8_t* p, __m256i* q) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi32(0xF);
  q[0] = _mm256_and_si256(v, mask);
  q[1] = _mm256_and_si256(_mm256_srli_epi32(v, 4), mask);
  q[2] = _mm256_and_si256(_mm256_srli_epi32(v, 8), mask);
  q[3] = _mm256_and_si256(_mm256_srli_epi32(v, 12), mask);
  q[4] = _mm256_and_si256(_mm256_srli_epi32(v, 16), mask);
  q[5] = _mm256_and_si256(_mm256_srli_epi32(v, 20), mask);
  q[6] = _mm256_and_si256(_mm256_srli_epi32(v, 24), mask);
  q[7] = _mm256_srli_epi32(v, 28);
}

template <int MT, int BITS, int SD>
void affine_row(
    const float* const* xs,
    const float* const* xsums,
    const uint8_t* wrow,
    const void* srow,
    const void* brow,
    int K,
    int group_size,
    float* res) {
  __m256 tot[MT];
  float bsum[MT];
  for (int m = 0; m < MT; ++m) {
    tot[m] = _mm256_setzero_ps();
  }
  const int groups = K / group_size;
  for (int g = 0; g < groups; ++g) {
    const int k0 = g * group_size;
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm256_setzero_ps();
    }
    for (int k = k0; k < k0 + group_size; k += 8) {
      const __m256 q = load_codes8<BITS>(wrow, k);
      for (int m = 0; m < MT; ++m) {
        acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[m] + k), q, acc[m]);
      }
    }
    const __m256 sv = _mm256_set1_ps(load_scalar(srow, SD, g));
    for (int m = 0; m < MT; ++m) {
      tot[m] = _mm256_fmadd_ps(sv, acc[m], tot[m]);
    }
  }
  bias_terms<MT, SD>(xsums, brow, groups, bsum);
  for (int m = 0; m < MT; ++m) {
    res[m] = hsum(tot[m]) + bsum[m];
  }
}

// One chunk of 64 4-bit codes against MT activation rows: part[m] lane j
// sums codes 8j..8j+7 of the chunk, in order.
template <int MT>
LOOM_HOT void affine4_chunk(
    const float* const* xs, const uint8_t* wrow, int k, __m256* part) {
  __m256i q[8];
  load_codes64_4bit(wrow + k / 2, q);
  __m256 a[MT][2];
  for (int m = 0; m < MT; ++m) {
    a[m][0] = _mm256_mul_ps(_mm256_loadu_ps(xs[m] + k), _mm256_cvtepi32_ps(q[0]));
    a[m][1] = _mm256_mul_ps(_mm256_loadu_ps(xs[m] + k + 8), _mm256_cvtepi32_ps(q[1]));
  }
  for (int c = 2; c < 8; c += 2) {
    const __m256 q0 = _mm256_cvtepi32_ps(q[c]);
    const __m256 q1 = _mm256_cvtepi32_ps(q[c + 1]);
    for (int m = 0; m < MT; ++m) {
      a[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[m] + k + 8 * c), q0, a[m][0]);
      a[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[m] + k + 8 * c + 8), q1, a[m][1]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    part[m] = _mm256_add_ps(a[m][0], a[m][1]);
  }
}

// 4-bit rows, decoded 64 codes at a time in-lane (affine4_groups says how
// groups and the bias terms are summed).
template <int MT, int SD>
void affine4_row(
    const float* const* xs,
    const float* const* xsums,
    const uint8_t* wrow,
    const void* srow,
    const void* brow,
    int K,
    int group_size,
    float* res) {
  affine4_groups<MT, SD>(
      [&](int k, __m256* part) { affine4_chunk<MT>(xs, wrow, k, part); },
      [&](int k, float* sums) { affine4_last32<MT>(xs, wrow, k, sums); },
      xsums,
      srow,
      brow,
      K,
      group_size,
      res);
}

template <int MT>
void gemv_pass(const Product& p, const float* xsum, int m0, int n0, int n1) {
  const float* xs[MT];
  for (int m = 0; m < MT; ++m) {
    xs[m] = p.x + static_cast<size_t>(m0 + m) * p.K;
  }
  float res[MT];
  const int K = p.K;
  if (p.bits == 0) {
    const size_t esize = p.w_dtype == kF32 ? 4 : 2;
    for (int n = n0; n < n1; ++n) {
      const void* wrow = static_cast<const char*>(p.w) + static_cast<size_t>(n) * K * esize;
      switch (p.w_dtype) {
        case kBF16:
          dense_row<MT, kBF16>(xs, wrow, K, res);
          break;
        case kF16:
          dense_row<MT, kF16>(xs, wrow, K, res);
          break;
        default:
          dense_row<MT, kF32>(xs, wrow, K, res);
      }
      for (int m = 0; m < MT; ++m) {
        finish(p, m0 + m, n, res[m]);
      }
    }
    return;
  }
  const size_t row_bytes = static_cast<size_t>(K) * p.bits / 8;
  const int groups = K / p.group_size;
  const float* xsums[MT];
  for (int m = 0; m < MT; ++m) {
    xsums[m] = xsum + static_cast<size_t>(m0 + m) * groups;
  }
  const size_t s_esize = p.s_dtype == kF32 ? 4 : 2;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wrow = static_cast<const uint8_t*>(p.w) + static_cast<size_t>(n) * row_bytes;
    const void* srow = static_cast<const char*>(p.scales) + static_cast<size_t>(n) * groups * s_esize;
    const void* brow = static_cast<const char*>(p.biases) + static_cast<size_t>(n) * groups * s_esize;
    if (n + static_cast<int>(kAheadRows) < n1) {
      prefetch_ahead(wrow, row_bytes, srow, brow, groups * s_esize);
    }
#define LOOM_AFFINE(B, S) affine_row<MT, B, S>(xs, xsums, wrow, srow, brow, K, p.group_size, res)
#define LOOM_AFFINE_S(B)      \
  switch (p.s_dtype) {        \
    case kBF16:               \
      LOOM_AFFINE(B, kBF16);  \
      break;                  \
    case kF16:                \
      LOOM_AFFINE(B, kF16);   \
      break;                  \
    default:                  \
      LOOM_AFFINE(B, kF32);   \
  }
    switch (p.bits) {
      case 2:
        LOOM_AFFINE_S(2);
        break;
      case 3:
        LOOM_AFFINE_S(3);
        break;
      case 4:
        switch (p.s_dtype) {
          case kBF16:
            affine4_row<MT, kBF16>(xs, xsums, wrow, srow, brow, K, p.group_size, res);
            break;
          case kF16:
            affine4_row<MT, kF16>(xs, xsums, wrow, srow, brow, K, p.group_size, res);
            break;
          default:
            affine4_row<MT, kF32>(xs, xsums, wrow, srow, brow, K, p.group_size, res);
        }
        break;
      case 5:
        LOOM_AFFINE_S(5);
        break;
      case 6:
        LOOM_AFFINE_S(6);
        break;
      default:
        LOOM_AFFINE_S(8);
    }
#undef LOOM_AFFINE_S
#undef LOOM_AFFINE
    for (int m = 0; m < MT; ++m) {
      finish(p, m0 + m, n, res[m]);
    }
  }
}

// ---------------------------------------------------------------------------
// GEMM: out[M, n0:n1] = x[M, K] . W[n0:n1, K]^T
//
// Loop nest per block of kNC weight rows: for each kKC-column slice of K the
// block is dequantized/upcast once into fp32 panels of 16 rows ([kKC][16],
// zero-padded), then every 6-row tile of x runs the 6x16 micro-kernel over
// every panel (on AVX-512, 12-row tiles over pairs of panels:
// gemm_block_avx512), accumulating into an fp32 tile of the block. Each output is a
// single fused-multiply-add chain over k = 0..K-1 in order, whatever M, the
// block or the thread: rows of a GEMM do not depend on their neighbours.

constexpr int kMR = 6;
constexpr int kNR = 16;
constexpr int kKC = 256;
constexpr int kNC = 128;

// Dequantize/upcast rows [r0, r0 + rows) x columns [k0, k0 + kc) of W into
// panels: panel[j / 16][k - k0][j % 16], padded with zeros to 16 rows.
void pack_panels(const Product& p, int r0, int rows, int k0, int kc, float* panels) {
  const int panel_count = (rows + kNR - 1) / kNR;
  std::memset(panels, 0, sizeof(float) * static_cast<size_t>(panel_count) * kNR * kc);
  alignas(32) float tmp[kKC];
  const int K = p.K;
  for (int j = 0; j < rows; ++j) {
    const int n = r0 + j;
    if (p.bits == 0) {
      const size_t esize = p.w_dtype == kF32 ? 4 : 2;
      const void* wrow = static_cast<const char*>(p.w) + static_cast<size_t>(n) * K * esize;
      int k = 0;
      for (; k + 8 <= kc; k += 8) {
        __m256 v;
        switch (p.w_dtype) {
          case kBF16:
            v = load_dense8<kBF16>(wrow, k0 + k);
            break;
          case kF16:
            v = load_dense8<kF16>(wrow, k0 + k);
            break;
          default:
            v = load_dense8<kF32>(wrow, k0 + k);
        }
        _mm256_store_ps(tmp + k, v);
      }
      for (; k < kc; ++k) {
        tmp[k] = load_scalar(wrow, p.w_dtype, static_cast<size_t>(k0 + k));
      }
    } else {
      const size_t row_bytes = static_cast<size_t>(K) * p.bits / 8;
      const int groups = K / p.group_size;
      const uint8_t* wrow = static_cast<const uint8_t*>(p.w) + static_cast<size_t>(n) * row_bytes;
      const size_t srow = static_cast<size_t>(n) * groups;
      for (int k = 0; k < kc; k += 8) {
        const int g = (k0 + k) / p.group_size;
        const __m256 s = _mm256_set1_ps(load_scalar(p.scales, p.s_dtype, srow + g));
        const __m256 b = _mm256_set1_ps(load_scalar(p.biases, p.s_dtype, srow + g));
        __m256 q;
        switch (p.bits) {
          case 2:
            q = load_codes8<2>(wrow, k0 + k);
            break;
          case 3:
            q = load_codes8<3>(wrow, k0 + k);
            break;
          case 4:
            q = load_codes8<4>(wrow, k0 + k);
            break;
          case 5:
            q = load_codes8<5>(wrow, k0 + k);
            break;
          case 6:
            q = load_codes8<6>(wrow, k0 + k);
            break;
          default:
            q = load_codes8<8>(wrow, k0 + k);
        }
        _mm256_store_ps(tmp + k, _mm256_fmadd_ps(s, q, b));
      }
    }
    float* panel = panels + static_cast<size_t>(j / kNR) * kNR * kc + (j % kNR);
    for (int k = 0; k < kc; ++k) {
      panel[static_cast<size_t>(k) * kNR] = tmp[k];
    }
  }
}

// c[MR_][16] (row stride ldc) += a[MR_ rows, stride lda][0:kc] . panel[kc][16]
template <int MR_>
void micro_kernel(const float* a, size_t lda, const float* panel, int kc, float* c, size_t ldc) {
  __m256 acc[MR_][2];
  for (int i = 0; i < MR_; ++i) {
    acc[i][0] = _mm256_loadu_ps(c + i * ldc);
    acc[i][1] = _mm256_loadu_ps(c + i * ldc + 8);
  }
  for (int k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(panel + k * kNR);
    const __m256 b1 = _mm256_load_ps(panel + k * kNR + 8);
    for (int i = 0; i < MR_; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i * lda + k);
      acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR_; ++i) {
    _mm256_storeu_ps(c + i * ldc, acc[i][0]);
    _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
  }
}

void run_micro(int mr, const float* a, size_t lda, const float* panel, int kc, float* c, size_t ldc) {
  switch (mr) {
    case 6:
      micro_kernel<6>(a, lda, panel, kc, c, ldc);
      break;
    case 5:
      micro_kernel<5>(a, lda, panel, kc, c, ldc);
      break;
    case 4:
      micro_kernel<4>(a, lda, panel, kc, c, ldc);
      break;
    case 3:
      micro_kernel<3>(a, lda, panel, kc, c, ldc);
      break;
    case 2:
      micro_kernel<2>(a, lda, panel, kc, c, ldc);
      break;
    default:
      micro_kernel<1>(a, lda, panel, kc, c, ldc);
  }
}

inline size_t round_up(size_t v, size_t to) {
  return (v + to - 1) / to * to;
}

}  // namespace

// ---------------------------------------------------------------------------
// Entry points

void gemv_rows(const Product& p, const float* xsum, int n0, int n1) {
  if (p.bits == 4 && isa_avx512()) {
    gemv4_rows_avx512(p, xsum, n0, n1);
    return;
  }
  int m = 0;
  for (; m + kMaxMT <= p.M; m += kMaxMT) {
    gemv_pass<kMaxMT>(p, xsum, m, n0, n1);
  }
  switch (p.M - m) {
    case 3:
      gemv_pass<3>(p, xsum, m, n0, n1);
      break;
    case 2:
      gemv_pass<2>(p, xsum, m, n0, n1);
      break;
    case 1:
      gemv_pass<1>(p, xsum, m, n0, n1);
      break;
    default:
      break;
  }
}

void prepare_affine_x(const Product& p, float* x_out, float* xsum) {
  const int K = p.K;
  const int groups = K / p.group_size;
  for (int m = 0; m < p.M; ++m) {
    const float* x = p.x + static_cast<size_t>(m) * K;
    for (int g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int k = g * p.group_size; k < (g + 1) * p.group_size; ++k) {
        s += x[k];
      }
      xsum[static_cast<size_t>(m) * groups + g] = s;
    }
    if (p.bits == 4 && x_out != nullptr) {
      // The order affine4_row meets the codes in: per block of 64 (or a
      // last block of 32), position w * i + j holds column 8 * j + i.
      float* xo = x_out + static_cast<size_t>(m) * K;
      for (int k = 0; k < K; k += 64) {
        const int words = (K - k) >= 64 ? 8 : 4;
        for (int i = 0; i < 8; ++i) {
          for (int j = 0; j < words; ++j) {
            xo[k + words * i + j] = x[k + 8 * j + i];
          }
        }
      }
    }
  }
}

int gemm_block_rows() {
  return kNC;
}

size_t gemm_scratch_floats(int M) {
  // Panels for one block and slice, then the block's fp32 output tile, whose
  // rows are padded to whole panels so the micro-kernel never writes past it.
  return static_cast<size_t>(kNC) * kKC + static_cast<size_t>(M) * kNC + 16;
}

void gemm_rows(const Product& p, int n0, int n1, float* scratch) {
  float* panels = scratch;
  float* tile = scratch + static_cast<size_t>(kNC) * kKC;
  const int K = p.K;
  const int M = p.M;
  for (int r0 = n0; r0 < n1; r0 += kNC) {
    const int rows = (n1 - r0) < kNC ? (n1 - r0) : kNC;
    const int padded = static_cast<int>(round_up(static_cast<size_t>(rows), kNR));
    std::memset(tile, 0, sizeof(float) * static_cast<size_t>(M) * kNC);
    for (int k0 = 0; k0 < K; k0 += kKC) {
      const int kc = (K - k0) < kKC ? (K - k0) : kKC;
      pack_panels(p, r0, rows, k0, kc, panels);
      if (isa_avx512()) {
        gemm_block_avx512(p.x + k0, static_cast<size_t>(K), M, panels, kc, padded, tile, kNC);
        continue;
      }
      for (int m0 = 0; m0 < M; m0 += kMR) {
        const int mr = (M - m0) < kMR ? (M - m0) : kMR;
        const float* a = p.x + static_cast<size_t>(m0) * K + k0;
        for (int j = 0; j < padded; j += kNR) {
          run_micro(
              mr, a, static_cast<size_t>(K), panels + static_cast<size_t>(j / kNR) * kNR * kc, kc,
              tile + static_cast<size_t>(m0) * kNC + j, kNC);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      const float* src = tile + static_cast<size_t>(m) * kNC;
      for (int j = 0; j < rows; ++j) {
        finish(p, m, r0 + j, src[j]);
      }
    }
  }
}

void to_f32(const void* src, int dtype, float* dst, size_t count) {
  size_t i = 0;
  if (dtype == kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (; i + 8 <= count; i += 8) {
      _mm256_storeu_ps(dst + i, load_bf16x8(s + i));
    }
  } else if (dtype == kF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (; i + 8 <= count; i += 8) {
      _mm256_storeu_ps(dst + i, load_f16x8(s + i));
    }
  } else {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  for (; i < count; ++i) {
    dst[i] = load_scalar(src, dtype, i);
  }
}

}  // namespace loom_cpu

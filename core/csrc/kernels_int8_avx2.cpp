// 4-bit affine matrix-vector products against int8 activations: AVX2 integer
// multiply-adds (vpmaddubsw / vpmaddwd), the way llama.cpp pairs Q4 weights
// with Q8 activations.
//
// Why: the fp32 kernel spends ~34 vector operations on 64 codes (decode,
// convert, multiply-add) and so computes at about half the speed two cores
// can stream 4-bit weights from memory. Against int8 activations the same
// 64 codes take ~10 (two byte multiply-adds, one widening add, one convert,
// one scaled add), and a decode step becomes a read of the weights.
//
// Compiled like kernels_avx2.cpp (-mavx2 -mfma -mf16c, no library header
// with inline code, internal linkage; see cpu_features.cpp), plus
// -ffp-contract=off: the fp32 order below is a contract that the AVX-512
// VNNI kernel (kernels_int8_avx512.cpp) repeats bit for bit, and
// gemv4_int8_rows hands the work to that kernel where the CPU has it.
// Many activation rows (prefill) take the same per-row arithmetic over
// blocks of weight rows, so a row's result never depends on its neighbours.
//
// Layout of the prepared activations, per row of K columns (K % 32 == 0):
// per chunk of 64 columns starting at k, bytes [k, k + 32) hold the int8
// values of the chunk's even columns and bytes [k + 32, k + 64) those of its
// odd columns, each as 16 of the first block of 32 columns, then 16 of the
// second -- exactly where a chunk's 32 weight bytes put their low and high
// nibbles. A last chunk of 32 columns holds 16 even, then 16 odd. Steps:
// K / 8 floats per row, each block's step repeated over the four 32-bit
// lanes its bytes sum into. Group sums (for the affine bias term) are those
// of the quantized x, block by block in column order.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "avx2_common.h"
#include "kernels.h"

namespace loom_cpu {
namespace {

constexpr int kBlock = 32;
constexpr int kMaxMT = 4;

// 64 codes (32 bytes) against the prepared chunk of each activation row:
// lanes 0-3 of the result sum the first block's products, lanes 4-7 the
// second's, each as an exact integer converted to fp32 and times its step
// (ACC: added to part in the same rounding, one fused multiply-add).
template <int MT, bool ACC>
LOOM_HOT void chunk64(
    const uint8_t* w, const int8_t* const* xq, const float* const* steps, int k, __m256* part) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k / 2));
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, nib);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MT; ++m) {
    const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + k));
    const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + k + 32));
    // Code (0..15) times int8 (|x| <= 127), pairs summed: |.| <= 3810, and
    // the even and odd halves together <= 7620: no 16-bit saturation.
    const __m256i pairs =
        _mm256_add_epi16(_mm256_maddubs_epi16(lo, even), _mm256_maddubs_epi16(hi, odd));
    const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
    const __m256 st = _mm256_loadu_ps(steps[m] + k / 8);
    part[m] = ACC ? _mm256_fmadd_ps(sums, st, part[m]) : _mm256_mul_ps(sums, st);
  }
}

// The last 32 codes of a row whose length is an odd number of 32-blocks.
template <int MT>
LOOM_HOT void chunk32(
    const uint8_t* w, const int8_t* const* xq, const float* const* steps, int k, float* part) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2));
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, nib);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), nib);
  for (int m = 0; m < MT; ++m) {
    const __m128i even = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq[m] + k));
    const __m128i odd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq[m] + k + 16));
    const __m128i pairs = _mm_add_epi16(_mm_maddubs_epi16(lo, even), _mm_maddubs_epi16(hi, odd));
    __m128i s = _mm_madd_epi16(pairs, _mm_set1_epi16(1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    part[m] = static_cast<float>(_mm_cvtsi128_si32(s)) * steps[m][k / 8];
  }
}

// One weight row against MT activation rows. The order of every fp32
// operation is the contract the AVX-512 kernel (kernels_int8_avx512.cpp)
// repeats lane by lane, so it is spelled out here (and both files are built
// with -ffp-contract=off): per group of 64 or 128, the first chunk's lanes
// times their steps, each further chunk added by a fused multiply-add, the
// sum times the group's scale fused into the running total; with groups of
// 32 each chunk's two groups scaled by a vector of their two scales; a last
// odd group of 32 as a scalar; then the bias terms:
// res = (hsum(total) + tail) + sum_g bias_g * xsum_g.
template <int MT, int SD>
void int8_row(
    const int8_t* const* xq,
    const float* const* steps,
    const float* const* xsums,
    const uint8_t* wrow,
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
      chunk64<MT, false>(wrow, xq, steps, k0, part);
      for (int k = k0 + 64; k < k0 + group_size; k += 64) {
        chunk64<MT, true>(wrow, xq, steps, k, part);
      }
      const __m256 sv = _mm256_set1_ps(load_scalar(srow, SD, g));
      for (int m = 0; m < MT; ++m) {
        tot[m] = _mm256_fmadd_ps(sv, part[m], tot[m]);
      }
    }
  } else {
    const int K64 = K & ~63;
    for (int k = 0; k < K64; k += 64) {
      chunk64<MT, false>(wrow, xq, steps, k, part);
      const int g = k / 32;
      const __m256 sv = _mm256_set_m128(
          _mm_set1_ps(load_scalar(srow, SD, g + 1)), _mm_set1_ps(load_scalar(srow, SD, g)));
      for (int m = 0; m < MT; ++m) {
        tot[m] = _mm256_fmadd_ps(sv, part[m], tot[m]);
      }
    }
    if (K64 < K) {
      float sums[MT];
      chunk32<MT>(wrow, xq, steps, K64, sums);
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

template <int MT>
void int8_pass(
    const Product& p,
    const int8_t* xq,
    const float* steps,
    const float* xsum,
    int m0,
    int n0,
    int n1) {
  const int K = p.K;
  const int groups = K / p.group_size;
  const int8_t* xs[MT];
  const float* st[MT];
  const float* xsums[MT];
  for (int m = 0; m < MT; ++m) {
    xs[m] = xq + static_cast<size_t>(m0 + m) * K;
    st[m] = steps + static_cast<size_t>(m0 + m) * (K / 8);
    xsums[m] = xsum + static_cast<size_t>(m0 + m) * groups;
  }
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
        int8_row<MT, kBF16>(xs, st, xsums, wrow, srow, brow, K, p.group_size, res);
        break;
      case kF16:
        int8_row<MT, kF16>(xs, st, xsums, wrow, srow, brow, K, p.group_size, res);
        break;
      default:
        int8_row<MT, kF32>(xs, st, xsums, wrow, srow, brow, K, p.group_size, res);
    }
    for (int m = 0; m < MT; ++m) {
      finish(p, m0 + m, n, res[m]);
    }
  }
}

}  // namespace

size_t int8_x_bytes(int M, int K) {
  return static_cast<size_t>(M) * K;
}

size_t int8_x_steps(int M, int K) {
  return static_cast<size_t>(M) * (K / 8);
}

namespace {

// One block of 32 columns quantized eight lanes at a time: step = amax / 127
// and inv = 127 / amax (0 for an all-zero block) over amax = max |x|, each
// value rint(x * inv) clamped to +-127 (max is exact in any order, the
// vector round is rint's round-half-to-even, so the bytes are those of the
// one-element-at-a-time definition the tests restate). Writes the
// block's 16 even columns to `even` and its 16 odd ones to `odd`, returns
// the exact integer sum of its 32 values and sets *step.
//
// Why: a decode step quantizes one row per product (a Gemma-4-shaped step
// has ~60 of them, plus the experts' hidden rows), on the thread every later
// node waits for; one element at a time that was ~4 % of that thread.
LOOM_HOT int quantize_block(const float* x, int8_t* even, int8_t* odd, float* step) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax8 = _mm256_setzero_ps();
  __m256 nan8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    // max_ps returns its second operand when either is NaN: a NaN never
    // becomes the block's maximum; it is caught here instead.
    amax8 = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), amax8);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax = _mm_cvtss_f32(m4);
  // A block holding a NaN gets a NaN step, so every output it meets is NaN,
  // as over float activations (its values quantize to 0 below). An infinite
  // value gives an infinite step and an all-zero block: NaN outputs too.
  *step = _mm256_movemask_ps(nan8) != 0 ? __builtin_nanf("") : amax / 127.0f;
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m256 hi = _mm256_set1_ps(127.0f);
  const __m256 lo = _mm256_set1_ps(-127.0f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // A NaN product (a NaN x, or an infinite one times a zero inverse)
    // quantizes to 0 (its block's step carries the NaN).
    r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));
    r = _mm256_max_ps(_mm256_min_ps(r, hi), lo);
    q[i] = _mm256_cvtps_epi32(r);
  }
  // Exact sum of the 32 values (|sum| <= 32 * 127).
  __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  // To bytes in column order: the two packs interleave the 128-bit lanes
  // (dwords A0-3 B0-3 C0-3 D0-3 | A4-7 B4-7 C4-7 D4-7), the permute undoes it.
  const __m256i w16a = _mm256_packs_epi32(q[0], q[1]);
  const __m256i w16b = _mm256_packs_epi32(q[2], q[3]);
  __m256i bytes = _mm256_packs_epi16(w16a, w16b);
  bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  // Evens then odds within each 128-bit lane, then the lanes' evens together
  // (low half) and their odds together (high half).
  const __m256i split = _mm256_setr_epi8(
      0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
      0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  bytes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, split), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(even), _mm256_castsi256_si128(bytes));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(odd), _mm256_extracti128_si256(bytes, 1));
  return _mm_cvtsi128_si32(s4);
}

}  // namespace

void prepare_int8_x(const Product& p, int8_t* xq, float* steps, float* xsum) {
  const int K = p.K;
  const int groups = K / p.group_size;
  for (int m = 0; m < p.M; ++m) {
    const float* x = p.x + static_cast<size_t>(m) * K;
    int8_t* q = xq + static_cast<size_t>(m) * K;
    float* st = steps + static_cast<size_t>(m) * (K / 8);
    float* sums = xsum + static_cast<size_t>(m) * groups;
    for (int g = 0; g < groups; ++g) {
      sums[g] = 0.0f;
    }
    for (int k = 0; k < K; k += 64) {
      const int blocks = (K - k) >= 64 ? 2 : 1;
      const int half = 16 * blocks;  // bytes of even (then odd) columns
      for (int b = 0; b < blocks; ++b) {
        const int k0 = k + kBlock * b;
        float step;
        const int isum = quantize_block(x + k0, q + k + 16 * b, q + k + half + 16 * b, &step);
        for (int i = 0; i < 4; ++i) {
          st[k / 8 + 4 * b + i] = step;
        }
        // The bias term meets the quantized x too: the error of an output
        // is then sum_k w_k (x_k - x'_k) over the dequantized weights w,
        // not over the (one-signed, larger) w - bias.
        // (One fused multiply-add per block, spelled out: this file is
        // built with -ffp-contract=off.)
        float& sum = sums[k0 / p.group_size];
        sum = __builtin_fmaf(step, static_cast<float>(isum), sum);
      }
    }
  }
}

namespace {

// Rows [n0, n1) against every activation row, kMaxMT rows a pass.
void avx2_passes(
    const Product& p, const int8_t* xq, const float* steps, const float* xsum, int n0, int n1) {
  int m = 0;
  for (; m + kMaxMT <= p.M; m += kMaxMT) {
    int8_pass<kMaxMT>(p, xq, steps, xsum, m, n0, n1);
  }
  switch (p.M - m) {
    case 3:
      int8_pass<3>(p, xq, steps, xsum, m, n0, n1);
      break;
    case 2:
      int8_pass<2>(p, xq, steps, xsum, m, n0, n1);
      break;
    case 1:
      int8_pass<1>(p, xq, steps, xsum, m, n0, n1);
      break;
    default:
      break;
  }
}

// Up to this many activation rows the AVX2 kernel runs even where AVX-512
// VNNI is there: a 512-bit pass of one row leaves too little independent
// work per pair of weight rows, and on cores that split 512-bit operations
// in two (AMD Zen 4) it gains nothing per operation (the 350M model's 4-bit
// products, one activation row, two threads: 8.3 ms a token against 9.5-10.0
// with AVX-512; two rows about equal; four rows 5 % faster on AVX-512).
// Both kernels give the same bits, so the choice only moves time.
// Where the AVX-512 pass cannot read its activations as one-load operands
// (K over kInt8WideColumns, kernels_int8_avx512.cpp) it broadcasts them and
// loses to AVX2 up to four rows (two threads, 3 and 4 rows: 1024x2816
// 172 / 153 us on AVX2 against 213 / 198; 1024x2048 127 / 101 against
// 144 / 133; six rows about equal).
constexpr int kAvx2UpTo = 2;
constexpr int kAvx2UpToWideK = 4;

bool avx512_pays(const Product& p) {
  return p.M > (p.K <= kInt8WideColumns ? kAvx2UpTo : kAvx2UpToWideK);
}

// Weight rows per block when many activation rows pass over them: a block
// (64 rows of K / 2 bytes) stays in cache while every pass reads it, and the
// activations are streamed once per block (350M-shaped products, 512 rows,
// two threads, CPU time: 16 rows 76-77 ms, 64 rows 73-77 ms).
constexpr int kBlockRows = 64;

}  // namespace

void gemv4_int8_rows(
    const Product& p, const int8_t* xq, const float* steps, const float* xsum, int n0, int n1) {
  // Both sets give bit-identical results (see kernels_int8_avx512.cpp).
  if (isa_avx512() && avx512_pays(p)) {
    gemv4_int8_rows_avx512(p, xq, steps, xsum, n0, n1);
    return;
  }
  if (p.M <= kMaxMT) {
    avx2_passes(p, xq, steps, xsum, n0, n1);
    return;
  }
  // Many activation rows (a prefill chunk): blocks of weight rows, each
  // read from memory once and by every pass from cache.
  for (int b0 = n0; b0 < n1; b0 += kBlockRows) {
    avx2_passes(p, xq, steps, xsum, b0, b0 + kBlockRows < n1 ? b0 + kBlockRows : n1);
  }
}

}  // namespace loom_cpu

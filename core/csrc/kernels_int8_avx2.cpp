// 4-bit affine matrix-vector products against int8 activations: AVX2 integer
// multiply-adds (vpmaddubsw / vpmaddwd), the way llama.cpp pairs Q4 weights
// with Q8 activations.
//
// Why: the fp32 kernel spends ~34 vector operations on 64 codes (decode,
// convert, multiply-add) and so computes at about half the speed two cores
// can stream 4-bit weights from memory. Against int8 activations the same
// 64 codes take about nine (the nibbles, two byte multiply-adds, a 16-bit
// add, a widening multiply-add and part of two horizontal adds), each block
// of 32 is then converted and scaled once for eight weight rows, and a
// decode step becomes a read of the weights.
//
// Compiled like kernels_avx2.cpp (-mavx2 -mfma -mf16c, no library header
// with inline code, internal linkage; see cpu_features.cpp), plus
// -ffp-contract=off: the fp32 order below is a contract that the AVX-512
// VNNI kernel (kernels_int8_avx512.cpp) repeats bit for bit, and
// gemv4_int8_rows hands the work to that kernel where the CPU has it.
// Many activation rows (prefill) take the same per-row arithmetic over
// tiles of weight rows, so a row's result never depends on its neighbours.
//
// Layout of the prepared activations, per row of K columns (K % 32 == 0):
// per chunk of 64 columns starting at k, bytes [k, k + 32) hold the int8
// values of the chunk's even columns and bytes [k + 32, k + 64) those of its
// odd columns, each as 16 of the first block of 32 columns, then 16 of the
// second -- exactly where a chunk's 32 weight bytes put their low and high
// nibbles. A last chunk of 32 columns holds 16 even, then 16 odd. Steps:
// K / 8 floats per row, each block's step repeated four times (the kernels
// read the first). Group sums (for the affine bias term) are those of the
// quantized x, block by block in column order.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "avx2_common.h"
#include "kernels.h"

namespace loom_cpu {
namespace {

constexpr int kBlock = 32;
// Activation rows per set: a tile's weight rows are read once per set, its
// group tables built once per set.
constexpr int kRowSet = 16;
// Weight rows per tile: one per 32-bit lane of a 256-bit register.
constexpr int kTile = 8;
// Columns per span: four chunks of 64, whose eight block sums per weight
// row fill one register.
constexpr int kSpan = 256;

// Per thread: the tile's group scales and biases as fp32, group-major
// (group_table8), and its block sums.
thread_local AlignedBuffer table_scratch;
thread_local AlignedBuffer sums_scratch;

// A full span's 64-code chunks of one weight row, each as its low and high
// nibbles (the codes of the chunk's even and odd columns).
struct SpanCodes {
  __m256i lo[4];
  __m256i hi[4];
};

// The first CHUNKS of them, from column k.
template <int CHUNKS>
LOOM_HOT SpanCodes chunk_codes(const uint8_t* w, int k) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  SpanCodes c;
  for (int j = 0; j < CHUNKS; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k + 64 * j) / 2));
    c.lo[j] = _mm256_and_si256(v, nib);
    c.hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
  }
  return c;
}

// One chunk's codes against one activation row's chunk at x: eight 32-bit
// lanes, lanes 0-3 summing the first block of 32 columns and 4-7 the second
// (exact).
LOOM_HOT __m256i chunk_lanes(__m256i lo, __m256i hi, const int8_t* x) {
  const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
  // Code (0..15) times int8 (|x| <= 127), pairs summed: |.| <= 3810, and
  // the even and odd halves together <= 7620: no 16-bit saturation.
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, even), _mm256_maddubs_epi16(hi, odd));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// The same for a last, lone block of 32 columns (16 even values, then 16
// odd ones, from k): its sums in lanes 0-3, zero in 4-7.
LOOM_HOT __m256i block_lanes(const uint8_t* w, const int8_t* x, int k) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2));
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, nib);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), nib);
  const __m128i even = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + k));
  const __m128i odd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + k + 16));
  const __m128i s = _mm_madd_epi16(
      _mm_add_epi16(_mm_maddubs_epi16(lo, even), _mm_maddubs_epi16(hi, odd)), _mm_set1_epi16(1));
  return _mm256_zextsi128_si256(s);
}

// Four chunks' lanes as one register of eight block sums: per 128-bit half,
// chunk 0's block, 1's, 2's, 3's (the first blocks of the chunks in lanes
// 0-3, the second ones in 4-7; integer sums are exact in any order).
LOOM_HOT __m256i span_sums(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(c0, c1), _mm256_hadd_epi32(c2, c3));
}

// Phase one, per weight row: the exact integer sum of every block of 32
// columns against each of `rows` activation rows. The row is read in order
// (as a matrix-vector product streams it); each span's eight block sums go
// to sums[(m * spans + span) * kTile + i] as one register.
//
// A span's codes are unpacked once and kept in registers while every
// activation row meets them, and each row's four chunks are reduced as soon
// as they are made: with sixteen registers, holding every row's chunks until
// the end of the span spilled them to the stack (a quarter of a 16-row
// step's time on AVX2).
//
// R > 0 fixes the number of activation rows at compile time (one row, a
// single stream's decode, keeps the unrolled code it had); R = 0 takes
// `rows`.
template <int R>
LOOM_HOT void row_sums(
    const uint8_t* w, const uint8_t* ahead, const int8_t* const* xq, int rows, int K, int spans, int i,
    __m256i* sums) {
  if constexpr (R > 0) {
    rows = R;
  }
  const int K64 = K & ~63;
  for (int s = 0; s < spans; ++s) {
    if (ahead != nullptr) {
      // The row kAheadRows on, at this span's offset: a steady stream of
      // prefetches rather than a whole row's at once, which stalled on the
      // core's outstanding misses.
      _mm_prefetch(reinterpret_cast<const char*>(ahead) + s * (kSpan / 2), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ahead) + s * (kSpan / 2) + 64, _MM_HINT_T0);
    }
    const int k0 = s * kSpan;
    if (k0 + kSpan <= K64 && R == 1) {
      // One row: each chunk's codes meet it as soon as they are loaded.
      __m256i x[4];
      for (int j = 0; j < 4; ++j) {
        const SpanCodes c = chunk_codes<1>(w, k0 + 64 * j);
        x[j] = chunk_lanes(c.lo[0], c.hi[0], xq[0] + k0 + 64 * j);
      }
      sums[s * kTile + i] = span_sums(x[0], x[1], x[2], x[3]);
      continue;
    }
    if (k0 + kSpan <= K64) {
      const SpanCodes c = chunk_codes<4>(w, k0);
      for (int m = 0; m < rows; ++m) {
        const int8_t* x = xq[m] + k0;
        sums[(static_cast<size_t>(m) * spans + s) * kTile + i] =
            span_sums(chunk_lanes(c.lo[0], c.hi[0], x), chunk_lanes(c.lo[1], c.hi[1], x + 64),
                      chunk_lanes(c.lo[2], c.hi[2], x + 128), chunk_lanes(c.lo[3], c.hi[3], x + 192));
      }
      continue;
    }
    // The last, partial span: chunks of 64, then a lone block, then zeros.
    for (int m = 0; m < rows; ++m) {
      __m256i x[4];
      for (int j = 0; j < 4; ++j) {
        const int k = k0 + 64 * j;
        if (k < K64) {
          const SpanCodes c = chunk_codes<1>(w, k);
          x[j] = chunk_lanes(c.lo[0], c.hi[0], xq[m] + k);
        } else if (k < K) {
          x[j] = block_lanes(w, xq[m], k);
        } else {
          x[j] = _mm256_setzero_si256();
        }
      }
      sums[(static_cast<size_t>(m) * spans + s) * kTile + i] = span_sums(x[0], x[1], x[2], x[3]);
    }
  }
}

// Phase two: the fp32 operations of the contract, one weight row per lane.
// Per weight row and activation row, with s_b the exact integer sum of
// block b (32 columns) and d_b its activation step:
//
//   part = s_b * d_b for a group's first block, fma(s_b, d_b, part) for
//          each further one, in column order;
//   tot  = fma(scale_g, part, tot) at each group's end (tot from 0);
//   bsum = fma(bias_g, xsum_g, bsum) over the groups in order (from 0);
//   res  = tot + bsum.
//
// The AVX-512 kernel (kernels_int8_avx512.cpp) repeats that order lane by
// lane (both files are built with -ffp-contract=off), so its results are
// these bits.
//
// Why one weight row per lane: a block's whole sum then sits in one lane,
// so a block costs one conversion and one multiply-add per eight weight
// rows, where eight-column lanes took four of each and a horizontal sum.
LOOM_HOT __m256 tile_floats(
    const __m256i* sums,
    const float* steps,
    const float* xsums,
    const float* scales,
    const float* biases,
    int K,
    int group_size,
    int spans) {
  const int blocks = K / kBlock;
  const int per_group = group_size / kBlock;
  const int groups = K / group_size;
  __m256 tot = _mm256_setzero_ps();
  __m256 part = _mm256_setzero_ps();
  int in_group = 0;
  int g = 0;
  for (int s = 0; s < spans; ++s) {
    __m256 v[8];
    for (int i = 0; i < kTile; ++i) {
      v[i] = _mm256_castsi256_ps(_mm256_load_si256(sums + static_cast<size_t>(s) * kTile + i));
    }
    transpose8(v);  // v[j]: every row's lane j of the span
    const int b_end = blocks - s * 8 < 8 ? blocks - s * 8 : 8;
    for (int b = 0; b < b_end; ++b) {
      // Block b of the span (chunk b / 2, half b % 2) is lane 4 * (b % 2) + b / 2.
      const __m256 f = _mm256_cvtepi32_ps(_mm256_castps_si256(v[4 * (b & 1) + (b >> 1)]));
      const __m256 st = _mm256_set1_ps(steps[(s * kSpan + b * kBlock) / 8]);
      part = in_group == 0 ? _mm256_mul_ps(f, st) : _mm256_fmadd_ps(f, st, part);
      if (++in_group == per_group) {
        tot = _mm256_fmadd_ps(_mm256_loadu_ps(scales + static_cast<size_t>(g) * kTile), part, tot);
        in_group = 0;
        ++g;
      }
    }
  }
  __m256 bsum = _mm256_setzero_ps();
  for (int gg = 0; gg < groups; ++gg) {
    bsum = _mm256_fmadd_ps(
        _mm256_loadu_ps(biases + static_cast<size_t>(gg) * kTile), _mm256_set1_ps(xsums[gg]), bsum);
  }
  return _mm256_add_ps(tot, bsum);
}

// An activation row's outputs for the tile's rows [n, n + count).
LOOM_HOT void store_tile(const Product& p, int m, int n, int count, __m256 v) {
  if (p.out_dtype == kF32 && p.bias == nullptr && count == kTile) {
    _mm256_storeu_ps(static_cast<float*>(p.out) + static_cast<size_t>(m) * p.N + n, v);
    return;
  }
  alignas(32) float r[kTile];
  _mm256_store_ps(r, v);
  for (int i = 0; i < count; ++i) {
    finish(p, m, n + i, r[i]);
  }
}

// Activation rows [m0, m1) (at most kRowSet) against the weight rows
// [n0, n1), a tile of eight at a time: each tile's rows are read and its
// scales and biases made into tables once for every activation row.
template <int SD>
void int8_set(
    const Product& p, const int8_t* xq, const float* steps, const float* xsum, int m0, int m1, int n0,
    int n1) {
  const int K = p.K;
  const int rows = m1 - m0;
  const int groups = K / p.group_size;
  const int spans = (K + kSpan - 1) / kSpan;
  const size_t row_bytes = static_cast<size_t>(K) / 2;
  const size_t sb_bytes = static_cast<size_t>(groups) * (SD == kF32 ? 4 : 2);
  float* scales = static_cast<float*>(table_scratch.get(sizeof(float) * 2 * table_groups(groups) * kTile));
  float* biases = scales + table_groups(groups) * kTile;
  auto* sums = static_cast<__m256i*>(sums_scratch.get(sizeof(__m256i) * rows * spans * kTile));
  const int8_t* xs[kRowSet];
  for (int m = 0; m < rows; ++m) {
    xs[m] = xq + static_cast<size_t>(m0 + m) * K;
  }
  for (int n = n0; n < n1; n += kTile) {
    const int count = n1 - n < kTile ? n1 - n : kTile;
    const void* s[kTile];
    const void* b[kTile];
    // The tile's scales and biases (its rows' are contiguous), from memory
    // while its rows' sums are computed: group_table8 reads them right
    // after, and a task's first tile (the routed experts' products are
    // many short tasks) otherwise waited on them.
    const char* s0 = static_cast<const char*>(p.scales) + static_cast<size_t>(n) * sb_bytes;
    const char* b0 = static_cast<const char*>(p.biases) + static_cast<size_t>(n) * sb_bytes;
    for (size_t o = 0; o < count * sb_bytes; o += 64) {
      _mm_prefetch(s0 + o, _MM_HINT_T0);
      _mm_prefetch(b0 + o, _MM_HINT_T0);
    }
    for (int i = 0; i < kTile; ++i) {
      const int r = i < count ? n + i : n1 - 1;
      const uint8_t* w = static_cast<const uint8_t*>(p.w) + static_cast<size_t>(r) * row_bytes;
      s[i] = static_cast<const char*>(p.scales) + static_cast<size_t>(r) * sb_bytes;
      b[i] = static_cast<const char*>(p.biases) + static_cast<size_t>(r) * sb_bytes;
      if (i < count) {
        const bool more = r + static_cast<int>(kAheadRows) < n1;
        const uint8_t* ahead = more ? w + kAheadRows * row_bytes : nullptr;
        if (rows == 1) {
          row_sums<1>(w, ahead, xs, rows, K, spans, i, sums);
        } else {
          row_sums<0>(w, ahead, xs, rows, K, spans, i, sums);
        }
      }
    }
    // Rows past the product's end repeat its last (never stored).
    for (int i = count; i < kTile; ++i) {
      for (int m = 0; m < rows; ++m) {
        for (int sp = 0; sp < spans; ++sp) {
          sums[(static_cast<size_t>(m) * spans + sp) * kTile + i] =
              sums[(static_cast<size_t>(m) * spans + sp) * kTile + count - 1];
        }
      }
    }
    const bool over = count == kTile && table_reads_fit(n + kTile - 1, groups, p.N);
    group_table8<SD>(s, groups, scales, kTile, over);
    group_table8<SD>(b, groups, biases, kTile, over);
    for (int m = 0; m < rows; ++m) {
      const __m256 res = tile_floats(sums + static_cast<size_t>(m) * spans * kTile,
                                     steps + static_cast<size_t>(m0 + m) * (K / 8),
                                     xsum + static_cast<size_t>(m0 + m) * groups, scales, biases, K,
                                     p.group_size, spans);
      store_tile(p, m0 + m, n, count, res);
    }
  }
}

// Many activation rows (a prefill chunk): blocks of weight rows, each read
// from memory once and by every set of activation rows from cache.
constexpr int kBlockRows = 64;

// Activation rows per set for a product of K columns: as many as keep a
// tile's block sums (rows * spans registers per weight row) within about half
// of a 32 KiB L1 data cache, kRowSet at most and 4 at least, the rows split
// evenly. (Sixteen rows of 2816 columns, 45 KiB of sums, ran slower than the
// four-row passes they replaced.)
int rows_per_set(int M, int K) {
  const int spans = (K + kSpan - 1) / kSpan;
  const int bytes_per_row = spans * kTile * static_cast<int>(sizeof(__m256i));
  int most = (16 * 1024) / bytes_per_row;
  most = most < 4 ? 4 : most > kRowSet ? kRowSet : most;
  const int sets = (M + most - 1) / most;
  return (M + sets - 1) / sets;
}

template <int SD>
void avx2_sets(const Product& p, const int8_t* xq, const float* steps, const float* xsum, int n0, int n1) {
  const int set = rows_per_set(p.M, p.K);
  const int rows = p.M <= set ? n1 - n0 : kBlockRows;
  for (int b0 = n0; b0 < n1; b0 += rows) {
    const int b1 = b0 + rows < n1 ? b0 + rows : n1;
    for (int m0 = 0; m0 < p.M; m0 += set) {
      int8_set<SD>(p, xq, steps, xsum, m0, m0 + set < p.M ? m0 + set : p.M, b0, b1);
    }
  }
}

void avx2_passes(
    const Product& p, const int8_t* xq, const float* steps, const float* xsum, int n0, int n1) {
  switch (p.s_dtype) {
    case kBF16:
      avx2_sets<kBF16>(p, xq, steps, xsum, n0, n1);
      break;
    case kF16:
      avx2_sets<kF16>(p, xq, steps, xsum, n0, n1);
      break;
    default:
      avx2_sets<kF32>(p, xq, steps, xsum, n0, n1);
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


// One activation row (single-stream decode) runs the AVX2 kernel where the
// AVX-512 kernel does not pay for it (one_row_avx512, cpu_features.h): the
// AVX2 kernel reads its rows in order and scales each row's block sums
// eight rows at a time, where the AVX-512 kernel reads sixteen rows across
// and transposes every block for its one row. Measured, one row alternated
// in one process: on a Zen 4 the 350M model's int8 decode took 10.5-14.1 ms
// a token on AVX2 against 12.5-16.8; on a Zen 5 the AVX-512 kernel was
// 14-16 % faster (Qwen3-Next-shaped step, quartile 5.56 against 4.79 ms).
// From two rows on the transpose is shared and AVX-512 is faster everywhere
// measured (two rows, 32000x1024 on two threads, Zen 4: 525-715 us against
// 750-1520). Both kernels give the same bits, so the choice only moves time.
bool avx512_pays(const Product& p) {
  return p.M > 1 || one_row_avx512();
}


}  // namespace

void gemv4_int8_rows(
    const Product& p, const int8_t* xq, const float* steps, const float* xsum, int n0, int n1) {
  // Both sets give bit-identical results (see kernels_int8_avx512.cpp).
  if (isa_avx512() && avx512_pays(p)) {
    gemv4_int8_rows_avx512(p, xq, steps, xsum, n0, n1);
    return;
  }
  // Every activation row passes over a tile of eight weight rows before the
  // next tile is read, so with many rows (a prefill chunk) each weight row
  // is read from memory once and by the later passes from cache.
  avx2_passes(p, xq, steps, xsum, n0, n1);
}

}  // namespace loom_cpu

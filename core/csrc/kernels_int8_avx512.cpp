// 4-bit affine products against int8 activations on AVX-512 VNNI
// (vpdpbusd: unsigned bytes times signed bytes, four products summed into
// each 32-bit lane). The 4-bit codes (0..15) are the unsigned operand and
// the int8 activations the signed one, so no offset is needed.
//
// Why a second kernel: the AVX2 kernel (kernels_int8_avx2.cpp) spends two
// byte multiply-adds, a 16-bit add and a widening multiply-add per 64 codes,
// weight row and activation row; vpdpbusd does the same exact integer sums
// in one instruction per 64 products. Batched decode and prefill products
// (many activation rows) are bound by that arithmetic.
//
// Bit-identical to the AVX2 kernel: both compute, per weight row,
// activation row and block of 32 columns, the same exact integer sum, and
// then the same fp32 operations in the same order, one weight row per lane
// (the order is spelled out at tile_floats in the AVX2 file). Both files are
// built with -ffp-contract=off so that no compiler contracts a multiply and
// an add into one rounding in one file and not in the other.
//
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni (plus AVX2,
// FMA and F16C), and called only when cpu_features.cpp found them and the
// OS saves the zmm state. No library header with inline code is included,
// and every helper has internal linkage.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "avx2_common.h"
#include "kernels.h"

namespace loom_cpu {
namespace {

constexpr int kBlock = 32;
// Activation rows per pass: their running totals and group sums (16
// registers) fit the 32 with a block's codes (8).
constexpr int kMaxMT = 8;
// Weight rows per tile: one per 32-bit lane of a 512-bit register.
constexpr int kTile = 16;

// A tile's group scales and biases as fp32, group-major (out[g * 16 + i]
// is row i's), built by group_table16 (below; group_table8 in avx2_common.h
// for the groups past the last whole sixteen).
thread_local AlignedBuffer tables;

// The codes of one block of 32 columns of the tile's sixteen weight rows,
// transposed so that lane i of every register is row i: lo[j] holds the low
// nibbles (the block's even columns 4j..4j+3) of each row's bytes 4j..4j+3,
// hi[j] their high nibbles (odd columns 4j..4j+3).
struct BlockCodes {
  __m512i lo[4];
  __m512i hi[4];
};

LOOM_HOT BlockCodes block_codes(const uint8_t* rows, size_t stride, int k) {
  // Register q holds rows q, q + 4, q + 8, q + 12 (16 bytes each, one per
  // 128-bit lane): after the two unpacks, lane 4i + q is row 4i + q.
  const uint8_t* r0 = rows + k / 2;
  __m512i z[4];
  for (int q = 0; q < 4; ++q) {
    const uint8_t* r = r0 + q * stride;
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 4 * stride)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 8 * stride)), 2);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 12 * stride)), 3);
    z[q] = v;
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]);
  const __m512i t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]);
  const __m512i t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  const __m512i o[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                        _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
  const __m512i nib = _mm512_set1_epi8(0x0F);
  BlockCodes c;
  for (int j = 0; j < 4; ++j) {
    c.lo[j] = _mm512_and_si512(o[j], nib);
    c.hi[j] = _mm512_and_si512(_mm512_srli_epi32(o[j], 4), nib);
  }
  return c;
}

// acc + the products of `codes` (unsigned bytes) with the four activation
// bytes at p in every lane. Written as the instruction with its memory
// operand broadcast ({1to16}), which the compilers do not form from the
// intrinsics: a separate broadcast per vpdpbusd cost as much as the
// multiply-add itself.
LOOM_HOT __m512i dot4(__m512i acc, __m512i codes, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// Sixteen weight rows (one per lane; `w` the rows' codes, the last repeated
// past the product's end) against MT prepared activation rows, in the
// fp32 order the AVX2 kernel states (tile_floats in kernels_int8_avx2.cpp):
// per block, its exact integer sum converted and times its step into the
// group's partial sum (a product for the group's first block, else fused),
// at each group's end that partial times the group's scale fused into the
// total, then the bias terms one group at a time, then their sum.
//
// Why: with one weight row per lane a block's whole sum accumulates in one
// lane (eight vpdpbusd per activation row, each four columns of every row
// against a broadcast of four activation bytes), so a block costs one
// conversion and one multiply-add per sixteen weight rows. The transpose
// that puts the rows in lanes is paid once per pass and block, not per
// activation row: at 16 activation rows the products take about 1.4x fewer
// operations than with eight-column lanes.
// How a pass gets each block's transposed codes: it transposes them
// (kTranspose), does so and keeps them for the tile's later passes (kKeep),
// or loads the kept ones (kReuse): 8 loads instead of 16 loads and 20
// operations per block.
enum CodesFrom { kTranspose, kKeep, kReuse };

template <int MT, CodesFrom FROM>
LOOM_HOT void tile_pass(
    const uint8_t* rows,
    size_t stride,
    const char* next,
    __m512i* kept,
    const int8_t* acts,
    const float* steps,
    const float* const* xsums,
    const float* scales,
    const float* biases,
    int K,
    int group_size,
    __m512* res) {
  __m512 tot[MT];
  __m512 part[MT];
  for (int m = 0; m < MT; ++m) {
    tot[m] = _mm512_setzero_ps();
    part[m] = _mm512_setzero_ps();
  }
  const int blocks = K / kBlock;
  const int per_group = group_size / kBlock;
  int in_group = 0;
  const float* sv_at = scales;
  for (int blk = 0; blk < blocks; ++blk) {
    if (next != nullptr) {
      // The next tile (16 rows of K / 2 bytes: 256 bytes per block of this
      // one), swept in order while this tile computes: its rows are read
      // across, 16 bytes of each at a time, which the hardware's
      // prefetchers do not follow.
      for (int q = 0; q < 4; ++q) {
        _mm_prefetch(next + static_cast<size_t>(blk) * 256 + 64 * q, _MM_HINT_T0);
      }
    }
    BlockCodes c;
    __m512i* keep = kept + static_cast<size_t>(blk) * 8;
    if constexpr (FROM == kReuse) {
      for (int j = 0; j < 4; ++j) {
        c.lo[j] = _mm512_load_si512(keep + j);
        c.hi[j] = _mm512_load_si512(keep + 4 + j);
      }
    } else {
      c = block_codes(rows, stride, blk * kBlock);
      if constexpr (FROM == kKeep) {
        for (int j = 0; j < 4; ++j) {
          _mm512_store_si512(keep + j, c.lo[j]);
          _mm512_store_si512(keep + 4 + j, c.hi[j]);
        }
      }
    }
    const int8_t* a = acts + static_cast<size_t>(blk) * MT * 32;
    const float* st = steps + static_cast<size_t>(blk) * MT;
    for (int m = 0; m < MT; ++m) {
      const int8_t* e = a + 32 * m;  // 16 even bytes, then 16 odd ones
      __m512i s = dot4(_mm512_setzero_si512(), c.lo[0], e);
      s = dot4(s, c.hi[0], e + 16);
      for (int j = 1; j < 4; ++j) {
        s = dot4(s, c.lo[j], e + 4 * j);
        s = dot4(s, c.hi[j], e + 16 + 4 * j);
      }
      const __m512 f = _mm512_cvtepi32_ps(s);
      const __m512 d = _mm512_set1_ps(st[m]);
      part[m] = in_group == 0 ? _mm512_mul_ps(f, d) : _mm512_fmadd_ps(f, d, part[m]);
    }
    if (++in_group == per_group) {
      const __m512 sv = _mm512_loadu_ps(sv_at);
      for (int m = 0; m < MT; ++m) {
        tot[m] = _mm512_fmadd_ps(sv, part[m], tot[m]);
      }
      in_group = 0;
      sv_at += kTile;
    }
  }
  const int groups = K / group_size;
  for (int m = 0; m < MT; ++m) {
    __m512 bsum = _mm512_setzero_ps();
    for (int gg = 0; gg < groups; ++gg) {
      bsum = _mm512_fmadd_ps(_mm512_loadu_ps(biases + static_cast<size_t>(gg) * kTile),
                             _mm512_set1_ps(xsums[m][gg]), bsum);
    }
    res[m] = _mm512_add_ps(tot[m], bsum);
  }
}

// An activation row's outputs for the tile's rows [n, n + count).
LOOM_HOT void store_tile(const Product& p, int m, int n, int count, __m512 v) {
  if (p.out_dtype == kF32 && p.bias == nullptr) {
    const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1);
    _mm512_mask_storeu_ps(static_cast<float*>(p.out) + static_cast<size_t>(m) * p.N + n, keep, v);
    return;
  }
  alignas(64) float r[kTile];
  _mm512_store_ps(r, v);
  for (int i = 0; i < count; ++i) {
    finish(p, m, n + i, r[i]);
  }
}

template <int MT>
void pass_rows(
    const Product& p,
    const uint8_t* rows,
    size_t stride,
    const char* next,
    CodesFrom from,
    __m512i* kept,
    const int8_t* acts,
    const float* act_steps,
    const float* xsum,
    const float* scales,
    const float* biases,
    int m0,
    int n,
    int count) {
  const int K = p.K;
  const int groups = K / p.group_size;
  const float* xsums[MT];
  for (int m = 0; m < MT; ++m) {
    xsums[m] = xsum + static_cast<size_t>(m0 + m) * groups;
  }
  __m512 res[MT];
  const int8_t* a = acts + static_cast<size_t>(m0) * K;
  const float* st = act_steps + static_cast<size_t>(m0) * (K / kBlock);
  switch (from) {
    case kKeep:
      tile_pass<MT, kKeep>(rows, stride, next, kept, a, st, xsums, scales, biases, K, p.group_size, res);
      break;
    case kReuse:
      tile_pass<MT, kReuse>(rows, stride, next, kept, a, st, xsums, scales, biases, K, p.group_size, res);
      break;
    default:
      tile_pass<MT, kTranspose>(rows, stride, next, kept, a, st, xsums, scales, biases, K, p.group_size, res);
  }
  for (int m = 0; m < MT; ++m) {
    store_tile(p, m0 + m, n, count, res[m]);
  }
}

// Per thread: the activations laid out for the passes, and a last tile's
// rows padded to sixteen.
thread_local AlignedBuffer pass_acts;
thread_local AlignedBuffer pad_rows;
// A tile's transposed codes, kept by its first pass for the others.
thread_local AlignedBuffer kept_codes;

// The prepared activations in the order tile_pass reads them: for each pass
// of up to kMaxMT rows (from row m0, at byte m0 * K), per block of 32
// columns every row's 16 even bytes then its 16 odd ones, so a row's four
// bytes for each vpdpbusd sit at fixed offsets from one address; the block
// steps likewise, per block every row's (at float m0 * K / 32).
void lay_out_acts(const Product& p, const int8_t* xq, const float* steps, int8_t* acts, float* act_steps) {
  const int K = p.K;
  const int K64 = K & ~63;
  const int blocks = K / kBlock;
  for (int m0 = 0; m0 < p.M; m0 += kMaxMT) {
    const int mt = p.M - m0 < kMaxMT ? p.M - m0 : kMaxMT;
    int8_t* a = acts + static_cast<size_t>(m0) * K;
    float* st = act_steps + static_cast<size_t>(m0) * blocks;
    for (int blk = 0; blk < blocks; ++blk) {
      const int k = blk * kBlock;
      // prepare_int8_x's layout: within a chunk of 64, 16 even bytes per
      // block from the chunk's start and 16 odd ones after its 32 even
      // bytes; a last lone block holds 16 and 16.
      const int e = k < K64 ? (k & ~63) + (k & 32) / 2 : k;
      const int o = k < K64 ? e + 32 : k + 16;
      for (int m = 0; m < mt; ++m) {
        const int8_t* x = xq + static_cast<size_t>(m0 + m) * K;
        int8_t* dst = a + (static_cast<size_t>(blk) * mt + m) * 32;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + e)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + o)));
        st[static_cast<size_t>(blk) * mt + m] = steps[static_cast<size_t>(m0 + m) * (K / 8) + k / 8];
      }
    }
  }
}

// Sixteen values from group g on of one row of scales or biases (dtype SD)
// as fp32: the conversions load_dense8 makes, sixteen lanes at a time.
template <int SD>
LOOM_HOT __m512 load_dense16(const void* row, int g) {
  if constexpr (SD == kBF16) {
    const auto* p = static_cast<const uint16_t*>(row) + g;
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  } else if constexpr (SD == kF16) {
    const auto* p = static_cast<const uint16_t*>(row) + g;
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(row) + g);
  }
}

// r[i] (row i's values of sixteen groups) becomes r[j] (group j's value of
// every row, lane i = row i). Within each 128-bit lane two interleaves
// gather four rows' value of each of the lane's four groups; two rounds of
// lane shuffles then bring the four row quarters of each group together.
LOOM_HOT void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4a + e], lane L: rows 4a..4a+3 of group 4L + e.
  __m512 u[16];
  for (int a = 0; a < 4; ++a) {
    const __m512d t0 = _mm512_castps_pd(t[4 * a]);
    const __m512d t1 = _mm512_castps_pd(t[4 * a + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * a + 2]);
    const __m512d t3 = _mm512_castps_pd(t[4 * a + 3]);
    u[4 * a] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[4 * a + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[4 * a + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[4 * a + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0);
  constexpr int kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  for (int e = 0; e < 4; ++e) {
    // v: lanes 0 and 2 (or 1 and 3) of rows 0-3 and rows 4-7; w: of rows 8-15.
    const __m512 v0 = _mm512_shuffle_f32x4(u[e], u[4 + e], kEven);
    const __m512 v1 = _mm512_shuffle_f32x4(u[e], u[4 + e], kOdd);
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], kEven);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], kOdd);
    r[e] = _mm512_shuffle_f32x4(v0, w0, kEven);
    r[8 + e] = _mm512_shuffle_f32x4(v0, w0, kOdd);
    r[4 + e] = _mm512_shuffle_f32x4(v1, w1, kEven);
    r[12 + e] = _mm512_shuffle_f32x4(v1, w1, kOdd);
  }
}

// group_table8's table for the tile's sixteen rows at once: out[g * 16 + i]
// is row i's value of group g. Whole blocks of sixteen groups take one
// 16x16 transpose (64 shuffles, against 96 and twice the loads and stores
// for four 8x8 ones); the remaining groups go to group_table8 for each
// half, with its rule for reading past a row's end (over_lo / over_hi).
// Why: with few activation rows a tile's tables cost as much as its
// products (one row, 16 groups: 8 % of a 350M decode step).
template <int SD>
LOOM_HOT void group_table16(const void* const* rows, int groups, float* out, bool over_lo, bool over_hi) {
  constexpr size_t item = SD == kF32 ? 4 : 2;
  int g = 0;
  for (; g + 16 <= groups; g += 16) {
    __m512 r[kTile];
    for (int i = 0; i < kTile; ++i) {
      r[i] = load_dense16<SD>(rows[i], g);
    }
    transpose16(r);
    for (int j = 0; j < 16; ++j) {
      _mm512_storeu_ps(out + static_cast<size_t>(g + j) * kTile, r[j]);
    }
  }
  if (g == groups) {
    return;
  }
  const void* rest[kTile];
  for (int i = 0; i < kTile; ++i) {
    rest[i] = static_cast<const char*>(rows[i]) + g * item;
  }
  float* at = out + static_cast<size_t>(g) * kTile;
  group_table8<SD>(rest, groups - g, at, kTile, over_lo);
  group_table8<SD>(rest + 8, groups - g, at + 8, kTile, over_hi);
}

template <int SD>
void tiles(const Product& p, const int8_t* xq, const float* steps, const float* xsum, int n0, int n1) {
  const int K = p.K;
  const int groups = K / p.group_size;
  const size_t row_bytes = static_cast<size_t>(K) / 2;
  const size_t sb_bytes = static_cast<size_t>(groups) * (SD == kF32 ? 4 : 2);
  float* scales = static_cast<float*>(tables.get(sizeof(float) * 2 * table_groups(groups) * kTile));
  float* biases = scales + table_groups(groups) * kTile;
  auto* acts = static_cast<int8_t*>(pass_acts.get(static_cast<size_t>(p.M) * K + sizeof(float) * p.M * (K / kBlock)));
  auto* act_steps = reinterpret_cast<float*>(acts + static_cast<size_t>(p.M) * K);
  lay_out_acts(p, xq, steps, acts, act_steps);
  auto* kept = p.M > kMaxMT ? static_cast<__m512i*>(kept_codes.get(sizeof(__m512i) * 8 * (K / kBlock))) : nullptr;
  for (int n = n0; n < n1; n += kTile) {
    const int count = n1 - n < kTile ? n1 - n : kTile;
    const uint8_t* rows = static_cast<const uint8_t*>(p.w) + static_cast<size_t>(n) * row_bytes;
    const void* s[kTile];
    const void* b[kTile];
    for (int i = 0; i < kTile; ++i) {
      const int r = i < count ? n + i : n1 - 1;
      s[i] = static_cast<const char*>(p.scales) + static_cast<size_t>(r) * sb_bytes;
      b[i] = static_cast<const char*>(p.biases) + static_cast<size_t>(r) * sb_bytes;
    }
    if (count < kTile) {
      // A last partial tile: its rows, then the last repeated (never stored).
      auto* pad = static_cast<uint8_t*>(pad_rows.get(kTile * row_bytes));
      for (int i = 0; i < kTile; ++i) {
        std::memcpy(pad + i * row_bytes, rows + (i < count ? i : count - 1) * row_bytes, row_bytes);
      }
      rows = pad;
    }
    const char* next = nullptr;
    if (n + 2 * kTile <= n1) {
      next = reinterpret_cast<const char*>(rows) + kTile * row_bytes;
      for (size_t o = 0; o < kTile * sb_bytes; o += 64) {
        _mm_prefetch(static_cast<const char*>(s[0]) + kTile * sb_bytes + o, _MM_HINT_T0);
        _mm_prefetch(static_cast<const char*>(b[0]) + kTile * sb_bytes + o, _MM_HINT_T0);
      }
    }
    const bool over_lo = count == kTile && table_reads_fit(n + 7, groups, p.N);
    const bool over_hi = count == kTile && table_reads_fit(n + kTile - 1, groups, p.N);
    group_table16<SD>(s, groups, scales, over_lo, over_hi);
    group_table16<SD>(b, groups, biases, over_lo, over_hi);
    auto from = [&](int m0) { return p.M <= kMaxMT ? kTranspose : m0 == 0 ? kKeep : kReuse; };
    int m = 0;
    auto pass = [&]<int MT>() {
      pass_rows<MT>(p, rows, row_bytes, m == 0 ? next : nullptr, from(m), kept, acts, act_steps, xsum,
                    scales, biases, m, n, count);
    };
    for (; m + kMaxMT <= p.M; m += kMaxMT) {
      pass.template operator()<kMaxMT>();
    }
    with_rows<kMaxMT - 1>(p.M - m, pass);
  }
}

}  // namespace

void gemv4_int8_rows_avx512(
    const Product& p, const int8_t* xq, const float* steps, const float* xsum, int n0, int n1) {
  switch (p.s_dtype) {
    case kBF16:
      tiles<kBF16>(p, xq, steps, xsum, n0, n1);
      break;
    case kF16:
      tiles<kF16>(p, xq, steps, xsum, n0, n1);
      break;
    default:
      tiles<kF32>(p, xq, steps, xsum, n0, n1);
  }
}

}  // namespace loom_cpu

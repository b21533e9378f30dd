// 4-bit affine products against int8 activations on AVX-512 VNNI
// (vpdpbusd: unsigned bytes times signed bytes, four products summed into
// each 32-bit lane). The 4-bit codes (0..15) are the unsigned operand and
// the int8 activations the signed one, so no offset is needed.
//
// Why a second kernel: the AVX2 kernel (kernels_int8_avx2.cpp) spends two
// byte multiply-adds, a 16-bit add and a widening multiply-add per 64 codes
// and activation row; vpdpbusd does the same exact integer sums in two
// instructions, for two weight rows at once in a 512-bit register. Prefill
// products (many activation rows) are bound by that arithmetic.
//
// Bit-identical to the AVX2 kernel: both compute, per weight row, activation
// row and chunk of 64 codes, the same eight exact integer lane sums (lane j
// holds the products of weight bytes 4j..4j+3, low nibbles against the even
// columns and high nibbles against the odd ones), and then the same fp32
// operations in the same order, lane by lane: convert, times the block's
// step, summed over a group's chunks by fused multiply-adds, times the
// group's scale into the running total, then the same horizontal sum, tail
// and bias terms (the order is spelled out at int8_row in the AVX2 file). Here
// the low eight lanes of a 512-bit register carry weight row n and the high
// eight row n + 1; each lane meets exactly the operations its AVX2 lane
// meets. Both files are built with -ffp-contract=off so that no compiler
// contracts a multiply and an add into one rounding in one file and not in
// the other.
//
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni (plus AVX2,
// FMA and F16C), and called only when cpu_features.cpp found them and the
// OS saves the zmm state. No library header with inline code is included,
// and every helper has internal linkage.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "avx2_common.h"
#include "kernels.h"

namespace loom_cpu {
namespace {

// Activation rows per pass (eight: 8 totals and 8 partial sums of 512 bits
// fit the 32 registers with the codes and broadcasts; one thread, 2048x2048,
// 128 rows: 9.3 ms with four, 8.4 with eight), and weight rows per block of
// the blocked path (codes unpacked once per block, K bytes a row, then read
// by every activation row; 350M-shaped products, 512 rows, two threads,
// CPU time: 16 rows 61-63 ms, 64 rows 58 ms).
constexpr int kMaxMT = 8;
constexpr int kBlockRows = 64;
// From this many activation rows on, a block's codes are unpacked once into
// scratch; below it each pass unpacks them from the packed rows. Unpacking
// writes and rereads twice the codes' bytes, which only pays once the
// passes over a block are many (the 350M model's 4-bit products, two
// threads: 8 rows 32 -> 25 ms, 16 rows 51 -> 45-52 ms without it; 32 rows
// about equal; 64 rows 5-10 % faster with it). Either way a row's bits are
// the same.
constexpr int kUnpackRows = 32;

// The codes of one chunk of 64 columns of two weight rows: low nibbles of
// row n in the low 256 bits and of row n + 1 in the high ones, likewise for
// the high nibbles.
struct Codes {
  __m512i lo;
  __m512i hi;
};

LOOM_HOT Codes unpack(const uint8_t* r0, const uint8_t* r1, int k) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + k / 2));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + k / 2));
  const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  return {_mm512_and_si512(v, nib), _mm512_and_si512(_mm512_srli_epi16(v, 4), nib)};
}

// Where a pass reads the codes: the packed rows, or a block unpacked once
// (per pair of rows and chunk of 64 columns: 64 bytes of low nibbles, then
// 64 of high ones, laid out as Codes).
struct PackedCodes {
  const uint8_t* r0;
  const uint8_t* r1;
  LOOM_HOT Codes at(int k) const { return unpack(r0, r1, k); }
};

struct UnpackedCodes {
  const uint8_t* pair;  // 2 * K bytes for the 64-column chunks of the pair
  LOOM_HOT Codes at(int k) const {
    const uint8_t* c = pair + static_cast<size_t>(k) * 2;
    return {_mm512_loadu_si512(c), _mm512_loadu_si512(c + 64)};
  }
};

LOOM_HOT __m512i bcast256(const void* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}

LOOM_HOT __m512 bcast256f(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(p))));
}

// Two 8-lane vectors as one (AVX-512F only: no DQ insert).
LOOM_HOT __m512 join(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

// The exact integer sum of the 32 codes from column k (a last, odd 32-code
// group) against the prepared int8 values (16 even, then 16 odd).
LOOM_HOT int tail_sum(const uint8_t* wrow, const int8_t* xq, int k) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + k / 2));
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, nib);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), nib);
  __m128i s = _mm_dpbusd_epi32(_mm_setzero_si128(), lo, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + k)));
  s = _mm_dpbusd_epi32(s, hi, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + k + 16)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Where a pass reads its activation rows' int8 values and steps, per chunk
// of 64 columns, as 512-bit operands (the chunk's 32 even-column bytes, or
// its 32 odd ones, or its 8 steps, in both halves of the register).
//
// RowActs reads the prepared rows and broadcasts each 256-bit half as it
// goes. WideActs reads a copy laid out for the pass: per chunk, every row's
// operands already doubled and side by side, so each is one aligned load
// that the multiply-add takes straight from memory — no broadcast, and one
// base address for all MT rows. It is built per pass (MT rows x K columns,
// 3 bytes for each column: small next to the weight rows the pass reads) and
// only where it fits the core's first-level cache with room for the codes
// (kWideChunks): beyond that its doubled bytes come from the second level
// and cost more than the broadcasts they save. Measured on Zen 4, 16 rows,
// one thread: 3072x1024 0.96 -> 0.75 ms, 32000x1024 8.6 -> 7.0 ms; at
// K = 2816 (with the copy in the second level) 0.90 -> 0.99 ms, so those
// keep RowActs. Both give the same operands, so the same bits.
struct RowActs {
  const int8_t* const* xq;
  const float* const* steps;
  LOOM_HOT __m512i even(int m, int k) const {
    return bcast256(xq[m] + k);
  }
  LOOM_HOT __m512i odd(int m, int k) const {
    return bcast256(xq[m] + k + 32);
  }
  LOOM_HOT __m512 step(int m, int k) const {
    return bcast256f(steps[m] + k / 8);
  }
};

template <int MT>
struct WideActs {
  const int8_t* x;  // per chunk: MT rows of [even, even, odd, odd] x 32 bytes
  const float* s;   // per chunk: MT rows of [8 steps, the same 8 steps]
  LOOM_HOT __m512i even(int m, int k) const {
    return _mm512_load_si512(x + (static_cast<size_t>(k / 64) * MT + m) * 128);
  }
  LOOM_HOT __m512i odd(int m, int k) const {
    return _mm512_load_si512(x + (static_cast<size_t>(k / 64) * MT + m) * 128 + 64);
  }
  LOOM_HOT __m512 step(int m, int k) const {
    return _mm512_load_ps(s + (static_cast<size_t>(k / 64) * MT + m) * 16);
  }
};

// Chunks of 64 columns up to which a pass reads WideActs (8 rows: 16 chunks
// are 24 KB of operands, K = 1024; at K = 1536 and 2048 the wide copy was
// slower than the broadcasts, 232 -> 259 and 309 -> 367 us at 16 rows).
constexpr int kWideChunks = kInt8WideColumns / 64;

// hsum (avx2_common.h) of both eight-lane halves of MT (<= 8) registers at
// once: lane 2m = hsum(low half of v[m]), lane 2m + 1 = hsum(high half).
// Each level adds the lanes hsum adds, in its operand order (the low 128
// bits plus the high ones, then each even lane plus the odd one after it,
// then lane 0 plus lane 2), so every result has hsum's bits; the levels only
// gather four registers' lanes into one, so 16 sums take 22 operations
// where one hsum per half took about 7 each.
//
// Why: per pair of weight rows a pass of eight activation rows reduced 32
// halves (its totals and bias terms) one at a time, about a fifth of the
// kernel's time at 16 rows and K = 1024.
template <int MT>
LOOM_HOT __m512 hsum_halves(const __m512* v) {
  __m512 t[8];
  for (int m = 0; m < 8; ++m) {
    t[m] = m < MT ? v[m] : _mm512_setzero_ps();
  }
  // Level 1: u[j] = [t[2j] n, t[2j] n1, t[2j+1] n, t[2j+1] n1], each the
  // four lanes i + (i + 4) of that half.
  __m512 u[4];
  for (int j = 0; j < 4; ++j) {
    const __m512 lo = _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0x88);  // blocks 0, 2, 0, 2
    const __m512 hi = _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0xDD);  // blocks 1, 3, 1, 3
    u[j] = _mm512_add_ps(lo, hi);
  }
  // Level 2: per 128-bit block, lanes 0 + 1 and 2 + 3 of two registers.
  __m512 z[2];
  for (int j = 0; j < 2; ++j) {
    const __m512 ev = _mm512_shuffle_ps(u[2 * j], u[2 * j + 1], 0x88);  // lanes 0, 2, 0, 2
    const __m512 od = _mm512_shuffle_ps(u[2 * j], u[2 * j + 1], 0xDD);  // lanes 1, 3, 1, 3
    z[j] = _mm512_add_ps(ev, od);
  }
  // Level 3: (lanes 0 + 1) + (lanes 2 + 3). Lane 4q + p of r is then the
  // half (q & 1) of register 2p + (q >> 1); the permute puts it at 2m + half.
  const __m512 r = _mm512_add_ps(
      _mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// Two weight rows (n, n1; n1 == n for a last odd row) against MT prepared
// activation rows: lane 2m of the result is row m's output for n, lane
// 2m + 1 its output for n1. `xtail` holds, per group from the last whole
// eight on, every activation row's group sum in both of its lanes.
template <int MT, int SD, class Source, class Acts>
LOOM_HOT __m512 pair_rows(
    const Source& codes,
    const Acts& acts,
    const int8_t* const* xq,
    const float* const* steps,
    const float* const* xsums,
    const uint8_t* w0,
    const uint8_t* w1,
    const void* s0,
    const void* s1,
    const void* b0,
    const void* b1,
    int K,
    int group_size,
    const __m512* xtail) {
  __m512 tot[MT];
  for (int m = 0; m < MT; ++m) {
    tot[m] = _mm512_setzero_ps();
  }
  const int groups = K / group_size;
  // One chunk of 64 codes: per activation row, both weight rows' eight
  // lanes, converted and times the block steps (acc: fused into part).
  auto chunk = [&](int k, __m512* part, bool acc) __attribute__((always_inline)) {
    const Codes c = codes.at(k);
    for (int m = 0; m < MT; ++m) {
      __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c.lo, acts.even(m, k));
      s = _mm512_dpbusd_epi32(s, c.hi, acts.odd(m, k));
      const __m512 sums = _mm512_cvtepi32_ps(s);
      const __m512 st = acts.step(m, k);
      part[m] = acc ? _mm512_fmadd_ps(sums, st, part[m]) : _mm512_mul_ps(sums, st);
    }
  };
  __m512 part[MT];
  float tail[16] = {};  // [m][row]: the last odd group of 32, if any
  if (group_size >= 64) {
    for (int g = 0; g < groups; ++g) {
      const int k0 = g * group_size;
      chunk(k0, part, false);
      for (int k = k0 + 64; k < k0 + group_size; k += 64) {
        chunk(k, part, true);
      }
      const __m512 sv = join(
          _mm256_set1_ps(load_scalar(s0, SD, g)), _mm256_set1_ps(load_scalar(s1, SD, g)));
      for (int m = 0; m < MT; ++m) {
        tot[m] = _mm512_fmadd_ps(sv, part[m], tot[m]);
      }
    }
  } else {
    const int K64 = K & ~63;
    for (int k = 0; k < K64; k += 64) {
      chunk(k, part, false);
      const int g = k / 32;
      const __m256 sv0 = _mm256_set_m128(
          _mm_set1_ps(load_scalar(s0, SD, g + 1)), _mm_set1_ps(load_scalar(s0, SD, g)));
      const __m256 sv1 = _mm256_set_m128(
          _mm_set1_ps(load_scalar(s1, SD, g + 1)), _mm_set1_ps(load_scalar(s1, SD, g)));
      const __m512 sv = join(sv0, sv1);
      for (int m = 0; m < MT; ++m) {
        tot[m] = _mm512_fmadd_ps(sv, part[m], tot[m]);
      }
    }
    if (K64 < K) {
      const float t0 = load_scalar(s0, SD, groups - 1);
      const float t1 = load_scalar(s1, SD, groups - 1);
      for (int m = 0; m < MT; ++m) {
        const float st = steps[m][K64 / 8];
        const float sum0 = static_cast<float>(tail_sum(w0, xq[m], K64)) * st;
        const float sum1 = static_cast<float>(tail_sum(w1, xq[m], K64)) * st;
        tail[2 * m] = t0 * sum0;
        tail[2 * m + 1] = t1 * sum1;
      }
    }
  }
  // The bias terms as bias_terms (avx2_common.h) computes them for each
  // weight row, both rows' eight lanes side by side.
  __m512 bacc[MT];
  for (int m = 0; m < MT; ++m) {
    bacc[m] = _mm512_setzero_ps();
  }
  const int g8 = groups & ~7;
  for (int g = 0; g < g8; g += 8) {
    const __m512 bv = join(load_dense8<SD>(b0, g), load_dense8<SD>(b1, g));
    for (int m = 0; m < MT; ++m) {
      bacc[m] = _mm512_fmadd_ps(bv, bcast256f(xsums[m] + g), bacc[m]);
    }
  }
  // Then the groups past the last whole eight, one at a time into the
  // reduced sums, as bias_terms adds them.
  __m512 bs = hsum_halves<MT>(bacc);
  for (int g = g8; g < groups; ++g) {
    const float pair[2] = {load_scalar(b0, SD, g), load_scalar(b1, SD, g)};
    long long bits;
    __builtin_memcpy(&bits, pair, sizeof bits);
    const __m512 bv = _mm512_castsi512_ps(_mm512_set1_epi64(bits));
    bs = _mm512_fmadd_ps(bv, xtail[g - g8], bs);
  }
  return _mm512_add_ps(_mm512_add_ps(hsum_halves<MT>(tot), _mm512_loadu_ps(tail)), bs);
}

// The rows' addresses of one product.
struct Rows {
  const Product& p;
  size_t row_bytes;
  size_t sb_bytes;
  const uint8_t* w(int n) const {
    return static_cast<const uint8_t*>(p.w) + static_cast<size_t>(n) * row_bytes;
  }
  const void* s(int n) const {
    return static_cast<const char*>(p.scales) + static_cast<size_t>(n) * sb_bytes;
  }
  const void* b(int n) const {
    return static_cast<const char*>(p.biases) + static_cast<size_t>(n) * sb_bytes;
  }
};

// A thread's WideActs copy: at most kWideChunks chunks of kMaxMT rows
// (16 KB of operands, 8 KB of steps), a fixed size, so no allocation.
alignas(64) thread_local int8_t wide_x[kWideChunks * kMaxMT * 128];
alignas(64) thread_local float wide_s[kWideChunks * kMaxMT * 16];

// The WideActs copy of MT rows' first `chunks` (<= kWideChunks) chunks (the
// whole 64-column chunks; a last 32-column group is read from the rows).
template <int MT>
WideActs<MT> widen(const int8_t* const* xs, const float* const* st, int chunks) {
  for (int c = 0; c < chunks; ++c) {
    for (int m = 0; m < MT; ++m) {
      const size_t slot = static_cast<size_t>(c) * MT + m;
      const __m512i x = _mm512_loadu_si512(xs[m] + 64 * c);  // 32 even, then 32 odd
      _mm512_store_si512(wide_x + slot * 128, _mm512_shuffle_i64x2(x, x, 0x44));
      _mm512_store_si512(wide_x + slot * 128 + 64, _mm512_shuffle_i64x2(x, x, 0xEE));
      _mm512_store_ps(wide_s + slot * 16, bcast256f(st[m] + 8 * c));
    }
  }
  return {wide_x, wide_s};
}

// Activation rows [m0, m0 + MT) against weight rows [n0, n1); `unpacked`
// (or null: read the packed rows) holds the block's codes from row n0.
template <int MT, int SD>
void pass(
    const Rows& r,
    const int8_t* xq,
    const float* steps,
    const float* xsum,
    int m0,
    int n0,
    int n1,
    const uint8_t* unpacked) {
  const Product& p = r.p;
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
  const RowActs rows{xs, st};
  const int chunks = K / 64;
  const bool use_wide = unpacked == nullptr && chunks <= kWideChunks;
  const WideActs<MT> wide = use_wide ? widen<MT>(xs, st, chunks) : WideActs<MT>{nullptr, nullptr};
  // The group sums past the last whole eight, as pair_rows reads them.
  __m512 xtail[7];
  for (int g = groups & ~7; g < groups; ++g) {
    alignas(64) float v[16] = {};
    for (int m = 0; m < MT; ++m) {
      v[2 * m] = v[2 * m + 1] = xsums[m][g];
    }
    xtail[g - (groups & ~7)] = _mm512_load_ps(v);
  }
  // Where every output is an fp32 without a bias added (the engine's
  // products), each activation row's two outputs are stored as one pair
  // straight from the vector; otherwise through finish.
  const bool plain = p.out_dtype == kF32 && p.bias == nullptr;
  float* out = static_cast<float*>(p.out);
  for (int n = n0; n < n1; n += 2) {
    const int n1r = n + 1 < n1 ? n + 1 : n;
    const uint8_t* w0 = r.w(n);
    const uint8_t* w1 = r.w(n1r);
    __m512 res;
    if (unpacked != nullptr) {
      const UnpackedCodes c{unpacked + static_cast<size_t>(n - n0) * K};
      res = pair_rows<MT, SD>(c, rows, xs, st, xsums, w0, w1, r.s(n), r.s(n1r), r.b(n),
                              r.b(n1r), K, p.group_size, xtail);
    } else {
      if (n + static_cast<int>(kAheadRows) + 1 < n1) {
        prefetch_ahead(w0, r.row_bytes, r.s(n), r.b(n), r.sb_bytes);
        prefetch_ahead(w1, r.row_bytes, r.s(n1r), r.b(n1r), r.sb_bytes);
      }
      const PackedCodes c{w0, w1};
      if (use_wide) {
        res = pair_rows<MT, SD>(c, wide, xs, st, xsums, w0, w1, r.s(n), r.s(n1r), r.b(n),
                                r.b(n1r), K, p.group_size, xtail);
      } else {
        res = pair_rows<MT, SD>(c, rows, xs, st, xsums, w0, w1, r.s(n), r.s(n1r), r.b(n),
                                r.b(n1r), K, p.group_size, xtail);
      }
    }
    if (plain && n1r != n) {
      const __m128 q[4] = {_mm512_castps512_ps128(res), _mm512_extractf32x4_ps(res, 1),
                           _mm512_extractf32x4_ps(res, 2), _mm512_extractf32x4_ps(res, 3)};
      for (int m = 0; m < MT; ++m) {
        __m64* dst = reinterpret_cast<__m64*>(out + static_cast<size_t>(m0 + m) * p.N + n);
        if (m % 2 == 0) {
          _mm_storel_pi(dst, q[m / 2]);
        } else {
          _mm_storeh_pi(dst, q[m / 2]);
        }
      }
    } else {
      alignas(64) float v[16];
      _mm512_store_ps(v, res);
      for (int m = 0; m < MT; ++m) {
        finish(p, m0 + m, n, v[2 * m]);
        if (n1r != n) {
          finish(p, m0 + m, n1r, v[2 * m + 1]);
        }
      }
    }
  }
}

template <int SD>
void passes(
    const Rows& r,
    const int8_t* xq,
    const float* steps,
    const float* xsum,
    int n0,
    int n1,
    const uint8_t* unpacked) {
  const int M = r.p.M;
  int m = 0;
  for (; m + kMaxMT <= M; m += kMaxMT) {
    pass<kMaxMT, SD>(r, xq, steps, xsum, m, n0, n1, unpacked);
  }
  switch (M - m) {
    case 7:
      pass<7, SD>(r, xq, steps, xsum, m, n0, n1, unpacked);
      break;
    case 6:
      pass<6, SD>(r, xq, steps, xsum, m, n0, n1, unpacked);
      break;
    case 5:
      pass<5, SD>(r, xq, steps, xsum, m, n0, n1, unpacked);
      break;
    case 4:
      pass<4, SD>(r, xq, steps, xsum, m, n0, n1, unpacked);
      break;
    case 3:
      pass<3, SD>(r, xq, steps, xsum, m, n0, n1, unpacked);
      break;
    case 2:
      pass<2, SD>(r, xq, steps, xsum, m, n0, n1, unpacked);
      break;
    case 1:
      pass<1, SD>(r, xq, steps, xsum, m, n0, n1, unpacked);
      break;
    default:
      break;
  }
}

// Unpack weight rows [n0, n1) into `dst` (pairs of rows, a last odd row
// paired with itself), the layout UnpackedCodes reads. The 64-column chunks
// only: a last 32-code group is read from the packed row.
void unpack_block(const Rows& r, int n0, int n1, uint8_t* dst) {
  const int K64 = r.p.K & ~63;
  for (int n = n0; n < n1; n += 2) {
    const uint8_t* w0 = r.w(n);
    const uint8_t* w1 = r.w(n + 1 < n1 ? n + 1 : n);
    uint8_t* out = dst + static_cast<size_t>(n - n0) * r.p.K;
    for (int k = 0; k < K64; k += 64) {
      const Codes c = unpack(w0, w1, k);
      _mm512_storeu_si512(out + static_cast<size_t>(k) * 2, c.lo);
      _mm512_storeu_si512(out + static_cast<size_t>(k) * 2 + 64, c.hi);
    }
  }
}

// A thread's buffer for one unpacked block (kept between calls).
thread_local uint8_t* block_buf = nullptr;
thread_local size_t block_size = 0;

uint8_t* block_scratch(size_t bytes) {
  if (bytes > block_size) {
    std::free(block_buf);
    block_buf = static_cast<uint8_t*>(std::malloc(bytes));
    if (block_buf == nullptr) {
      block_size = 0;
      return nullptr;
    }
    block_size = bytes;
  }
  return block_buf;
}

template <int SD>
void rows_for(const Product& p, const int8_t* xq, const float* steps, const float* xsum, int n0, int n1) {
  const int groups = p.K / p.group_size;
  const Rows r{p, static_cast<size_t>(p.K) / 2,
               static_cast<size_t>(groups) * (p.s_dtype == kF32 ? 4 : 2)};
  if (p.M < kUnpackRows) {
    passes<SD>(r, xq, steps, xsum, n0, n1, nullptr);
    return;
  }
  // Blocked: each block of weight rows is unpacked once and then read by
  // every activation row from cache.
  uint8_t* buf = block_scratch(static_cast<size_t>(kBlockRows + 1) * p.K + 64);
  for (int b0 = n0; b0 < n1; b0 += kBlockRows) {
    const int b1 = b0 + kBlockRows < n1 ? b0 + kBlockRows : n1;
    if (buf != nullptr) {
      unpack_block(r, b0, b1, buf);
    }
    passes<SD>(r, xq, steps, xsum, b0, b1, buf);
  }
}

}  // namespace

void gemv4_int8_rows_avx512(
    const Product& p, const int8_t* xq, const float* steps, const float* xsum, int n0, int n1) {
  switch (p.s_dtype) {
    case kBF16:
      rows_for<kBF16>(p, xq, steps, xsum, n0, n1);
      break;
    case kF16:
      rows_for<kF16>(p, xq, steps, xsum, n0, n1);
      break;
    default:
      rows_for<kF32>(p, xq, steps, xsum, n0, n1);
  }
}

}  // namespace loom_cpu

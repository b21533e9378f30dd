// Plain-data interface of the per-token kernels that surround the matrix
// products: RMS norm, rotary embedding, softmax attention and the SwiGLU
// gate. Like kernels.h,
// nothing here is a template or an inline function: the definitions live in
// ops_avx2.cpp, built for AVX2 + FMA + F16C and called only after the CPU
// check.
//
// On MLX's CPU backend each of these is a fallback graph of ten to thirty
// element-wise operations (a 24-layer decode step builds ~3000 nodes, most of
// them from these three), and attention's products go to the reference BLAS;
// here each is one node.
#pragma once

#include <cstddef>
#include <cstdint>

namespace loom_cpu {

// Widest rows the norm and the rotary embedding take (their row buffers live
// on the stack); wider ones are refused before any kernel runs.
constexpr int kMaxNormWidth = 16384;
constexpr int kMaxRopeWidth = 4096;

// y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w  (w optional), for
// rows [r0, r1) of a row-major [rows, D] array; fp32 arithmetic, outputs
// rounded once to out_dtype. Dtype codes as in kernels.h.
struct NormJob {
  const void* x = nullptr;
  int x_dtype = 0;
  const void* w = nullptr;  // [D] or null
  int w_dtype = 0;
  void* out = nullptr;
  int out_dtype = 0;
  int D = 0;
  float eps = 0.0f;
};
void rms_norm_rows(const NormJob& job, int r0, int r1);

// Rotary embedding of x viewed as [R, L, D] (R = the leading axes), rotating
// the first `dims` features of each row and copying the rest. Row r of the
// sequence axis sits at position offsets[r / rows_per_offset] + l (one
// offset for every leading row when n_offsets is 1). Angles follow MLX's
// fast.rope: theta_i = position * scale * inv_freq[i], inv_freq[i] =
// base^(-2i/dims), or 1 / freqs[i] when freqs is given; pairs are (2i,
// 2i+1) when traditional, else (i, i + dims/2).
struct RopeJob {
  const void* x = nullptr;
  int x_dtype = 0;
  void* out = nullptr;
  int R = 0;
  int L = 0;
  int D = 0;
  int dims = 0;
  bool traditional = false;
  const float* inv_freq = nullptr;  // dims / 2 values, computed by the caller
  float scale = 1.0f;
  const int32_t* offsets = nullptr;
  int n_offsets = 1;
};
void rope_rows(const RopeJob& job, int r0, int r1);

// softmax(scale * q k^T + mask) v for q [B, Hq, L, D], k [B, Hkv, S, D],
// v [B, Hkv, S, Dv] (query head h reads key/value head h / (Hq / Hkv)).
// k and v may be strided on their first three axes (cache windows are views
// of larger buffers); their last axis is contiguous. `causal`: query l sees
// keys 0 .. S - L + l. `mask`: optional additive fp32 [B, Hq, L, S], read
// through its strides (a broadcast mask is never expanded). Scores, the
// softmax and the weighted sum are fp32; the output is rounded once. k and v
// share a dtype that may differ from q's (a half-precision KV cache read by
// fp32 queries): each element becomes fp32 exactly.
struct AttentionJob {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int dtype = 0;     // q's
  int kv_dtype = 0;  // k's and v's
  void* out = nullptr;
  int out_dtype = 0;
  int B = 0;
  int Hq = 0;
  int Hkv = 0;
  int L = 0;
  int S = 0;
  int D = 0;
  int Dv = 0;
  size_t k_strides[3] = {0, 0, 0};
  size_t v_strides[3] = {0, 0, 0};
  float scale = 1.0f;
  bool causal = false;
  const float* mask = nullptr;
  size_t m_strides[4] = {0, 0, 0, 0};  // in elements; 0 on broadcast axes
  // Optional: batch row b attends over its first lengths[b] keys only
  // (lengths[0] for every row when n_lengths is 1), clamped to [0, S]: a
  // compiled decode step passes its whole key buffer and the valid length.
  const int32_t* lengths = nullptr;
  int n_lengths = 0;
};
// Scratch one call of attention_heads needs, in floats.
size_t attention_scratch_floats(const AttentionJob& job);
// Query heads [t0, t1) of the flattened (b, h) range.
void attention_heads(const AttentionJob& job, int t0, int t1, float* scratch);

// out[i] = silu(gate[i]) * up[i] for i in [i0, i1), float32 (out may be
// gate), computed with exactly the operations of MLX's CPU backend (its exp
// polynomial and the same fused multiply-adds, eight lanes at a time), so
// the result equals mlx_lm's compiled SwiGLU bit for bit. MLX evaluates it
// one element at a time (~25 ns an element here: ~1.6 ms of a 350M model's
// decode step).
void silu_mul(const float* gate, const float* up, float* out, size_t i0, size_t i1);

// out = x - logsumexp(x) for rows [r0, r1) of a row-major float32 [rows, V]
// array, with MLX's CPU arithmetic: the row maximum, each exp(x - max) by
// its exp (eight lanes at a time), their sum in column order, logf of the
// sum plus the maximum (the maximum itself when it is infinite). Equals
// `logits - mx.logsumexp(logits, -1, keepdims=True)` bit for bit; MLX
// evaluates it one element at a time (~0.9 ms of a 32000-word vocabulary).
void log_softmax_rows(const float* x, float* out, int V, int r0, int r1);

}  // namespace loom_cpu

// Plain-data interface between the MLX primitive (built for any x86-64) and
// the SIMD kernels (built for AVX2 + FMA + F16C, called only after the CPU
// was checked at run time). Nothing here is a template or an inline function,
// so no code compiled with AVX2 can be merged into the baseline objects.
#pragma once

#include <cstddef>
#include <cstdint>

namespace loom_cpu {

// Storage dtypes the kernels read or write.
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// One product  out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).
//
// x is row-major fp32 [M, K] (the caller upcasts bf16/fp16 activations once).
// W is either dense ([N, K] in w_dtype) or affine-quantized: a little-endian
// bit stream of `bits`-bit codes per row (K * bits / 8 bytes per row) with one
// scale and one bias per `group_size` codes ([N, K / group_size] in
// s_dtype), dequantized as  w = scale * q + bias  (one fused multiply-add).
struct Product {
  const float* x = nullptr;
  int M = 0;
  int N = 0;
  int K = 0;
  const void* w = nullptr;
  int w_dtype = kF32;   // dense weights only
  int bits = 0;         // 0 = dense; else 2, 3, 4, 5, 6 or 8
  int group_size = 0;   // affine only: 32, 64 or 128
  const void* scales = nullptr;
  const void* biases = nullptr;
  int s_dtype = kF32;   // scales and biases
  const void* bias = nullptr;  // optional [N] in b_dtype
  int b_dtype = kF32;
  void* out = nullptr;  // [M, N] in out_dtype
  int out_dtype = kF32;
};

// Rows [n0, n1) of the product by the matrix-vector kernel: each output row
// is one fixed-order dot product per activation row, so row m of a call with
// M rows is bit-identical to the same row computed alone.
// For affine weights x must first go through prepare_affine_x; `xsum` holds
// its per-group sums (M * K / group_size floats; unused for dense weights).
void gemv_rows(const Product& p, const float* xsum, int n0, int n1);
// gemv_rows for 4-bit affine weights on AVX-512 (kernels_avx512.cpp):
// gemv_rows hands 4-bit products to it when isa_avx512() says so; the
// results are bit-identical to the AVX2 kernel's.
void gemv4_rows_avx512(const Product& p, const float* xsum, int n0, int n1);
// The GEMM's packed block on AVX-512 (kernels_avx512.cpp): c[M][padded]
// (row stride ldc) += a[M rows, stride lda][0:kc] . the panels ([kc][16]
// each, padded / 16 of them, as gemm_rows packs them). Bit-identical to the
// AVX2 micro-kernel; gemm_rows hands blocks to it when isa_avx512() says so.
void gemm_block_avx512(
    const float* a, size_t lda, int M, const float* panels, int kc, int padded, float* c, size_t ldc);

// Affine matrix-vector products need the per-group sums of x (xsum gets
// M * K / group_size floats, each summed in column order) and, for 4-bit
// codes, x reordered the way the codes unpack (x_out gets M * K floats).
void prepare_affine_x(const Product& p, float* x_out, float* xsum);

// Rows [n0, n1) of W against all M activation rows by the blocked GEMM
// (weights dequantized/upcast once per block into fp32 panels, a 6x16 FMA
// micro-kernel, 12x32 on AVX-512). `scratch` must hold
// gemm_scratch_floats(M) floats.
void gemm_rows(const Product& p, int n0, int n1, float* scratch);
size_t gemm_scratch_floats(int M);
// GEMM work is split across threads in blocks of this many weight rows.
int gemm_block_rows();

// --- 4-bit affine products against int8 activations (kernels_int8_avx2.cpp)
//
// Each activation row is quantized in blocks of 32 columns to int8 with one
// fp32 step per block, d = max|x| / 127, x_q = round(x / d); the weights'
// codes then meet x_q in integer multiply-adds (exact), and each block's
// integer sum is scaled by d and the group's scale in fp32; the affine bias
// term meets the group sums of d * x_q. So the one approximation is
// x -> d * x_q, at most d / 2 per column, and an output differs from the
// exact product with the dequantized weights w by at most
// sum_k |w_k| * d(k) / 2  plus fp32 rounding.

// Bytes of int8 activations and floats of block steps for M rows of K
// columns (K a multiple of 32).
size_t int8_x_bytes(int M, int K);
size_t int8_x_steps(int M, int K);

// Quantize p.x (fp32 [M, K]) into `xq`/`steps` in the order the kernel
// reads them, and write the group sums of the quantized x into `xsum`. A
// block holding a NaN gets a NaN step (its row's outputs are NaN, as over
// float activations).
void prepare_int8_x(const Product& p, int8_t* xq, float* steps, float* xsum);

// Rows [n0, n1) of a 4-bit affine product against the prepared activations.
// Each output is a fixed-order sum per activation row, so a row of a call
// with M rows is bit-identical to the same row computed alone.
// Any number of rows M: with many rows (prefill) the weight rows are taken in
// blocks that every activation row reads from cache. Runs the AVX-512 VNNI
// kernel (kernels_int8_avx512.cpp) when isa_avx512() says so (for one
// row, when one_row_avx512() says so too), else AVX2; the two give
// bit-identical results.
void gemv4_int8_rows(
    const Product& p, const int8_t* xq, const float* steps, const float* xsum, int n0, int n1);
// The int8 kernels take weight rows in tiles of 8 (AVX2) and 16 (AVX-512),
// padding a last partial tile; callers that split a product's rows into
// tasks size each task with whole_tiles, so only the matrix's end can leave
// a partial tile.
constexpr int kInt8TileRows = 16;
inline int whole_tiles(int rows) {
  return (rows + kInt8TileRows - 1) / kInt8TileRows * kInt8TileRows;
}
void gemv4_int8_rows_avx512(
    const Product& p, const int8_t* xq, const float* steps, const float* xsum, int n0, int n1);

// Whether the kernels with an AVX-512 variant (the int8 products, the
// fp32 4-bit matrix-vector product and the GEMM's micro-kernel) run it now (cpu_features.cpp: the CPU
// has AVX-512 with VNNI and MLX_LOOM_CPU_ISA does not ask for avx2). Throws
// std::invalid_argument for a bad MLX_LOOM_CPU_ISA.
bool isa_avx512();
// Whether one activation row's int8 products take the AVX-512 kernel too,
// on this CPU (cpu_features.h says why it depends on the CPU).
bool one_row_avx512();

// Activations to fp32: rows [m0, m1) of a row-major [M, K] array.
void to_f32(const void* src, int dtype, float* dst, size_t count);

}  // namespace loom_cpu

// The MLX primitive behind the native CPU kernel set: x @ W.T (+ bias) for
// dense (fp32/bf16/fp16) and affine-quantized weights.
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace loom_cpu {

namespace mx = mlx::core;

// Products with at most this many activation rows run the matrix-vector
// kernel (each row bit-identical to the same row alone: batched decode and
// speculative verification reproduce single-token decode); larger ones run
// the blocked GEMM. Measured on one core (4-bit, 2816x1024), the GEMM's
// per-call packing makes it slower than the matrix-vector kernel up to ~32
// rows (11.8 against 23.8 GMAC/s at 32) and faster from 64 on.
constexpr int kSmallRows = 32;

mx::array dense_matmul(
    const mx::array& x,
    const mx::array& w,
    const std::optional<mx::array>& bias,
    mx::StreamOrDevice s = {});

mx::array affine_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int bits,
    int group_size,
    const std::optional<mx::array>& bias,
    bool int8_activations = false,
    mx::StreamOrDevice s = {});

class NativeMatmul : public mx::Primitive {
 public:
  // int8_x: matrix-vector products quantize the activations to int8
  // (kernels.h, 4-bit weights only).
  NativeMatmul(mx::Stream stream, int bits, int group_size, bool has_bias, bool int8_x)
      : mx::Primitive(stream),
        bits_(bits),
        group_size_(group_size),
        has_bias_(has_bias),
        int8_x_(int8_x) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    if (bits_ == 0) {
      return "LoomDenseMatmul";
    }
    return int8_x_ ? "LoomAffineMatmulInt8x" : "LoomAffineMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int bits_;
  int group_size_;
  bool has_bias_;
  bool int8_x_;
};

}  // namespace loom_cpu

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

// Most weights one multi-output product takes.
constexpr int kMaxParts = 8;

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

// silu(x @ gate.T) * (x @ up.T) as one node, for float32 x and two weights of
// one shape and dtype (the gate and up projections of a SwiGLU MLP): one
// pool region instead of three nodes, x prepared once. Bit-equal to the two
// products followed by silu_mul (native_ops.h); with gelu, gelu_tanh(...) *
// (...), bit-equal to the two products followed by gelu_mul (GeGLU).
mx::array gated_dense_matmul(
    const mx::array& x,
    const mx::array& gate,
    const mx::array& up,
    bool gelu = false,
    mx::StreamOrDevice s = {});

mx::array gated_affine_matmul(
    const mx::array& x,
    const mx::array& gate,
    const mx::array& gate_scales,
    const mx::array& gate_biases,
    const mx::array& up,
    const mx::array& up_scales,
    const mx::array& up_biases,
    int bits,
    int group_size,
    bool int8_activations = false,
    bool gelu = false,
    mx::StreamOrDevice s = {});

// x @ w_i.T for several weights of one row length read the same way (all
// dense of one dtype, or all affine of one width, group size and scale
// dtype), as one node with one output each: the projections of one
// activation (an attention's q, k and v) in one pool region, x prepared
// once. Each output equals dense_matmul / affine_matmul bit for bit.
std::vector<mx::array> multi_dense_matmul(
    const mx::array& x, const std::vector<mx::array>& weights, mx::StreamOrDevice s = {});

std::vector<mx::array> multi_affine_matmul(
    const mx::array& x,
    const std::vector<mx::array>& weights,
    const std::vector<mx::array>& scales,
    const std::vector<mx::array>& biases,
    int bits,
    int group_size,
    bool int8_activations = false,
    mx::StreamOrDevice s = {});

class NativeMatmul : public mx::Primitive {
 public:
  // int8_x: matrix-vector products quantize the activations to int8
  // (kernels.h, 4-bit weights only). gated: the inputs hold a gate and an
  // up weight and the output is silu(gate product) * up product, or with
  // gelu gelu_tanh(gate product) * up product. parts: the number of weights
  // of a multi-output product (one output each; 1 for the other kinds).
  NativeMatmul(
      mx::Stream stream,
      int bits,
      int group_size,
      bool has_bias,
      bool int8_x,
      bool gated,
      int parts = 1,
      bool gelu = false)
      : mx::Primitive(stream),
        bits_(bits),
        group_size_(group_size),
        has_bias_(has_bias),
        int8_x_(int8_x),
        gated_(gated),
        gelu_(gelu),
        parts_(parts) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    if (bits_ == 0) {
      if (parts_ > 1) {
        return "LoomMultiDenseMatmul";
      }
      if (gated_) {
        return gelu_ ? "LoomGatedDenseMatmulGelu" : "LoomGatedDenseMatmul";
      }
      return "LoomDenseMatmul";
    }
    if (gated_ && gelu_) {
      return int8_x_ ? "LoomGatedAffineMatmulGeluInt8x" : "LoomGatedAffineMatmulGelu";
    }
    if (gated_) {
      return int8_x_ ? "LoomGatedAffineMatmulInt8x" : "LoomGatedAffineMatmul";
    }
    if (parts_ > 1) {
      return int8_x_ ? "LoomMultiAffineMatmulInt8x" : "LoomMultiAffineMatmul";
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
  bool gated_;
  bool gelu_;
  int parts_;
};

}  // namespace loom_cpu

// The MLX primitive behind the native routed experts: products of stacked
// expert weights ([experts, N, K], dense or affine-quantized) with the
// experts a router chose for each token, as one graph node.
#pragma once

#include <optional>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace loom_cpu {

namespace mx = mlx::core;

// Most weights the first stage of one gathered product takes (a GLU's gate
// and up projections).
constexpr int kMaxGatherParts = 2;

// For every (token, expert) pair -- indices [..., k] name the k experts of
// each token -- the product of the pair's activation row with that expert's
// weight. x is [T, K] (one row per token, shared by its k pairs) or
// [T * k, K] (one row per pair), flattened from any leading shape; each
// output is indices.shape + [N].
//
// The pairs are grouped by expert inside the node, and each expert's rows
// run the native linear kernels (native_matmul.h) on that expert's matrix:
// every output equals dense_matmul / affine_matmul of the expert's rows, in
// pair order, bit for bit (the matrix-vector kernel up to kSmallRows rows
// per expert, the GEMM above that, as those calls choose).
//
// gated (two weights, float32 x): one output, silu(x W0[e].T) * (x W1[e].T),
// equal to gated_dense_matmul / gated_affine_matmul of the expert's rows.
// gelu (gated only): gelu_tanh in place of silu, the two products as
// above and the gate activations.h's (within its bound of MLX's GeGLU).
// down (gated only): that hidden row then meets down[e] ([experts, D, N],
// read the same way) in the same node -- a SwiGLU expert layer as one node.
std::vector<mx::array> gather_dense_matmul(
    const mx::array& x,
    const mx::array& indices,
    const std::vector<mx::array>& weights,
    bool gated,
    bool gelu,
    const std::optional<mx::array>& down,
    mx::StreamOrDevice s = {});

std::vector<mx::array> gather_affine_matmul(
    const mx::array& x,
    const mx::array& indices,
    const std::vector<mx::array>& weights,
    const std::vector<mx::array>& scales,
    const std::vector<mx::array>& biases,
    int bits,
    int group_size,
    bool int8_activations,
    bool gated,
    bool gelu,
    const std::optional<mx::array>& down,
    const std::optional<mx::array>& down_scales,
    const std::optional<mx::array>& down_biases,
    mx::StreamOrDevice s = {});

class NativeGatherMatmul : public mx::Primitive {
 public:
  NativeGatherMatmul(
      mx::Stream stream,
      int bits,
      int group_size,
      bool int8_x,
      int parts,
      bool gated,
      bool gelu,
      bool down)
      : mx::Primitive(stream),
        bits_(bits),
        group_size_(group_size),
        int8_x_(int8_x),
        parts_(parts),
        gated_(gated),
        gelu_(gelu),
        down_(down) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    if (down_) {
      return bits_ == 0 ? "LoomExpertsDenseGLU" : (int8_x_ ? "LoomExpertsAffineGLUInt8x"
                                                            : "LoomExpertsAffineGLU");
    }
    if (bits_ == 0) {
      return "LoomGatherDenseMatmul";
    }
    return int8_x_ ? "LoomGatherAffineMatmulInt8x" : "LoomGatherAffineMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int bits_;
  int group_size_;
  bool int8_x_;
  int parts_;
  bool gated_;
  bool gelu_;
  bool down_;
};

}  // namespace loom_cpu

// The MLX primitive behind the native GLU gate activations that have no
// bit-equal native form (GeGLU's tanh): one graph node per gate.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace loom_cpu {

namespace mx = mlx::core;

// gelu_tanh(gate) * up for float32 arrays of one shape (activations.h: the
// arithmetic and its bound against MLX's gelu_approx(gate) * up).
mx::array gelu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

class NativeGeluMul : public mx::Primitive {
 public:
  explicit NativeGeluMul(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "LoomGeluMul";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const NativeGeluMul*>(&other) != nullptr;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

}  // namespace loom_cpu

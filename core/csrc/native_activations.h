// The MLX primitives behind small element-wise nodes of the native forward:
// the activations that have no bit-equal native form (the C library's
// tanhf: GeGLU's gate, the logit soft cap), and the routed experts' weighted
// sum. One graph node each.
#pragma once

#include <optional>

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

// tanh(x / cap) * cap for a float32 array and a finite cap > 0 (activations.h:
// the arithmetic and its bound against MLX's evaluation).
mx::array softcap(const mx::array& x, float cap, mx::StreamOrDevice s = {});

class NativeSoftcap : public mx::Primitive {
 public:
  NativeSoftcap(mx::Stream stream, float cap) : mx::Primitive(stream), cap_(cap) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "LoomSoftcap";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const NativeSoftcap*>(&other);
    return o != nullptr && o->cap_ == cap_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float cap_;
};

// sum_j w[..., j] * y[..., j, :] for float32 y [..., k, D] and w [..., k]:
// the routed experts' outputs weighted and summed, as one node instead of
// MLX's expand, broadcast, multiply, sum and squeeze. Bit-equal to MLX's
// (y * w[..., None]).sum(axis=-2): each product rounded, then summed from
// j = 0 up, one rounding per add.
// With a shared expert's output `shared` [..., D] and its gate weight
// `shared_w` [..., 1] (Qwen3-Next: sigmoid of the shared gate), one more
// term: the mix plus shared_w * shared, bit-equal to MLX's
// mix + shared_w * shared. Why: inside a compiled step MLX fuses the
// gate's sigmoid into the broadcast product and so evaluates it once per
// output element (16 rows x 1024 columns: 16384 scalar exps a layer
// instead of 16); as an input of this node it is evaluated once a token.
mx::array expert_mix(
    const mx::array& y,
    const mx::array& w,
    const std::optional<mx::array>& shared = std::nullopt,
    const std::optional<mx::array>& shared_w = std::nullopt,
    mx::StreamOrDevice s = {});

class NativeExpertMix : public mx::Primitive {
 public:
  explicit NativeExpertMix(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "LoomExpertMix";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const NativeExpertMix*>(&other) != nullptr;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.erase(shape.end() - 2);
    return {shape};
  }
};

}  // namespace loom_cpu

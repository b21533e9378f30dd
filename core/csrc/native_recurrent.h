// The MLX primitive behind the native gated delta recurrence: every step of
// a chunk for every head as one graph node (the recurrent state float32).
#pragma once

#include <optional>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace loom_cpu {

namespace mx = mlx::core;

// mx.fast.gated_delta_update(q, k, v, g, beta, state) without a mask, for
// float32 q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g and beta [B, T, Hv] (one
// decay per head), state [B, Hv, Dv, Dk]; Hv a multiple of Hk (value head h
// reads key head h / (Hv / Hk)). Returns y [B, T, Hv, Dv] and the state
// after the last step (recurrent.h: the arithmetic). mask (bool [B, T],
// optional): a step where it is false leaves the state as it was (its y is
// still read from the updated rows), as MLX's masked update does; the other
// steps' arithmetic is the unmasked one, so a padded batch row equals the
// row alone.
std::vector<mx::array> gated_delta(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& g,
    const mx::array& beta,
    const mx::array& state,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s = {});

class NativeGatedDelta : public mx::Primitive {
 public:
  explicit NativeGatedDelta(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "LoomDeltaRecurrence";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const NativeGatedDelta*>(&other) != nullptr;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[2].shape(), inputs[5].shape()};
  }
};

}  // namespace loom_cpu

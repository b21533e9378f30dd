// The gated delta rule (Qwen3-Next / Qwen3.5 linear attention) as one MLX
// primitive: the recurrence over a whole prompt in one node, where MLX's CPU
// backend builds ~10 operations per token.
#pragma once

#include <optional>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace loom_cpu {

namespace mx = mlx::core;

// {y, state} of the gated delta rule over T steps, all float32: q, k
// [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv], state [B, Hv, Dv, Dk],
// Hv a multiple of Hk; mask (bool [B, T]) leaves the state unchanged at its
// false steps (y is 0 there). Per step and value row i of a head:
// S_i = g S_i; d = (v_i - S_i . k) beta; S_i += k d; y_i = S_i . q.
std::vector<mx::array> gated_delta(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& g,
    const mx::array& beta,
    const mx::array& state,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s = {});

// One (batch row, value head)'s steps (kernels: delta_avx2.cpp). s: the
// head's [Dv, Dk] state, updated in place; the other pointers are at step 0
// of this row and head, advancing by the strides given per step.
struct DeltaHead {
  const float* q;
  const float* k;
  const float* v;
  const float* g;
  const float* beta;
  const bool* mask;  // null: every step runs
  float* y;
  float* s;
  int T, Dk, Dv;
  long qk_step, v_step, g_step;
};
void gated_delta_head(const DeltaHead& h);

class NativeGatedDelta : public mx::Primitive {
 public:
  NativeGatedDelta(mx::Stream stream, bool masked) : mx::Primitive(stream), masked_(masked) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "LoomDeltaRule";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  bool masked_;
};

}  // namespace loom_cpu

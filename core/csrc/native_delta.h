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
// head's [Dv, Dk] state after the steps (read from s_in before the first
// step that runs); the other pointers are at step 0 of this row and head,
// advancing by the strides given per step.
struct DeltaHead {
  const float* q;
  const float* k;
  const float* v;
  const float* g;
  const float* beta;
  const bool* mask;  // null: every step runs
  float* y;
  float* s;
  // The state before the chunk, read by its first step that runs; the
  // steps write s (the state after). Never s itself, never null.
  const float* s_in;
  int T, Dk, Dv;
  long qk_step, v_step, g_step;
};
void gated_delta_head(const DeltaHead& h);

// silu(depthwise causal convolution) of Qwen3-Next's delta nets, float32:
// x [B, S + K - 1, C] (the K - 1 inputs before the chunk, then the chunk),
// weight [C, K]; y [B, S, C] with y[b, t, c] = silu(sum_j x[b, t + j, c] w[c, j]),
// the taps summed in order from 0.
mx::array conv_silu(const mx::array& x, const mx::array& weight, mx::StreamOrDevice s = {});

// Rows [t0, t1) of one batch row (kernels: delta_avx2.cpp).
void conv_silu_rows(const float* x, const float* w, float* y, int C, int K, int t0, int t1);

class NativeConvSilu : public mx::Primitive {
 public:
  explicit NativeConvSilu(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "LoomConvSilu";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const NativeConvSilu*>(&other) != nullptr;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

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

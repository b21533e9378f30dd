// The MLX primitive behind the native norm, rotary embedding, attention and
// SwiGLU gate (one graph node each, where MLX's CPU backend builds a fallback graph).
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace loom_cpu {

namespace mx = mlx::core;

// x * rsqrt(mean(x^2, -1) + eps) (* w): mx.fast.rms_norm's result.
mx::array rms_norm(
    const mx::array& x, const std::optional<mx::array>& w, float eps, mx::StreamOrDevice s = {});

// mx.fast.rope's result for x [..., L, D]: inv_freq is float32 [dims / 2],
// offsets int32 [1] or [x.shape(0)] (one position per batch row).
mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    const mx::array& inv_freq,
    float scale,
    const mx::array& offsets,
    mx::StreamOrDevice s = {});

// mx.fast.scaled_dot_product_attention's result for q [B, Hq, L, D],
// k [B, Hkv, S, D], v [B, Hkv, S, Dv]; mask: none, causal, or an additive
// float32 array broadcastable to [B, Hq, L, S]; lengths: optional int32 [1]
// or [B], the keys each batch row attends over (the first lengths[b]).
mx::array attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    bool causal,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& lengths = std::nullopt,
    mx::StreamOrDevice s = {});

// silu(gate) * up for float32 gate and up of one shape: mlx_lm's compiled
// SwiGLU, bit for bit (the same operations, vectorized).
mx::array silu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

// x - logsumexp(x, -1, keepdims=True) for float32 x: MLX's own arithmetic,
// bit for bit (the log-probabilities a sampler reads).
mx::array log_softmax(const mx::array& x, mx::StreamOrDevice s = {});

class NativeOp : public mx::Primitive {
 public:
  enum Kind : int { kNorm = 0, kRope = 1, kAttention = 2, kSiluMul = 3, kLogSoftmax = 4 };

  NativeOp(mx::Stream stream, Kind kind, float fparam, int iparam, bool flag)
      : mx::Primitive(stream), kind_(kind), fparam_(fparam), iparam_(iparam), flag_(flag) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    switch (kind_) {
      case kNorm:
        return "LoomRMSNorm";
      case kRope:
        return "LoomRoPE";
      case kAttention:
        return "LoomAttention";
      case kLogSoftmax:
        return "LoomLogSoftmax";
      default:
        return "LoomSiluMul";
    }
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  Kind kind_;
  float fparam_;  // eps, RoPE scale or attention scale
  int iparam_;    // RoPE dims; has-weight for the norm; attention: 1 has-mask | 2 has-lengths
  bool flag_;     // RoPE traditional; attention causal
};

}  // namespace loom_cpu

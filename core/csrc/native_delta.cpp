#include "native_delta.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "native_common.h"
#include "threadpool.h"

namespace loom_cpu {

std::vector<mx::array> gated_delta(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& g,
    const mx::array& beta,
    const mx::array& state,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  const std::vector<const mx::array*> floats = {&q, &k, &v, &g, &beta, &state};
  for (const mx::array* a : floats) {
    require(a->dtype() == mx::float32, [&] {
      return std::string(
          "[loom native kernels] gated_delta takes float32 q, k, v, g, beta and state, got " +
          dtype_str(a->dtype()) + ".");
    });
  }
  auto bad_shapes = [&] {
    return std::string("[loom native kernels] gated_delta shapes do not fit: q " + shape_str(q) +
        ", k " + shape_str(k) + ", v " + shape_str(v) + ", g " + shape_str(g) + ", beta " +
        shape_str(beta) + ", state " + shape_str(state) +
        " (want q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv], "
        "state [B, Hv, Dv, Dk], Hv a multiple of Hk).");
  };
  require(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 && g.ndim() == 3 && beta.ndim() == 3 &&
              state.ndim() == 4,
          bad_shapes);
  const int B = q.shape(0), T = q.shape(1), Hk = q.shape(2), Dk = q.shape(3);
  const int Hv = v.shape(2), Dv = v.shape(3);
  require(k.shape() == q.shape() && v.shape(0) == B && v.shape(1) == T && Hk > 0 &&
              Hv % Hk == 0 && g.shape() == mx::Shape{B, T, Hv} && beta.shape() == g.shape() &&
              state.shape() == mx::Shape{B, Hv, Dv, Dk},
          bad_shapes);
  std::vector<mx::array> inputs = {q, k, v, g, beta, state};
  if (mask) {
    require(mask->dtype() == mx::bool_ && mask->shape() == mx::Shape{B, T}, [&] {
      return std::string("[loom native kernels] gated_delta's mask must be bool [B, T] = [" +
          std::to_string(B) + ", " + std::to_string(T) + "], got " + shape_str(*mask) + " " +
          dtype_str(mask->dtype()) + ".");
    });
    inputs.push_back(*mask);
  }
  return mx::array::make_arrays(
      {v.shape(), state.shape()},
      {mx::float32, mx::float32},
      std::make_shared<NativeGatedDelta>(stream, mask.has_value()),
      std::move(inputs));
}

void NativeGatedDelta::eval_cpu(
    const std::vector<mx::array>& raw, std::vector<mx::array>& outputs) {
  const std::vector<mx::array> in = begin_eval(raw, outputs, stream());
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const int B = in[0].shape(0), T = in[0].shape(1), Hk = in[0].shape(2), Dk = in[0].shape(3);
  const int Hv = in[2].shape(2), Dv = in[2].shape(3);
  DeltaHead base{};
  base.q = in[0].data<float>();
  base.k = in[1].data<float>();
  base.v = in[2].data<float>();
  base.g = in[3].data<float>();
  base.beta = in[4].data<float>();
  base.mask = masked_ ? in[6].data<bool>() : nullptr;
  base.y = outputs[0].data<float>();
  base.s = outputs[1].data<float>();
  base.T = T;
  base.Dk = Dk;
  base.Dv = Dv;
  base.qk_step = static_cast<long>(Hk) * Dk;
  base.v_step = static_cast<long>(Hv) * Dv;
  base.g_step = Hv;
  const float* state_in = in[5].data<float>();
  encoder.dispatch([base, state_in, B, T, Hk, Hv, Dk, Dv]() {
    const int heads = B * Hv;
    const long long work = static_cast<long long>(T) * Dv * Dk;
    auto one = [&](int task) {
      const int b = task / Hv, hv = task % Hv, hk = hv / (Hv / Hk);
      DeltaHead h = base;
      h.q = base.q + (static_cast<long>(b) * T * Hk + hk) * Dk;
      h.k = base.k + (static_cast<long>(b) * T * Hk + hk) * Dk;
      h.v = base.v + (static_cast<long>(b) * T * Hv + hv) * Dv;
      h.y = base.y + (static_cast<long>(b) * T * Hv + hv) * Dv;
      h.g = base.g + static_cast<long>(b) * T * Hv + hv;
      h.beta = base.beta + static_cast<long>(b) * T * Hv + hv;
      h.mask = base.mask != nullptr ? base.mask + static_cast<long>(b) * T : nullptr;
      h.s = base.s + static_cast<long>(task) * Dv * Dk;
      // The head reads the state it starts from in the input and writes the
      // state it ends with into the output: no copy of every row's state
      // first (that copy took 6 % of a 16-row Qwen3-Next-shaped decode step).
      h.s_in = state_in + static_cast<long>(task) * Dv * Dk;
      gated_delta_head(h);
    };
    // A head is independent of the others: one task per head (a decode
    // step's heads are too little work to split).
    if (heads == 1 || work * heads < (1LL << 15)) {
      for (int t = 0; t < heads; ++t) {
        one(t);
      }
      return;
    }
    parallel_for(heads, one);
  });
}

mx::array conv_silu(const mx::array& x, const mx::array& weight, mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  require(x.dtype() == mx::float32 && weight.dtype() == mx::float32, [&] {
    return std::string("[loom native kernels] conv_silu takes float32 x and weight, got " +
        dtype_str(x.dtype()) + " and " + dtype_str(weight.dtype()) + ".");
  });
  require(x.ndim() == 3 && weight.ndim() == 2 && weight.shape(0) == x.shape(2) &&
              weight.shape(1) >= 1 && x.shape(1) >= weight.shape(1) - 1,
          [&] {
            return std::string("[loom native kernels] conv_silu shapes do not fit: x " +
                shape_str(x) + ", weight " + shape_str(weight) +
                " (want x [B, S + K - 1, C], weight [C, K]).");
          });
  const int K = weight.shape(1);
  mx::Shape out = {x.shape(0), x.shape(1) - (K - 1), x.shape(2)};
  return mx::array(
      std::move(out), mx::float32, std::make_shared<NativeConvSilu>(stream), {x, weight});
}

void NativeConvSilu::eval_cpu(const std::vector<mx::array>& raw, std::vector<mx::array>& outputs) {
  const std::vector<mx::array> in = begin_eval(raw, outputs, stream());
  mx::array& out = outputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const int B = out.shape(0), S = out.shape(1), C = out.shape(2), K = in[1].shape(1);
  const float* x = in[0].data<float>();
  const float* w = in[1].data<float>();
  float* y = out.data<float>();
  encoder.dispatch([x, w, y, B, S, C, K]() {
    // Tasks of 16 output rows; each row depends on its own inputs only.
    constexpr int kRows = 16;
    const int per_row = (S + kRows - 1) / kRows;
    const int tasks = B * per_row;
    auto one = [&](int task) {
      const int b = task / per_row, t0 = (task % per_row) * kRows;
      conv_silu_rows(x + static_cast<long>(b) * (S + K - 1) * C, w,
                     y + static_cast<long>(b) * S * C, C, K, t0, std::min(S, t0 + kRows));
    };
    if (tasks <= 1 || static_cast<long long>(S) * B * C * K < (1LL << 15)) {
      for (int t = 0; t < tasks; ++t) {
        one(t);
      }
      return;
    }
    parallel_for(tasks, one);
  });
}

void NativeConvSilu::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[loom native kernels] have no GPU implementation.");
}

std::vector<mx::Shape> NativeConvSilu::output_shapes(const std::vector<mx::array>& inputs) {
  const int K = inputs[1].shape(1);
  return {{inputs[0].shape(0), inputs[0].shape(1) - (K - 1), inputs[0].shape(2)}};
}

void NativeGatedDelta::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[loom native kernels] have no GPU implementation.");
}

bool NativeGatedDelta::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const NativeGatedDelta*>(&other);
  return o != nullptr && o->masked_ == masked_;
}

std::vector<mx::Shape> NativeGatedDelta::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[2].shape(), inputs[5].shape()};
}

}  // namespace loom_cpu

#include "native_recurrent.h"

#include <cstring>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "native_common.h"
#include "recurrent.h"
#include "threadpool.h"

namespace loom_cpu {

namespace {

const char* kTag = "[loom native kernels] gated_delta: ";

// Below this much work (state elements x steps) the node runs on the calling
// thread alone: a decode step of 16 heads of 64 x 64 does.
constexpr long long kParallelWork = 1 << 18;

thread_local Scratch masked_scratch;

}  // namespace

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
  for (const mx::array* a : {&q, &k, &v, &g, &beta, &state}) {
    require(a->dtype() == mx::float32, [&] {
      return std::string(kTag) + "takes float32 arrays, got " + dtype_str(a->dtype()) + ".";
    });
  }
  require(q.ndim() == 4 && k.shape() == q.shape() && v.ndim() == 4 && state.ndim() == 4, [&] {
    return std::string(kTag) + "q and k must be [B, T, Hk, Dk], v [B, T, Hv, Dv] and state "
        "[B, Hv, Dv, Dk], got " + shape_str(q) + ", " + shape_str(k) + ", " + shape_str(v) +
        " and " + shape_str(state) + ".";
  });
  const int B = q.shape(0), T = q.shape(1), Hk = q.shape(2), Dk = q.shape(3);
  const int Hv = v.shape(2), Dv = v.shape(3);
  require(v.shape(0) == B && v.shape(1) == T && Hk > 0 && Hv % Hk == 0, [&] {
    return std::string(kTag) + "v " + shape_str(v) + " does not match q " + shape_str(q) +
        " (value heads a multiple of key heads).";
  });
  const mx::Shape gates = {B, T, Hv};
  require(g.shape() == gates && beta.shape() == gates, [&] {
    return std::string(kTag) + "g and beta must be [B, T, Hv] = " + shape_str(v) +
        "[:3], got " + shape_str(g) + " and " + shape_str(beta) + ".";
  });
  const mx::Shape states = {B, Hv, Dv, Dk};
  require(state.shape() == states, [&] {
    return std::string(kTag) + "state must be [B, Hv, Dv, Dk], got " + shape_str(state) + ".";
  });
  std::vector<mx::array> inputs = {q, k, v, g, beta, state};
  if (mask) {
    require(mask->dtype() == mx::bool_ && mask->shape() == mx::Shape{B, T}, [&] {
      return std::string(kTag) + "mask must be bool [B, T], got " + shape_str(*mask) + " " +
          dtype_str(mask->dtype()) + ".";
    });
    inputs.push_back(*mask);
  }
  return mx::array::make_arrays(
      {v.shape(), state.shape()},
      {mx::float32, mx::float32},
      std::make_shared<NativeGatedDelta>(stream),
      std::move(inputs));
}

void NativeGatedDelta::eval_cpu(
    const std::vector<mx::array>& raw,
    std::vector<mx::array>& outputs) {
  std::vector<mx::array> in;
  for (const auto& a : raw) {
    in.push_back(row_contiguous(a, stream()));
  }
  mx::array& y = outputs[0];
  mx::array& state = outputs[1];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  state.set_data(mx::allocator::malloc(state.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : in) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(y);
  encoder.set_output_array(state);
  const mx::array& q = in[0];
  const int B = q.shape(0), T = q.shape(1), Hk = q.shape(2), Dk = q.shape(3);
  const int Hv = in[2].shape(2), Dv = in[2].shape(3);
  const float* qp = q.data<float>();
  const float* kp = in[1].data<float>();
  const float* vp = in[2].data<float>();
  const float* gp = in[3].data<float>();
  const float* bp = in[4].data<float>();
  const float* s0 = in[5].data<float>();
  float* yp = y.data<float>();
  float* sp = state.data<float>();
  const bool* mp = in.size() > 6 ? in[6].data<bool>() : nullptr;
  encoder.dispatch([=]() {
    const size_t head = static_cast<size_t>(Dv) * Dk;
    const int groups = Hv / Hk;
    // One task per (batch row, value head): its state runs through every step.
    auto run = [&](int task) {
      const int b = task / Hv, h = task % Hv;
      float* s = sp + static_cast<size_t>(task) * head;
      std::memcpy(s, s0 + static_cast<size_t>(task) * head, head * sizeof(float));
      for (int t = 0; t < T; ++t) {
        const size_t bt = static_cast<size_t>(b) * T + t;
        const size_t qk = (bt * Hk + h / groups) * Dk;
        const size_t gh = bt * Hv + h;
        float* rows = s;
        if (mp != nullptr && !mp[bt]) {
          // A masked step: y from an updated copy, the state kept.
          rows = masked_scratch.get(head);
          std::memcpy(rows, s, head * sizeof(float));
        }
        gated_delta_head_step(
            qp + qk, kp + qk, vp + gh * Dv, gp[gh], bp[gh], rows, yp + gh * Dv, Dv, Dk);
      }
    };
    const int tasks = B * Hv;
    if (static_cast<long long>(tasks) * head * T < kParallelWork) {
      for (int t = 0; t < tasks; ++t) {
        run(t);
      }
    } else {
      parallel_for(tasks, run);
    }
  });
}

void NativeGatedDelta::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[loom native kernels] have no GPU implementation.");
}

}  // namespace loom_cpu

#include "native_activations.h"

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "activations.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "native_common.h"
#include "threadpool.h"

namespace loom_cpu {

namespace {

// Elements per task, and below how many elements a map runs on the calling
// thread alone (a decode step's gates, a few thousand, do).
constexpr size_t kBlock = 1024;
constexpr size_t kParallelElements = size_t{1} << 14;

// fn(i0, i1) over [0, n): on this thread for small n, else in blocks of
// kBlock on the pool (each element's arithmetic is the same either way).
template <class F>
void map_blocks(size_t n, F fn) {
  if (n < kParallelElements) {
    fn(size_t{0}, n);
    return;
  }
  const int blocks = static_cast<int>((n + kBlock - 1) / kBlock);
  parallel_for(blocks, [&](int b) {
    const size_t a = static_cast<size_t>(b) * kBlock;
    fn(a, std::min(n, a + kBlock));
  });
}

}  // namespace

mx::array gelu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  require(gate.dtype() == mx::float32 && up.dtype() == mx::float32, [&] {
    return std::string("[loom native kernels] gelu_mul takes float32 gate and up, got " +
        dtype_str(gate.dtype()) + " and " + dtype_str(up.dtype()) + ".");
  });
  require(gate.shape() == up.shape(), [&] {
    return std::string("[loom native kernels] gelu_mul's gate and up must share one shape, got " +
        shape_str(gate) + " and " + shape_str(up) + ".");
  });
  return mx::array(gate.shape(), mx::float32, std::make_shared<NativeGeluMul>(stream), {gate, up});
}

void NativeGeluMul::eval_cpu(const std::vector<mx::array>& raw, std::vector<mx::array>& outputs) {
  const std::vector<mx::array> in = begin_eval(raw, outputs, stream());
  const mx::array& gate = in[0];
  const mx::array& up = in[1];
  mx::array& out = outputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const float* g = gate.data<float>();
  const float* u = up.data<float>();
  float* y = out.data<float>();
  const size_t n = out.size();
  encoder.dispatch([g, u, y, n]() {
    map_blocks(n, [&](size_t i0, size_t i1) { gelu_tanh_mul(g, u, y, i0, i1); });
  });
}

mx::array softcap(const mx::array& x, float cap, mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  require(x.dtype() == mx::float32, [&] {
    return std::string("[loom native kernels] softcap takes a float32 array, got " +
        dtype_str(x.dtype()) + ".");
  });
  require(cap > 0.0f && cap <= 3.0e38f, [&] {
    return std::string("[loom native kernels] softcap's cap must be a finite number above 0, got " +
        std::to_string(cap) + ".");
  });
  return mx::array(x.shape(), mx::float32, std::make_shared<NativeSoftcap>(stream, cap), {x});
}

void NativeSoftcap::eval_cpu(const std::vector<mx::array>& raw, std::vector<mx::array>& outputs) {
  const std::vector<mx::array> in = begin_eval(raw, outputs, stream());
  mx::array& out = outputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const float* x = in[0].data<float>();
  float* y = out.data<float>();
  const size_t n = out.size();
  const float cap = cap_;
  encoder.dispatch([x, y, n, cap]() {
    map_blocks(n, [&](size_t i0, size_t i1) { softcap(x, cap, y, i0, i1); });
  });
}

void NativeSoftcap::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[loom native kernels] have no GPU implementation.");
}

mx::array expert_mix(
    const mx::array& y,
    const mx::array& w,
    const std::optional<mx::array>& shared,
    const std::optional<mx::array>& shared_w,
    mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  require(y.dtype() == mx::float32 && w.dtype() == mx::float32, [&] {
    return std::string("[loom native kernels] expert_mix takes float32 outputs and weights, got " +
        dtype_str(y.dtype()) + " and " + dtype_str(w.dtype()) + ".");
  });
  const bool shaped = y.ndim() >= 2 && w.ndim() == y.ndim() - 1 &&
      std::equal(w.shape().begin(), w.shape().end(), y.shape().begin());
  require(shaped && w.shape(-1) >= 1, [&] {
    return std::string("[loom native kernels] expert_mix takes outputs [..., k, D] and weights "
        "[..., k] of the same leading shape, got " + shape_str(y) + " and " + shape_str(w) + ".");
  });
  mx::Shape shape = y.shape();
  shape.erase(shape.end() - 2);
  std::vector<mx::array> inputs = {y, w};
  require(shared.has_value() == shared_w.has_value(), [] {
    return std::string("[loom native kernels] expert_mix takes a shared expert's output and its "
        "gate weight together, or neither.");
  });
  if (shared.has_value()) {
    mx::Shape gate_shape = shape;
    gate_shape.back() = 1;
    require(shared->dtype() == mx::float32 && shared_w->dtype() == mx::float32 &&
                shared->shape() == shape && shared_w->shape() == gate_shape,
            [&] {
              return std::string("[loom native kernels] expert_mix takes a float32 shared "
                                 "output ") +
                  shape_str(shape) + " and gate weight " + shape_str(gate_shape) + ", got " +
                  shape_str(*shared) + " " + dtype_str(shared->dtype()) + " and " +
                  shape_str(*shared_w) + " " + dtype_str(shared_w->dtype()) + ".";
            });
    inputs.push_back(*shared);
    inputs.push_back(*shared_w);
  }
  return mx::array(std::move(shape), mx::float32, std::make_shared<NativeExpertMix>(stream),
                   std::move(inputs));
}

namespace {

// One token's D outputs: products rounded, then added in order from j = 0,
// then the shared expert's rounded product (when given) added last (never
// fused into one rounding, whatever the build's flags).
__attribute__((optimize("fp-contract=off"))) void mix_row(
    const float* y, const float* w, int k, size_t D, const float* shared, const float* shared_w,
    float* out) {
  for (size_t d = 0; d < D; ++d) {
    out[d] = y[d] * w[0];
  }
  for (int j = 1; j < k; ++j) {
    const float* yj = y + static_cast<size_t>(j) * D;
    const float wj = w[j];
    for (size_t d = 0; d < D; ++d) {
      const float p = yj[d] * wj;
      out[d] = out[d] + p;
    }
  }
  if (shared != nullptr) {
    const float ws = *shared_w;
    for (size_t d = 0; d < D; ++d) {
      const float p = ws * shared[d];
      out[d] = out[d] + p;
    }
  }
}

}  // namespace

void NativeExpertMix::eval_cpu(const std::vector<mx::array>& raw, std::vector<mx::array>& outputs) {
  const std::vector<mx::array> in = begin_eval(raw, outputs, stream());
  const mx::array& y = in[0];
  const mx::array& w = in[1];
  const bool with_shared = in.size() == 4;
  mx::array& out = outputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const int k = y.shape(-2);
  const size_t D = static_cast<size_t>(y.shape(-1));
  const size_t tokens = D > 0 ? out.size() / D : 0;
  const float* sp = with_shared ? in[2].data<float>() : nullptr;
  const float* swp = with_shared ? in[3].data<float>() : nullptr;
  encoder.dispatch([yp = y.data<float>(), wp = w.data<float>(), o = out.data<float>(), k, D,
                    tokens, sp, swp]() {
    for (size_t t = 0; t < tokens; ++t) {
      mix_row(yp + t * k * D, wp + t * k, k, D, sp != nullptr ? sp + t * D : nullptr,
              swp != nullptr ? swp + t : nullptr, o + t * D);
    }
  });
}

void NativeExpertMix::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[loom native kernels] have no GPU implementation.");
}

void NativeGeluMul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[loom native kernels] have no GPU implementation.");
}

}  // namespace loom_cpu

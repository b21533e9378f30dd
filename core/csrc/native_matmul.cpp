#include "native_matmul.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include "kernels.h"
#include "native_common.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/utils.h"
#include "threadpool.h"

namespace loom_cpu {

namespace {

void check_x(const mx::array& x, int K) {
  require(x.ndim() >= 1, [&] {
    return std::string("[loom native kernels] x must have at least one dimension.");
  });
  require(is_float(x.dtype()), [&] {
    return std::string("[loom native kernels] x must be float32, bfloat16 or float16, got " +
        dtype_str(x.dtype()) + ".");
  });
  require(x.shape(-1) == K, [&] {
    return std::string("[loom native kernels] x has " + std::to_string(x.shape(-1)) +
        " columns but the weight expects " + std::to_string(K) + ".");
  });
}

void check_bias(const std::optional<mx::array>& bias, int N) {
  if (!bias) {
    return;
  }
  require(bias->ndim() == 1 && bias->shape(0) == N && is_float(bias->dtype()), [&] {
    return std::string("[loom native kernels] bias must be a float vector of length " +
        std::to_string(N) + ", got shape " + shape_str(*bias) + " " + dtype_str(bias->dtype()) +
        ".");
  });
}

mx::array finish_op(
    std::vector<mx::array> inputs,
    mx::Dtype out_dtype,
    int N,
    int bits,
    int group_size,
    bool has_bias,
    bool int8_x,
    mx::Stream stream) {
  auto out_shape = inputs[0].shape();
  out_shape.back() = N;
  return mx::array(
      std::move(out_shape),
      out_dtype,
      std::make_shared<NativeMatmul>(stream, bits, group_size, has_bias, int8_x),
      std::move(inputs));
}

thread_local Scratch x_scratch;
thread_local Scratch perm_scratch;
thread_local Scratch sum_scratch;
thread_local Scratch gemm_scratch;
thread_local Scratch int8_scratch;
thread_local Scratch step_scratch;

// Below this many multiply-adds a product runs on the calling thread alone:
// waking a worker costs more than it saves.
constexpr long long kParallelMacs = 1 << 16;

void run_product(Product p, const void* x_raw, int x_dtype, bool int8_x) {
  if (p.M == 0 || p.N == 0) {
    return;
  }
  const size_t x_count = static_cast<size_t>(p.M) * p.K;
  if (x_dtype == kF32) {
    p.x = static_cast<const float*>(x_raw);
  } else {
    float* buf = x_scratch.get(x_count + 8);
    to_f32(x_raw, x_dtype, buf, x_count);
    p.x = buf;
  }
  const int threads = pool_threads();
  const long long macs = static_cast<long long>(p.M) * p.N * std::max(p.K, 1);
  if (p.M <= kSmallRows) {
    // Rows are split into contiguous chunks, several per thread so a thread
    // that starts late (another process on its core) delays little.
    int tasks = macs < kParallelMacs ? 1 : std::min(threads * 4, std::max(1, p.N / 8));
    const int chunk = (p.N + tasks - 1) / tasks;
    tasks = (p.N + chunk - 1) / chunk;
    const float* xsum = nullptr;
    if (int8_x) {
      float* sums = sum_scratch.get(static_cast<size_t>(p.M) * (p.K / p.group_size) + 8);
      auto* xq = reinterpret_cast<int8_t*>(int8_scratch.get(int8_x_bytes(p.M, p.K) / 4 + 8));
      float* steps = step_scratch.get(int8_x_steps(p.M, p.K) + 8);
      prepare_int8_x(p, xq, steps, sums);
      parallel_for(tasks, [&](int t) {
        const int n0 = t * chunk;
        gemv4_int8_rows(p, xq, steps, sums, n0, std::min(p.N, n0 + chunk));
      });
      return;
    }
    if (p.bits != 0) {
      float* sums = sum_scratch.get(static_cast<size_t>(p.M) * (p.K / p.group_size) + 8);
      float* perm = p.bits == 4 ? perm_scratch.get(x_count + 8) : nullptr;
      prepare_affine_x(p, perm, sums);
      if (perm != nullptr) {
        p.x = perm;
      }
      xsum = sums;
    }
    parallel_for(tasks, [&](int t) {
      const int n0 = t * chunk;
      gemv_rows(p, xsum, n0, std::min(p.N, n0 + chunk));
    });
    return;
  }
  const int block = gemm_block_rows();
  const int tasks = (p.N + block - 1) / block;
  const size_t scratch_floats = gemm_scratch_floats(p.M);
  parallel_for(macs < kParallelMacs ? 1 : tasks, [&](int t) {
    float* scratch = gemm_scratch.get(scratch_floats);
    if (macs < kParallelMacs) {
      gemm_rows(p, 0, p.N, scratch);
      return;
    }
    const int n0 = t * block;
    gemm_rows(p, n0, std::min(p.N, n0 + block), scratch);
  });
}

}  // namespace

mx::array dense_matmul(
    const mx::array& x,
    const mx::array& w,
    const std::optional<mx::array>& bias,
    mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  require(w.ndim() == 2 && is_float(w.dtype()), [&] {
    return std::string(
        "[loom native kernels] a dense weight must be a 2-D float32, bfloat16 or float16 "
        "matrix, got shape " +
        shape_str(w) + " " + dtype_str(w.dtype()) + ".");
  });
  const int N = w.shape(0);
  const int K = w.shape(1);
  check_x(x, K);
  check_bias(bias, N);
  mx::Dtype out = mx::promote_types(x.dtype(), w.dtype());
  std::vector<mx::array> inputs = {x, w};
  if (bias) {
    out = mx::promote_types(out, bias->dtype());
    inputs.push_back(*bias);
  }
  return finish_op(std::move(inputs), out, N, 0, 0, bias.has_value(), false, stream);
}

mx::array affine_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int bits,
    int group_size,
    const std::optional<mx::array>& bias,
    bool int8_activations,
    mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  require(!int8_activations || bits == 4, [&] {
    return std::string(
        "[loom native kernels] int8 activations are implemented for 4-bit weights only, got " +
        std::to_string(bits) + "-bit.");
  });
  require(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8, [&] {
    return std::string("[loom native kernels] affine bits must be 2, 3, 4, 5, 6 or 8, got " +
        std::to_string(bits) + ".");
  });
  require(group_size == 32 || group_size == 64 || group_size == 128, [&] {
    return std::string("[loom native kernels] affine group size must be 32, 64 or 128, got " +
        std::to_string(group_size) + ".");
  });
  require(w.ndim() == 2 && w.dtype() == mx::uint32, [&] {
    return std::string(
        "[loom native kernels] a quantized weight must be a 2-D uint32 matrix, got shape " +
        shape_str(w) + " " + dtype_str(w.dtype()) + ".");
  });
  const int N = w.shape(0);
  require((static_cast<long long>(w.shape(1)) * 32) % bits == 0, [&] {
    return std::string("[loom native kernels] a packed row of " + std::to_string(w.shape(1)) +
        " words does not hold whole " + std::to_string(bits) + "-bit codes.");
  });
  const int K = static_cast<int>(static_cast<long long>(w.shape(1)) * 32 / bits);
  require(K > 0 && K % group_size == 0, [&] {
    return std::string("[loom native kernels] the unpacked row length " + std::to_string(K) +
        " is not a positive multiple of the group size " + std::to_string(group_size) + ".");
  });
  check_x(x, K);
  for (const mx::array* a : {&scales, &biases}) {
    require(
        a->ndim() == 2 && a->shape(0) == N && a->shape(1) == K / group_size &&
            is_float(a->dtype()),
        [&] {
          return std::string("[loom native kernels] scales and biases must be float [" +
              std::to_string(N) + ", " + std::to_string(K / group_size) + "], got shape " +
              shape_str(*a) + " " + dtype_str(a->dtype()) + ".");
        });
  }
  require(scales.dtype() == biases.dtype(), [&] {
    return std::string("[loom native kernels] scales and biases must share one dtype.");
  });
  check_bias(bias, N);
  mx::Dtype out = mx::promote_types(x.dtype(), scales.dtype());
  std::vector<mx::array> inputs = {x, w, scales, biases};
  if (bias) {
    out = mx::promote_types(out, bias->dtype());
    inputs.push_back(*bias);
  }
  return finish_op(
      std::move(inputs), out, N, bits, group_size, bias.has_value(), int8_activations, stream);
}

void NativeMatmul::eval_cpu(
    const std::vector<mx::array>& raw_inputs,
    std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  // The kernels read row-contiguous memory (weights always are).
  std::vector<mx::array> inputs;
  for (const auto& a : raw_inputs) {
    inputs.push_back(row_contiguous(a, stream()));
  }
  const mx::array& x = inputs[0];
  const mx::array& w = inputs[1];
  Product p;
  p.K = x.shape(-1);
  p.M = p.K > 0 ? static_cast<int>(x.size() / p.K) : static_cast<int>(out.size() / w.shape(0));
  p.N = w.shape(0);
  p.w = w.data<void>();
  p.bits = bits_;
  p.group_size = group_size_;
  int next = 2;
  if (bits_ == 0) {
    p.w_dtype = code_of(w.dtype());
  } else {
    p.scales = inputs[2].data<void>();
    p.biases = inputs[3].data<void>();
    p.s_dtype = code_of(inputs[2].dtype());
    next = 4;
  }
  if (has_bias_) {
    p.bias = inputs[next].data<void>();
    p.b_dtype = code_of(inputs[next].dtype());
  }
  p.out = out.data<void>();
  p.out_dtype = code_of(out.dtype());

  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  // int8 activations serve the matrix-vector sizes; larger products
  // (prefill) run the fp32 GEMM either way.
  const bool int8_x = int8_x_ && p.M <= kSmallRows;
  encoder.dispatch([p, x_raw = x.data<void>(), x_dtype = code_of(x.dtype()), int8_x]() {
    run_product(p, x_raw, x_dtype, int8_x);
  });
}

void NativeMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[loom native kernels] have no GPU implementation.");
}

bool NativeMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const NativeMatmul*>(&other);
  return o != nullptr && o->bits_ == bits_ && o->group_size_ == group_size_ &&
      o->has_bias_ == has_bias_ && o->int8_x_ == int8_x_;
}

std::vector<mx::Shape> NativeMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

}  // namespace loom_cpu

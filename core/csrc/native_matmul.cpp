#include "native_matmul.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include "activations.h"
#include "kernels.h"
#include "native_common.h"
#include "ops.h"
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
    bool gated,
    mx::Stream stream,
    bool gelu = false) {
  auto out_shape = inputs[0].shape();
  out_shape.back() = N;
  return mx::array(
      std::move(out_shape),
      out_dtype,
      std::make_shared<NativeMatmul>(stream, bits, group_size, has_bias, int8_x, gated, 1, gelu),
      std::move(inputs));
}

thread_local Scratch x_scratch;
thread_local Scratch perm_scratch;
thread_local Scratch sum_scratch;
thread_local Scratch gemm_scratch;
thread_local Scratch int8_scratch;
thread_local Scratch step_scratch;
thread_local Scratch up_scratch;

// Below this many multiply-adds a product runs on the calling thread alone:
// waking a worker costs more than it saves.
constexpr long long kParallelMacs = 1 << 16;

// From this many activation rows on, their int8 quantization is split over
// the threads too: the other thread would otherwise wait for it before
// every product (16 rows: ~5 % of a batched decode step's CPU time ran on
// one thread while the other waited).
constexpr int kSplitQuantizeRows = 4;

// x as fp32 (the kernels' activations), upcast once per call if needed.
const float* f32_x(const Product& p, const void* x_raw, int x_dtype) {
  if (x_dtype == kF32) {
    return static_cast<const float*>(x_raw);
  }
  const size_t count = static_cast<size_t>(p.M) * p.K;
  float* buf = x_scratch.get(count + 8);
  to_f32(x_raw, x_dtype, buf, count);
  return buf;
}

// The activations of a matrix-vector product (at most kSmallRows rows; any
// number with int8 activations) as
// its kernel reads them, prepared once per call -- and once for both
// products of a gated pair, which share x, K, bits and group size.
struct VectorInput {
  const float* x = nullptr;      // fp32 kernels: x (reordered for 4-bit codes)
  const float* xsum = nullptr;   // affine: per-group sums of x
  const int8_t* xq = nullptr;    // int8 activations (null: the fp32 kernels)
  const float* steps = nullptr;  // their block steps
};

VectorInput prepare_vector(const Product& p, bool int8_x) {
  VectorInput v;
  v.x = p.x;
  if (p.bits == 0) {
    return v;
  }
  float* sums = sum_scratch.get(static_cast<size_t>(p.M) * (p.K / p.group_size) + 8);
  v.xsum = sums;
  if (int8_x) {
    auto* xq = reinterpret_cast<int8_t*>(int8_scratch.get(int8_x_bytes(p.M, p.K) / 4 + 8));
    float* steps = step_scratch.get(int8_x_steps(p.M, p.K) + 8);
    if (p.M < kSplitQuantizeRows) {
      prepare_int8_x(p, xq, steps, sums);
    } else {
      // Several rows (a batch of decode rows, a prefill chunk) are quantized
      // on every thread (each row on its own, so the split changes no value).
      const int groups = p.K / p.group_size;
      const int tasks = std::min(pool_threads() * 4, p.M / 2);
      const int chunk = (p.M + tasks - 1) / tasks;
      parallel_for(tasks, [&](int t) {
        const int m0 = t * chunk;
        const int m1 = std::min(p.M, m0 + chunk);
        if (m0 >= m1) {
          return;
        }
        Product q = p;
        q.x = p.x + static_cast<size_t>(m0) * p.K;
        q.M = m1 - m0;
        prepare_int8_x(q, xq + int8_x_bytes(m0, p.K), steps + int8_x_steps(m0, p.K),
                       sums + static_cast<size_t>(m0) * groups);
      });
    }
    v.xq = xq;
    v.steps = steps;
    return v;
  }
  float* perm = p.bits == 4 ? perm_scratch.get(static_cast<size_t>(p.M) * p.K + 8) : nullptr;
  prepare_affine_x(p, perm, sums);
  if (perm != nullptr) {
    v.x = perm;
  }
  return v;
}

void vector_rows(Product p, const VectorInput& v, int n0, int n1) {
  if (v.xq != nullptr) {
    gemv4_int8_rows(p, v.xq, v.steps, v.xsum, n0, n1);
    return;
  }
  p.x = v.x;
  gemv_rows(p, v.xsum, n0, n1);
}

// Contiguous chunks of output rows, several per thread so that a thread
// that starts late (another process on its core) delays little.
struct RowChunks {
  int tasks = 1;
  int chunk = 0;
};

RowChunks row_chunks(int N, long long macs) {
  RowChunks c;
  c.tasks = macs < kParallelMacs ? 1 : std::min(pool_threads() * 4, std::max(1, N / 8));
  c.chunk = (N + c.tasks - 1) / c.tasks;
  if (c.tasks > 1) {
    c.chunk = whole_tiles(c.chunk);
  }
  c.tasks = (N + c.chunk - 1) / c.chunk;
  return c;
}

long long macs_of(const Product& p) {
  return static_cast<long long>(p.M) * p.N * std::max(p.K, 1);
}

// The blocked GEMM over every product in `products` (one region; they share
// x, so M and K).
void gemm_all(const Product* products, int count) {
  const int block = gemm_block_rows();
  int first[kMaxParts + 1] = {0};
  long long macs = 0;
  for (int i = 0; i < count; ++i) {
    first[i + 1] = first[i] + (products[i].N + block - 1) / block;
    macs += macs_of(products[i]);
  }
  const size_t scratch_floats = gemm_scratch_floats(products[0].M);
  if (macs < kParallelMacs) {
    float* scratch = gemm_scratch.get(scratch_floats);
    for (int i = 0; i < count; ++i) {
      gemm_rows(products[i], 0, products[i].N, scratch);
    }
    return;
  }
  parallel_for(first[count], [&](int t) {
    int i = 0;
    while (t >= first[i + 1]) {
      ++i;
    }
    const Product& p = products[i];
    const int n0 = (t - first[i]) * block;
    gemm_rows(p, n0, std::min(p.N, n0 + block), gemm_scratch.get(scratch_floats));
  });
}

// One product, or several of one x (an attention's q, k and v projections)
// as one region: chunks run over their rows laid end to end, x is prepared
// once. Each output equals its own product's bit for bit.
void run_products(
    const Product* parts, int count, const void* x_raw, int x_dtype, bool int8_x) {
  if (parts[0].M == 0) {
    return;
  }
  Product ps[kMaxParts];
  const float* x = f32_x(parts[0], x_raw, x_dtype);
  int first[kMaxParts + 1] = {0};
  long long macs = 0;
  for (int i = 0; i < count; ++i) {
    ps[i] = parts[i];
    ps[i].x = x;
    first[i + 1] = first[i] + ps[i].N;
    macs += macs_of(ps[i]);
  }
  const int rows = first[count];
  if (rows == 0) {
    return;
  }
  if (ps[0].M > kSmallRows && !int8_x) {
    gemm_all(ps, count);
    return;
  }
  const VectorInput v = prepare_vector(ps[0], int8_x);
  const RowChunks c = row_chunks(rows, macs);
  parallel_for(c.tasks, [&](int t) {
    const int r0 = t * c.chunk;
    const int r1 = std::min(rows, r0 + c.chunk);
    for (int i = 0; i < count; ++i) {
      const int a = std::max(r0, first[i]);
      const int b = std::min(r1, first[i + 1]);
      if (a < b) {
        vector_rows(ps[i], v, a - first[i], b - first[i]);
      }
    }
  });
}

// act(x @ G.T) * (x @ U.T), act SiLU or (gelu) tanh-GELU: both products'
// rows of a chunk, then the gate over that chunk, so the pair is one region
// (one node) and x is prepared once. The gate product is written into `out`
// and gated in place (only the up product needs scratch). Every output
// equals the unfused gate product, up product and silu_mul / gelu_tanh_mul
// bit for bit (the same kernels, the same per-row arithmetic).
void gate_rows(bool gelu, const float* gate, const float* up, float* out, size_t i0, size_t i1) {
  if (gelu) {
    gelu_tanh_mul(gate, up, out, i0, i1);
  } else {
    silu_mul(gate, up, out, i0, i1);
  }
}

void run_gated(Product g, Product u, const float* x, bool int8_x, bool gelu, float* out) {
  if (g.M == 0 || g.N == 0) {
    return;
  }
  const int M = g.M;
  const int N = g.N;
  const size_t count = static_cast<size_t>(M) * N;
  float* up = up_scratch.get(count + 8);
  g.x = u.x = x;
  g.out = out;
  u.out = up;
  g.out_dtype = u.out_dtype = kF32;
  if (M > kSmallRows && !int8_x) {
    const Product pair[2] = {g, u};
    gemm_all(pair, 2);
    const RowChunks c = row_chunks(M, static_cast<long long>(count) * 8);
    parallel_for(c.tasks, [&](int t) {
      const size_t m0 = static_cast<size_t>(t) * c.chunk;
      const size_t m1 = std::min(static_cast<size_t>(M), m0 + c.chunk);
      gate_rows(gelu, out, up, out, m0 * N, m1 * N);
    });
    return;
  }
  const VectorInput v = prepare_vector(g, int8_x);
  const RowChunks c = row_chunks(N, 2 * macs_of(g));
  parallel_for(c.tasks, [&](int t) {
    const int n0 = t * c.chunk;
    const int n1 = std::min(N, n0 + c.chunk);
    vector_rows(g, v, n0, n1);
    vector_rows(u, v, n0, n1);
    for (int m = 0; m < M; ++m) {
      const size_t row = static_cast<size_t>(m) * N;
      gate_rows(gelu, out + row, up + row, out + row, n0, n1);
    }
  });
}

// A dense weight's shape: [N, K].
void check_dense(const mx::array& w) {
  require(w.ndim() == 2 && is_float(w.dtype()), [&] {
    return std::string(
        "[loom native kernels] a dense weight must be a 2-D float32, bfloat16 or float16 "
        "matrix, got shape " +
        shape_str(w) + " " + dtype_str(w.dtype()) + ".");
  });
}

// An affine-quantized weight with its scales and biases; returns K.
int check_affine(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int bits,
    int group_size,
    bool int8_activations) {
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
  return K;
}

// The two weights of a gated pair must be read the same way.
void check_pair(const mx::array& gate, const mx::array& up, const char* what) {
  require(gate.shape() == up.shape() && gate.dtype() == up.dtype(), [&] {
    return std::string("[loom native kernels] the gate and up ") + what +
        " must share one shape and dtype, got " + shape_str(gate) + " " +
        dtype_str(gate.dtype()) + " and " + shape_str(up) + " " + dtype_str(up.dtype()) + ".";
  });
}

void check_gated_x(const mx::array& x) {
  require(x.dtype() == mx::float32, [&] {
    return std::string("[loom native kernels] a gated product takes float32 x, got " +
        dtype_str(x.dtype()) + ".");
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
  check_dense(w);
  const int N = w.shape(0);
  check_x(x, w.shape(1));
  check_bias(bias, N);
  mx::Dtype out = mx::promote_types(x.dtype(), w.dtype());
  std::vector<mx::array> inputs = {x, w};
  if (bias) {
    out = mx::promote_types(out, bias->dtype());
    inputs.push_back(*bias);
  }
  return finish_op(std::move(inputs), out, N, 0, 0, bias.has_value(), false, false, stream);
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
  const int K = check_affine(w, scales, biases, bits, group_size, int8_activations);
  const int N = w.shape(0);
  check_x(x, K);
  check_bias(bias, N);
  mx::Dtype out = mx::promote_types(x.dtype(), scales.dtype());
  std::vector<mx::array> inputs = {x, w, scales, biases};
  if (bias) {
    out = mx::promote_types(out, bias->dtype());
    inputs.push_back(*bias);
  }
  return finish_op(
      std::move(inputs), out, N, bits, group_size, bias.has_value(), int8_activations, false,
      stream);
}

mx::array gated_dense_matmul(
    const mx::array& x,
    const mx::array& gate,
    const mx::array& up,
    bool gelu,
    mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  check_dense(gate);
  check_pair(gate, up, "weights");
  check_x(x, gate.shape(1));
  check_gated_x(x);
  return finish_op(
      {x, gate, up}, mx::float32, gate.shape(0), 0, 0, false, false, true, stream, gelu);
}

mx::array gated_affine_matmul(
    const mx::array& x,
    const mx::array& gate,
    const mx::array& gate_scales,
    const mx::array& gate_biases,
    const mx::array& up,
    const mx::array& up_scales,
    const mx::array& up_biases,
    int bits,
    int group_size,
    bool int8_activations,
    bool gelu,
    mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  const int K = check_affine(gate, gate_scales, gate_biases, bits, group_size, int8_activations);
  check_pair(gate, up, "weights");
  check_pair(gate_scales, up_scales, "scales");
  check_pair(gate_biases, up_biases, "biases");
  check_affine(up, up_scales, up_biases, bits, group_size, int8_activations);
  check_x(x, K);
  check_gated_x(x);
  return finish_op(
      {x, gate, gate_scales, gate_biases, up, up_scales, up_biases}, mx::float32, gate.shape(0),
      bits, group_size, false, int8_activations, true, stream, gelu);
}

namespace {

void check_parts(size_t count) {
  require(count >= 1 && count <= static_cast<size_t>(kMaxParts), [&] {
    return std::string("[loom native kernels] a multi-output product takes 1 to " +
        std::to_string(kMaxParts) + " weights, got " + std::to_string(count) + ".");
  });
}

std::vector<mx::array> finish_multi(
    std::vector<mx::array> inputs,
    std::vector<mx::Shape> shapes,
    mx::Dtype out_dtype,
    int bits,
    int group_size,
    bool int8_x,
    mx::Stream stream) {
  const int parts = static_cast<int>(shapes.size());
  std::vector<mx::Dtype> dtypes(shapes.size(), out_dtype);
  return mx::array::make_arrays(
      std::move(shapes),
      dtypes,
      std::make_shared<NativeMatmul>(stream, bits, group_size, false, int8_x, false, parts),
      std::move(inputs));
}

mx::Shape with_last(const mx::array& x, int n) {
  auto shape = x.shape();
  shape.back() = n;
  return shape;
}

}  // namespace

std::vector<mx::array> multi_dense_matmul(
    const mx::array& x, const std::vector<mx::array>& weights, mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  check_parts(weights.size());
  std::vector<mx::array> inputs = {x};
  std::vector<mx::Shape> shapes;
  for (const auto& w : weights) {
    check_dense(w);
    require(w.shape(1) == weights[0].shape(1) && w.dtype() == weights[0].dtype(), [&] {
      return std::string(
          "[loom native kernels] the weights of a multi-output product must share their row "
          "length and dtype, got " +
          shape_str(weights[0]) + " " + dtype_str(weights[0].dtype()) + " and " + shape_str(w) +
          " " + dtype_str(w.dtype()) + ".");
    });
    inputs.push_back(w);
    shapes.push_back(with_last(x, w.shape(0)));
  }
  check_x(x, weights[0].shape(1));
  return finish_multi(
      std::move(inputs), std::move(shapes), mx::promote_types(x.dtype(), weights[0].dtype()), 0,
      0, false, stream);
}

std::vector<mx::array> multi_affine_matmul(
    const mx::array& x,
    const std::vector<mx::array>& weights,
    const std::vector<mx::array>& scales,
    const std::vector<mx::array>& biases,
    int bits,
    int group_size,
    bool int8_activations,
    mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  check_parts(weights.size());
  require(scales.size() == weights.size() && biases.size() == weights.size(), [&] {
    return std::string(
        "[loom native kernels] a multi-output product needs one scales and one biases array per "
        "weight.");
  });
  std::vector<mx::array> inputs = {x};
  std::vector<mx::Shape> shapes;
  int K = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const int k = check_affine(weights[i], scales[i], biases[i], bits, group_size, int8_activations);
    require(i == 0 || (k == K && scales[i].dtype() == scales[0].dtype()), [&] {
      return std::string(
          "[loom native kernels] the weights of a multi-output product must share their row "
          "length and scale dtype.");
    });
    K = k;
    inputs.insert(inputs.end(), {weights[i], scales[i], biases[i]});
    shapes.push_back(with_last(x, weights[i].shape(0)));
  }
  check_x(x, K);
  return finish_multi(
      std::move(inputs), std::move(shapes), mx::promote_types(x.dtype(), scales[0].dtype()), bits,
      group_size, int8_activations, stream);
}

void NativeMatmul::eval_cpu(
    const std::vector<mx::array>& raw_inputs,
    std::vector<mx::array>& outputs) {
  // The kernels read row-contiguous memory (weights always are).
  const std::vector<mx::array> inputs = begin_eval(raw_inputs, outputs, stream());
  mx::array& out = outputs[0];
  const mx::array& x = inputs[0];
  // The product of the weight starting at inputs[first] (dense: the weight;
  // affine: weight, scales, biases).
  auto product_at = [&](size_t first) {
    const mx::array& w = inputs[first];
    Product p;
    p.K = x.shape(-1);
    p.M = p.K > 0 ? static_cast<int>(x.size() / p.K) : static_cast<int>(out.size() / w.shape(0));
    p.N = w.shape(0);
    p.w = w.data<void>();
    p.bits = bits_;
    p.group_size = group_size_;
    if (bits_ == 0) {
      p.w_dtype = code_of(w.dtype());
    } else {
      p.scales = inputs[first + 1].data<void>();
      p.biases = inputs[first + 2].data<void>();
      p.s_dtype = code_of(inputs[first + 1].dtype());
    }
    p.out = out.data<void>();
    p.out_dtype = code_of(out.dtype());
    return p;
  };
  const size_t per_weight = bits_ == 0 ? 1 : 3;
  Product p = product_at(1);
  if (has_bias_) {
    const mx::array& b = inputs[1 + per_weight];
    p.bias = b.data<void>();
    p.b_dtype = code_of(b.dtype());
  }

  auto& encoder = mx::cpu::get_command_encoder(stream());
  // int8 activations serve every size: up to kSmallRows rows as decode's
  // matrix-vector passes, above it (prefill) the same kernel over blocks of
  // weight rows, so a row's result never depends on the rows beside it.
  const bool int8_x = int8_x_;
  if (gated_) {
    encoder.dispatch([g = p, u = product_at(1 + per_weight), x_raw = x.data<float>(),
                      y = out.data<float>(), int8_x, gelu = gelu_]() {
      run_gated(g, u, x_raw, int8_x, gelu, y);
    });
    return;
  }
  std::array<Product, kMaxParts> parts;
  parts[0] = p;
  for (int i = 1; i < parts_; ++i) {
    parts[i] = product_at(1 + i * per_weight);
    parts[i].out = outputs[i].data<void>();
  }
  encoder.dispatch([parts, count = parts_, x_raw = x.data<void>(),
                    x_dtype = code_of(x.dtype()), int8_x]() {
    run_products(parts.data(), count, x_raw, x_dtype, int8_x);
  });
}

void NativeMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[loom native kernels] have no GPU implementation.");
}

bool NativeMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const NativeMatmul*>(&other);
  return o != nullptr && o->bits_ == bits_ && o->group_size_ == group_size_ &&
      o->has_bias_ == has_bias_ && o->int8_x_ == int8_x_ && o->gated_ == gated_ &&
      o->parts_ == parts_ && o->gelu_ == gelu_;
}

std::vector<mx::Shape> NativeMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  const size_t per_weight = bits_ == 0 ? 1 : 3;
  std::vector<mx::Shape> shapes;
  for (int i = 0; i < parts_; ++i) {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1 + i * per_weight].shape(0);
    shapes.push_back(std::move(shape));
  }
  return shapes;
}

}  // namespace loom_cpu

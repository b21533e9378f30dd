#include "native_experts.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "activations.h"
#include "kernels.h"
#include "native_common.h"
#include "native_matmul.h"
#include "ops.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "threadpool.h"

namespace loom_cpu {

namespace {

// Below this many multiply-adds a stage runs on the calling thread alone
// (the linears' threshold).
constexpr long long kParallelMacs = 1 << 16;

// One stacked weight: expert 0's product, and how far the next expert's
// matrix (and scales, biases) lies.
struct Stacked {
  Product p;
  size_t w_stride = 0;
  size_t s_stride = 0;
};

Product for_expert(const Stacked& s, int e) {
  Product p = s.p;
  p.w = static_cast<const char*>(s.p.w) + s.w_stride * e;
  if (p.bits != 0) {
    p.scales = static_cast<const char*>(s.p.scales) + s.s_stride * e;
    p.biases = static_cast<const char*>(s.p.biases) + s.s_stride * e;
  }
  return p;
}

// The pairs routed to one expert: rows [start, start + m) of the grouped
// layout (pairs sorted by expert, in pair order within an expert).
struct Group {
  int expert;
  int start;
  int m;
};

// A group's activations as its kernel reads them (prepared once for every
// part of the stage, as the linears prepare x once for a gated pair).
struct Prepared {
  const float* x = nullptr;
  const float* xsum = nullptr;
  const int8_t* xq = nullptr;
  const float* steps = nullptr;
  bool gemm = false;
};

struct Task {
  int group;
  int n0;
  int n1;
};

thread_local Scratch grouped_scratch;
thread_local Scratch perm_scratch;
thread_local Scratch sum_scratch;
thread_local Scratch int8_scratch;
thread_local Scratch step_scratch;
thread_local Scratch part_scratch[kMaxGatherParts];
thread_local Scratch down_scratch;
thread_local Scratch gemm_scratch;

// A prefill chunk's buffers are large (2048 tokens x top-8 x 2048 columns of
// grouped x alone is 128 MiB) and a thread's scratch otherwise keeps its
// largest size for good: past this size they are freed after the node.
constexpr size_t kKeptScratchFloats = size_t{8} << 20;  // 32 MiB

void trim(Scratch& s) {
  if (s.size > kKeptScratchFloats) {
    std::free(s.data);
    s.data = nullptr;
    s.size = 0;
  }
}

size_t floats_for_bytes(size_t bytes) {
  return (bytes + sizeof(float) - 1) / sizeof(float) + 16;
}

// One stage: every group's rows of x (fp32 [P, K], grouped) against its
// expert's matrix of each part, into outs[i] ([P, N] in out_dtype, grouped
// rows). gated: two parts, and outs[0] becomes silu(outs[0]) * outs[1]
// (gelu: gelu_tanh(outs[0]) * outs[1], activations.h).
// Each group is one call of the linears' kernels on the expert's rows: the
// matrix-vector kernel up to kSmallRows rows, the GEMM above (int8
// activations: the int8 kernel at every row count, as the linears).
void run_stage(
    const Stacked* parts,
    int count,
    const float* x,
    const std::vector<Group>& groups,
    void* const* outs,
    size_t out_item,
    bool gated,
    bool gelu,
    bool int8_x) {
  const Product& first = parts[0].p;
  const int K = first.K;
  const int N = first.N;
  const int bits = first.bits;
  // Prepare the matrix-vector groups' activations.
  std::vector<Prepared> prep(groups.size());
  size_t perm_n = 0, sum_n = 0, q_n = 0, step_n = 0;
  for (const Group& g : groups) {
    if ((g.m > kSmallRows && !int8_x) || bits == 0) {
      continue;
    }
    sum_n += static_cast<size_t>(g.m) * (K / first.group_size);
    if (int8_x) {
      q_n += int8_x_bytes(g.m, K);
      step_n += int8_x_steps(g.m, K);
    } else if (bits == 4) {
      perm_n += static_cast<size_t>(g.m) * K;
    }
  }
  float* perm = perm_n ? perm_scratch.get(perm_n + 8) : nullptr;
  float* sums = sum_n ? sum_scratch.get(sum_n + 8) : nullptr;
  auto* xq = q_n ? reinterpret_cast<int8_t*>(int8_scratch.get(floats_for_bytes(q_n))) : nullptr;
  float* steps = step_n ? step_scratch.get(step_n + 8) : nullptr;
  long long macs = 0;
  for (size_t i = 0; i < groups.size(); ++i) {
    const Group& g = groups[i];
    Prepared& pr = prep[i];
    macs += static_cast<long long>(g.m) * N * K * count;
    pr.x = x + static_cast<size_t>(g.start) * K;
    if (g.m > kSmallRows && !int8_x) {
      pr.gemm = true;
      continue;
    }
    if (bits == 0) {
      continue;
    }
    Product q = first;
    q.x = pr.x;
    q.M = g.m;
    pr.xsum = sums;
    sums += static_cast<size_t>(g.m) * (K / first.group_size);
    if (int8_x) {
      prepare_int8_x(q, xq, steps, const_cast<float*>(pr.xsum));
      pr.xq = xq;
      pr.steps = steps;
      xq += int8_x_bytes(g.m, K);
      steps += int8_x_steps(g.m, K);
    } else if (bits == 4) {
      prepare_affine_x(q, perm, const_cast<float*>(pr.xsum));
      pr.x = perm;
      perm += static_cast<size_t>(g.m) * K;
    } else {
      prepare_affine_x(q, nullptr, const_cast<float*>(pr.xsum));
    }
  }
  // Tasks: chunks of output rows per group (GEMM groups in the GEMM's
  // blocks), several per thread so that a late thread delays little.
  const bool parallel = macs >= kParallelMacs;
  int vector_groups = 0;
  for (const Prepared& pr : prep) {
    vector_groups += pr.gemm ? 0 : 1;
  }
  int chunk = N;
  if (parallel && vector_groups > 0) {
    const long long target = static_cast<long long>(pool_threads()) * 4;
    const long long rows = static_cast<long long>(vector_groups) * N;
    chunk = whole_tiles(static_cast<int>((rows + target - 1) / target));
  }
  std::vector<Task> tasks;
  for (size_t i = 0; i < groups.size(); ++i) {
    const int step = prep[i].gemm ? gemm_block_rows() : chunk;
    for (int n0 = 0; n0 < N; n0 += step) {
      tasks.push_back({static_cast<int>(i), n0, std::min(N, n0 + step)});
    }
  }
  auto run = [&](int t) {
    const Task& task = tasks[t];
    const Group& g = groups[task.group];
    const Prepared& pr = prep[task.group];
    Product ps[kMaxGatherParts];
    for (int i = 0; i < count; ++i) {
      ps[i] = for_expert(parts[i], g.expert);
      ps[i].M = g.m;
      ps[i].x = pr.x;
      ps[i].out = static_cast<char*>(outs[i]) + static_cast<size_t>(g.start) * N * out_item;
      if (pr.gemm) {
        gemm_rows(ps[i], task.n0, task.n1, gemm_scratch.get(gemm_scratch_floats(g.m)));
      } else if (pr.xq != nullptr) {
        gemv4_int8_rows(ps[i], pr.xq, pr.steps, pr.xsum, task.n0, task.n1);
      } else {
        gemv_rows(ps[i], pr.xsum, task.n0, task.n1);
      }
    }
    if (gated) {
      auto* gate = static_cast<float*>(ps[0].out);
      const auto* up = static_cast<const float*>(ps[1].out);
      for (int m = 0; m < g.m; ++m) {
        const size_t row = static_cast<size_t>(m) * N;
        if (gelu) {
          gelu_tanh_mul(gate + row, up + row, gate + row, task.n0, task.n1);
        } else {
          silu_mul(gate + row, up + row, gate + row, task.n0, task.n1);
        }
      }
    }
  };
  if (!parallel) {
    for (size_t t = 0; t < tasks.size(); ++t) {
      run(static_cast<int>(t));
    }
    return;
  }
  parallel_for(static_cast<int>(tasks.size()), run);
}

// Everything one node computes, as plain data.
struct Job {
  const char* x = nullptr;
  int x_dtype = kF32;
  size_t x_item = 4;
  int K = 0;
  const char* idx = nullptr;
  bool idx_signed = true;
  int T = 0;  // tokens
  int k = 0;  // experts per token
  bool per_pair = false;  // x holds a row per pair (else per token)
  int E = 0;
  Stacked parts[kMaxGatherParts];
  int count = 1;
  bool gated = false;
  bool gelu = false;  // gated with gelu_tanh instead of silu
  bool has_down = false;
  Stacked down;
  bool int8_x = false;
  void* outs[kMaxGatherParts] = {nullptr, nullptr};
  int out_dtype = kF32;
  size_t out_item = 4;
};

void fill_nan(void* out, int dtype, size_t count) {
  if (dtype == kF32) {
    std::fill_n(static_cast<float*>(out), count, std::numeric_limits<float>::quiet_NaN());
  } else {
    // A quiet NaN in bfloat16 and in float16.
    std::fill_n(static_cast<uint16_t*>(out), count, dtype == kBF16 ? 0x7FC0 : 0x7E00);
  }
}

void run_job(const Job& j) {
  const int P = j.T * j.k;
  if (P == 0) {
    return;
  }
  // Group the pairs by expert (a stable counting sort). An index outside
  // [0, E) -- a router never makes one -- gives rows of NaN, not a read
  // outside the weights.
  std::vector<int> expert(P);
  std::vector<int> first(j.E + 2, 0);
  for (int i = 0; i < P; ++i) {
    long long e;
    if (j.idx_signed) {
      e = reinterpret_cast<const int32_t*>(j.idx)[i];
    } else {
      e = reinterpret_cast<const uint32_t*>(j.idx)[i];
    }
    expert[i] = (e < 0 || e >= j.E) ? j.E : static_cast<int>(e);
    ++first[expert[i] + 1];
  }
  for (int e = 0; e <= j.E; ++e) {
    first[e + 1] += first[e];
  }
  std::vector<Group> groups;
  for (int e = 0; e < j.E; ++e) {
    if (first[e + 1] > first[e]) {
      groups.push_back({e, first[e], first[e + 1] - first[e]});
    }
  }
  std::vector<int> order(P);
  {
    std::vector<int> at(first.begin(), first.end() - 1);
    for (int i = 0; i < P; ++i) {
      order[at[expert[i]]++] = i;
    }
  }
  const int valid = first[j.E];
  const int K = j.K;
  float* xg = grouped_scratch.get(static_cast<size_t>(valid) * K + 8);
  for (int i = 0; i < valid; ++i) {
    const int row = j.per_pair ? order[i] : order[i] / j.k;
    to_f32(j.x + static_cast<size_t>(row) * K * j.x_item, j.x_dtype, xg + static_cast<size_t>(i) * K,
           static_cast<size_t>(K));
  }
  const int N = j.parts[0].p.N;
  const int out_n = j.has_down ? j.down.p.N : N;
  const int outputs = (j.gated || j.has_down) ? 1 : j.count;
  if (valid > 0) {
    // Stage outputs in grouped order, then scattered to the pairs' rows.
    const size_t stage_item = j.has_down ? sizeof(float) : j.out_item;
    void* stage[kMaxGatherParts];
    for (int i = 0; i < j.count; ++i) {
      stage[i] = part_scratch[i].get(floats_for_bytes(static_cast<size_t>(valid) * N * stage_item));
    }
    run_stage(j.parts, j.count, xg, groups, stage, stage_item, j.gated, j.gelu, j.int8_x);
    const char* results[kMaxGatherParts] = {static_cast<const char*>(stage[0]),
                                            static_cast<const char*>(stage[1])};
    if (j.has_down) {
      void* y = down_scratch.get(floats_for_bytes(static_cast<size_t>(valid) * out_n * j.out_item));
      run_stage(&j.down, 1, static_cast<const float*>(stage[0]), groups, &y, j.out_item, false,
                false, j.int8_x);
      results[0] = static_cast<const char*>(y);
    }
    const size_t row_bytes = static_cast<size_t>(out_n) * j.out_item;
    for (int o = 0; o < outputs; ++o) {
      for (int i = 0; i < valid; ++i) {
        std::memcpy(static_cast<char*>(j.outs[o]) + static_cast<size_t>(order[i]) * row_bytes,
                    results[o] + static_cast<size_t>(i) * row_bytes, row_bytes);
      }
    }
  }
  for (int i = valid; i < P; ++i) {
    for (int o = 0; o < outputs; ++o) {
      fill_nan(static_cast<char*>(j.outs[o]) + static_cast<size_t>(order[i]) * out_n * j.out_item,
               j.out_dtype, static_cast<size_t>(out_n));
    }
  }
  for (Scratch* s : {&grouped_scratch, &perm_scratch, &sum_scratch, &int8_scratch,
                     &step_scratch, &part_scratch[0], &part_scratch[1], &down_scratch}) {
    trim(*s);
  }
}

// --- checks ------------------------------------------------------------------------

const char* kTag = "[loom native kernels] ";

// The routing indices; returns k (experts per token).
int check_indices(const mx::array& indices) {
  require(indices.ndim() >= 1 && (indices.dtype() == mx::int32 || indices.dtype() == mx::uint32),
          [&] {
            return std::string(kTag) + "expert indices must be an int32 or uint32 array [..., k], "
                "got shape " + shape_str(indices) + " " + dtype_str(indices.dtype()) + ".";
          });
  require(indices.shape(-1) >= 1, [&] {
    return std::string(kTag) + "expert indices need at least one expert per token.";
  });
  return indices.shape(-1);
}

// x [..., K] with one row per token or per (token, expert) pair.
void check_rows(const mx::array& x, const mx::array& indices, int K) {
  require(x.ndim() >= 1 && is_float(x.dtype()) && x.shape(-1) == K, [&] {
    return std::string(kTag) + "x must be a float32, bfloat16 or float16 array [..., " +
        std::to_string(K) + "], got shape " + shape_str(x) + " " + dtype_str(x.dtype()) + ".";
  });
  const size_t rows = K > 0 ? x.size() / K : 0;
  const size_t pairs = indices.size();
  const size_t tokens = pairs / indices.shape(-1);
  require(rows == tokens || rows == pairs, [&] {
    return std::string(kTag) + "x has " + std::to_string(rows) + " rows; the indices " +
        shape_str(indices) + " need one per token (" + std::to_string(tokens) +
        ") or one per pair (" + std::to_string(pairs) + ").";
  });
}

void check_stacked_dense(const mx::array& w) {
  require(w.ndim() == 3 && is_float(w.dtype()), [&] {
    return std::string(kTag) + "stacked expert weights must be a 3-D float32, bfloat16 or "
        "float16 array [experts, N, K], got shape " + shape_str(w) + " " + dtype_str(w.dtype()) +
        ".";
  });
}

// Returns K.
int check_stacked_affine(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int bits,
    int group_size,
    bool int8_activations) {
  require(!int8_activations || bits == 4, [&] {
    return std::string(kTag) + "int8 activations are implemented for 4-bit weights only, got " +
        std::to_string(bits) + "-bit.";
  });
  require(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8, [&] {
    return std::string(kTag) + "affine bits must be 2, 3, 4, 5, 6 or 8, got " +
        std::to_string(bits) + ".";
  });
  require(group_size == 32 || group_size == 64 || group_size == 128, [&] {
    return std::string(kTag) + "affine group size must be 32, 64 or 128, got " +
        std::to_string(group_size) + ".";
  });
  require(w.ndim() == 3 && w.dtype() == mx::uint32, [&] {
    return std::string(kTag) + "stacked quantized expert weights must be a 3-D uint32 array "
        "[experts, N, words], got shape " + shape_str(w) + " " + dtype_str(w.dtype()) + ".";
  });
  require((static_cast<long long>(w.shape(2)) * 32) % bits == 0, [&] {
    return std::string(kTag) + "a packed row of " + std::to_string(w.shape(2)) +
        " words does not hold whole " + std::to_string(bits) + "-bit codes.";
  });
  const int K = static_cast<int>(static_cast<long long>(w.shape(2)) * 32 / bits);
  require(K > 0 && K % group_size == 0, [&] {
    return std::string(kTag) + "the unpacked row length " + std::to_string(K) +
        " is not a positive multiple of the group size " + std::to_string(group_size) + ".";
  });
  for (const mx::array* a : {&scales, &biases}) {
    require(a->ndim() == 3 && a->shape(0) == w.shape(0) && a->shape(1) == w.shape(1) &&
                a->shape(2) == K / group_size && is_float(a->dtype()),
            [&] {
              return std::string(kTag) + "stacked scales and biases must be float [" +
                  std::to_string(w.shape(0)) + ", " + std::to_string(w.shape(1)) + ", " +
                  std::to_string(K / group_size) + "], got shape " + shape_str(*a) + " " +
                  dtype_str(a->dtype()) + ".";
            });
  }
  require(scales.dtype() == biases.dtype(), [&] {
    return std::string(kTag) + "scales and biases must share one dtype.";
  });
  return K;
}

void check_parts(size_t count, bool gated, bool gelu, const mx::array& x) {
  require(!gelu || gated, [&] {
    return std::string(kTag) + "gelu names the gate of a gated gathered product (gated=True).";
  });
  require(count >= 1 && count <= static_cast<size_t>(kMaxGatherParts), [&] {
    return std::string(kTag) + "a gathered product takes 1 to " +
        std::to_string(kMaxGatherParts) + " weights, got " + std::to_string(count) + ".";
  });
  require(!gated || count == 2, [&] {
    return std::string(kTag) + "a gated gathered product takes two weights (gate and up).";
  });
  require(!gated || x.dtype() == mx::float32, [&] {
    return std::string(kTag) + "a gated gathered product takes float32 x, got " +
        dtype_str(x.dtype()) + ".";
  });
}

void check_same(const mx::array& a, const mx::array& b, const char* what) {
  require(a.shape() == b.shape() && a.dtype() == b.dtype(), [&] {
    return std::string(kTag) + "the " + what + " of a gathered product must share one shape and "
        "dtype, got " + shape_str(a) + " " + dtype_str(a.dtype()) + " and " + shape_str(b) + " " +
        dtype_str(b.dtype()) + ".";
  });
}

// down [experts, D, N]: applied to the gated hidden rows.
void check_down_shape(const mx::array& down, int E) {
  require(down.ndim() == 3 && down.shape(0) == E, [&] {
    return std::string(kTag) + "the down weight must be [" + std::to_string(E) +
        ", D, ...], got shape " + shape_str(down) + ".";
  });
}

mx::Shape out_shape(const mx::array& indices, int n) {
  auto shape = indices.shape();
  shape.push_back(n);
  return shape;
}

std::vector<mx::array> finish(
    std::vector<mx::array> inputs,
    const mx::array& indices,
    int n,
    int outputs,
    mx::Dtype dtype,
    int bits,
    int group_size,
    bool int8_x,
    int parts,
    bool gated,
    bool gelu,
    bool down,
    mx::Stream stream) {
  std::vector<mx::Shape> shapes(outputs, out_shape(indices, n));
  std::vector<mx::Dtype> dtypes(outputs, dtype);
  return mx::array::make_arrays(
      std::move(shapes),
      dtypes,
      std::make_shared<NativeGatherMatmul>(
          stream, bits, group_size, int8_x, parts, gated, gelu, down),
      std::move(inputs));
}

}  // namespace

std::vector<mx::array> gather_dense_matmul(
    const mx::array& x,
    const mx::array& indices,
    const std::vector<mx::array>& weights,
    bool gated,
    bool gelu,
    const std::optional<mx::array>& down,
    mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  check_indices(indices);
  check_parts(weights.size(), gated, gelu, x);
  check_stacked_dense(weights[0]);
  for (const auto& w : weights) {
    check_same(weights[0], w, "weights");
  }
  check_rows(x, indices, weights[0].shape(2));
  std::vector<mx::array> inputs = {x, indices};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  int n = weights[0].shape(1);
  if (down) {
    require(gated, [&] {
      return std::string(kTag) + "a down projection follows a gated product only.";
    });
    check_stacked_dense(*down);
    check_down_shape(*down, weights[0].shape(0));
    require(down->shape(2) == n && down->dtype() == weights[0].dtype(), [&] {
      return std::string(kTag) + "the down weight must be [experts, D, " + std::to_string(n) +
          "] in the gate's dtype, got shape " + shape_str(*down) + " " +
          dtype_str(down->dtype()) + ".";
    });
    inputs.push_back(*down);
    n = down->shape(1);
  }
  const bool one = gated || down.has_value();
  return finish(
      std::move(inputs), indices, n, one ? 1 : static_cast<int>(weights.size()),
      mx::promote_types(x.dtype(), weights[0].dtype()), 0, 0, false,
      static_cast<int>(weights.size()), gated, gelu, down.has_value(), stream);
}

std::vector<mx::array> gather_affine_matmul(
    const mx::array& x,
    const mx::array& indices,
    const std::vector<mx::array>& weights,
    const std::vector<mx::array>& scales,
    const std::vector<mx::array>& biases,
    int bits,
    int group_size,
    bool int8_activations,
    bool gated,
    bool gelu,
    const std::optional<mx::array>& down,
    const std::optional<mx::array>& down_scales,
    const std::optional<mx::array>& down_biases,
    mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  check_indices(indices);
  check_parts(weights.size(), gated, gelu, x);
  require(scales.size() == weights.size() && biases.size() == weights.size(), [&] {
    return std::string(kTag) + "a gathered product needs one scales and one biases array per "
        "weight.";
  });
  const int K =
      check_stacked_affine(weights[0], scales[0], biases[0], bits, group_size, int8_activations);
  for (size_t i = 1; i < weights.size(); ++i) {
    check_same(weights[0], weights[i], "weights");
    check_same(scales[0], scales[i], "scales");
    check_same(biases[0], biases[i], "biases");
  }
  check_rows(x, indices, K);
  std::vector<mx::array> inputs = {x, indices};
  for (size_t i = 0; i < weights.size(); ++i) {
    inputs.insert(inputs.end(), {weights[i], scales[i], biases[i]});
  }
  int n = weights[0].shape(1);
  const bool has_down = down.has_value();
  require(has_down == down_scales.has_value() && has_down == down_biases.has_value(), [&] {
    return std::string(kTag) + "a down projection needs its weight, scales and biases.";
  });
  if (has_down) {
    require(gated, [&] {
      return std::string(kTag) + "a down projection follows a gated product only.";
    });
    check_down_shape(*down, weights[0].shape(0));
    const int down_k =
        check_stacked_affine(*down, *down_scales, *down_biases, bits, group_size, int8_activations);
    require(down_k == n && down_scales->dtype() == scales[0].dtype(), [&] {
      return std::string(kTag) + "the down weight must take rows of " + std::to_string(n) +
          " and share the gate's scale dtype, got rows of " + std::to_string(down_k) + " and " +
          dtype_str(down_scales->dtype()) + ".";
    });
    inputs.insert(inputs.end(), {*down, *down_scales, *down_biases});
    n = down->shape(1);
  }
  const bool one = gated || has_down;
  return finish(
      std::move(inputs), indices, n, one ? 1 : static_cast<int>(weights.size()),
      mx::promote_types(x.dtype(), scales[0].dtype()), bits, group_size, int8_activations,
      static_cast<int>(weights.size()), gated, gelu, has_down, stream);
}

void NativeGatherMatmul::eval_cpu(
    const std::vector<mx::array>& raw_inputs,
    std::vector<mx::array>& outputs) {
  const std::vector<mx::array> inputs = begin_eval(raw_inputs, outputs, stream());
  const mx::array& x = inputs[0];
  const mx::array& indices = inputs[1];
  const size_t per_weight = bits_ == 0 ? 1 : 3;
  auto stacked_at = [&](size_t at) {
    const mx::array& w = inputs[at];
    Stacked st;
    Product& p = st.p;
    p.N = w.shape(1);
    p.K = bits_ == 0 ? w.shape(2) : static_cast<int>(static_cast<long long>(w.shape(2)) * 32 / bits_);
    p.w = w.data<void>();
    p.bits = bits_;
    p.group_size = group_size_;
    st.w_stride = static_cast<size_t>(w.shape(1)) * w.shape(2) * w.itemsize();
    if (bits_ == 0) {
      p.w_dtype = code_of(w.dtype());
    } else {
      const mx::array& sc = inputs[at + 1];
      p.scales = sc.data<void>();
      p.biases = inputs[at + 2].data<void>();
      p.s_dtype = code_of(sc.dtype());
      st.s_stride = static_cast<size_t>(sc.shape(1)) * sc.shape(2) * sc.itemsize();
    }
    return st;
  };
  Job j;
  j.x = x.data<char>();
  j.x_dtype = code_of(x.dtype());
  j.x_item = x.itemsize();
  j.idx = indices.data<char>();
  j.idx_signed = indices.dtype() == mx::int32;
  j.k = indices.shape(-1);
  j.T = static_cast<int>(indices.size() / j.k);
  j.E = inputs[2].shape(0);
  j.count = parts_;
  j.gated = gated_;
  j.gelu = gelu_;
  j.has_down = down_;
  for (int i = 0; i < parts_; ++i) {
    j.parts[i] = stacked_at(2 + i * per_weight);
  }
  j.K = j.parts[0].p.K;
  j.per_pair = j.K > 0 && x.size() / j.K == indices.size() && j.k > 1;
  if (down_) {
    j.down = stacked_at(2 + parts_ * per_weight);
  }
  // The linears' rule: int8 activations serve matrix-vector sizes (per
  // expert here), 4-bit weights only.
  j.int8_x = int8_x_;
  j.out_dtype = code_of(outputs[0].dtype());
  j.out_item = outputs[0].itemsize();
  for (auto& p : j.parts) {
    p.p.out_dtype = (gated_ || down_) ? kF32 : j.out_dtype;
  }
  j.down.p.out_dtype = j.out_dtype;
  for (size_t i = 0; i < outputs.size(); ++i) {
    j.outs[i] = outputs[i].data<void>();
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.dispatch([j]() { run_job(j); });
}

void NativeGatherMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[loom native kernels] have no GPU implementation.");
}

bool NativeGatherMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const NativeGatherMatmul*>(&other);
  return o != nullptr && o->bits_ == bits_ && o->group_size_ == group_size_ &&
      o->int8_x_ == int8_x_ && o->parts_ == parts_ && o->gated_ == gated_ && o->gelu_ == gelu_ &&
      o->down_ == down_;
}

std::vector<mx::Shape> NativeGatherMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  const size_t per_weight = bits_ == 0 ? 1 : 3;
  const mx::array& indices = inputs[1];
  if (down_) {
    return {out_shape(indices, inputs[2 + parts_ * per_weight].shape(1))};
  }
  const int n = inputs[2].shape(1);
  return std::vector<mx::Shape>(gated_ ? 1 : parts_, out_shape(indices, n));
}

}  // namespace loom_cpu

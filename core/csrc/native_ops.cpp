#include "native_ops.h"

#include <algorithm>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "native_common.h"
#include "ops.h"
#include "threadpool.h"

namespace loom_cpu {

namespace {

thread_local Scratch attention_scratch;

// Below this much work (element-multiply-adds) an op runs on one thread.
constexpr long long kParallelWork = 1 << 15;

void require_float(const mx::array& a, const char* what) {
  require(is_float(a.dtype()), [&] {
    return std::string(std::string("[loom native kernels] ") + what +
        " must be float32, bfloat16 or float16, got " + dtype_str(a.dtype()) + ".");
  });
}

// Split `count` units of `work_each` over the pool in contiguous chunks.
template <typename F>
void split(int count, long long work_each, F&& fn) {
  const long long total = static_cast<long long>(count) * std::max(work_each, 1LL);
  const int tasks = total < kParallelWork ? 1 : std::min(count, pool_threads() * 4);
  const int chunk = (count + tasks - 1) / std::max(tasks, 1);
  const int used = (count + chunk - 1) / std::max(chunk, 1);
  parallel_for(used, [&](int t) {
    const int a = t * chunk;
    fn(a, std::min(count, a + chunk));
  });
}

mx::array make_op(
    mx::Shape shape,
    mx::Dtype dtype,
    NativeOp::Kind kind,
    float fparam,
    int iparam,
    bool flag,
    std::vector<mx::array> inputs,
    mx::Stream stream) {
  return mx::array(
      std::move(shape),
      dtype,
      std::make_shared<NativeOp>(stream, kind, fparam, iparam, flag),
      std::move(inputs));
}

// The positions rope rotates by: offset + l for l in [0, L). Refused when an
// offset is negative or offset + L - 1 passes INT32_MAX (the kernel and
// mx.fast.rope both index positions as int32). Empty string: all fine.
std::string rope_positions_error(const int32_t* offsets, int n, int L) {
  for (int i = 0; i < n; ++i) {
    const int64_t last = static_cast<int64_t>(offsets[i]) + std::max(L, 1) - 1;
    if (offsets[i] < 0 || last > INT32_MAX) {
      return "[loom native kernels] rope's offset " + std::to_string(offsets[i]) + " with " +
          std::to_string(L) + " positions is out of range: positions must lie in 0.." +
          std::to_string(INT32_MAX) + ".";
    }
  }
  return std::string();
}

}  // namespace

mx::array rms_norm(
    const mx::array& x, const std::optional<mx::array>& w, float eps, mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  require(x.ndim() >= 1 && x.shape(-1) > 0, [&] {
    return std::string("[loom native kernels] rms_norm needs a last axis.");
  });
  require_float(x, "rms_norm's x");
  const int D = x.shape(-1);
  require(D <= kMaxNormWidth, [&] {
    return std::string("[loom native kernels] rms_norm rows are at most " +
        std::to_string(kMaxNormWidth) + " wide, got " + std::to_string(D) + ".");
  });
  std::vector<mx::array> inputs = {x};
  mx::Dtype out = x.dtype();
  if (w) {
    require(w->ndim() == 1 && w->shape(0) == D && is_float(w->dtype()), [&] {
      return std::string(
          "[loom native kernels] rms_norm's weight must be a float vector of length " +
          std::to_string(D) + ", got shape " + shape_str(*w) + " " + dtype_str(w->dtype()) + ".");
    });
    out = mx::promote_types(out, w->dtype());
    inputs.push_back(*w);
  }
  return make_op(x.shape(), out, NativeOp::kNorm, eps, w ? 1 : 0, false, std::move(inputs), stream);
}

mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    const mx::array& inv_freq,
    float scale,
    const mx::array& offsets,
    mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  require(x.ndim() >= 2, [&] {
    return std::string("[loom native kernels] rope's x needs [..., L, D] axes.");
  });
  require_float(x, "rope's x");
  const int D = x.shape(-1);
  require(dims > 0 && dims % 2 == 0 && dims <= D && D <= kMaxRopeWidth, [&] {
    return std::string(
        "[loom native kernels] rope rotates an even number of dims, at most the row width (" +
        std::to_string(D) + ", at most " + std::to_string(kMaxRopeWidth) + "); got " +
        std::to_string(dims) + ".");
  });
  require(
      inv_freq.ndim() == 1 && inv_freq.shape(0) == dims / 2 && inv_freq.dtype() == mx::float32,
      [&] {
        return std::string("[loom native kernels] rope's inverse frequencies must be float32 [" +
            std::to_string(dims / 2) + "], got " + shape_str(inv_freq) + " " +
            dtype_str(inv_freq.dtype()) + ".");
      });
  const int batch = x.ndim() > 2 ? x.shape(0) : 1;
  require(
      offsets.ndim() == 1 && offsets.dtype() == mx::int32 &&
          (offsets.shape(0) == 1 || offsets.shape(0) == batch),
      [&] {
        return std::string("[loom native kernels] rope's offsets must be int32 [1] or [" +
            std::to_string(batch) + "], got " + shape_str(offsets) + " " +
            dtype_str(offsets.dtype()) + ".");
      });
  // Offsets that already hold data (a Python int made into an array, a
  // cache's offsets) are checked here, where the error reaches the caller.
  // Computed offsets are not yet known, and eval_cpu only queues the work:
  // for them the kernel is merely safe (any int32 offset reads initialised
  // angles, positions are int64), rotating like mx.fast.rope would.
  if (offsets.is_available()) {
    const std::string error = rope_positions_error(
        offsets.data<int32_t>(), static_cast<int>(offsets.size()), x.shape(-2));
    require(error.empty(), [&] { return error; });
  }
  return make_op(
      x.shape(), x.dtype(), NativeOp::kRope, scale, dims, traditional, {x, inv_freq, offsets},
      stream);
}

mx::array attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    bool causal,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& lengths,
    mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  require(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4, [&] {
    return std::string("[loom native kernels] attention takes q, k and v as [B, H, L, D].");
  });
  require_float(q, "attention's q");
  require(is_float(k.dtype()) && v.dtype() == k.dtype(), [&] {
    return std::string(
        "[loom native kernels] attention's k and v must share one float dtype (float32, "
        "bfloat16 or float16; q's may differ), got " + dtype_str(k.dtype()) + " and " +
        dtype_str(v.dtype()) + ".");
  });
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int Hkv = k.shape(1), S = k.shape(2), Dv = v.shape(3);
  require(
      k.shape(0) == B && v.shape(0) == B && v.shape(1) == Hkv && v.shape(2) == S &&
          k.shape(3) == D && Hkv > 0 && Hq % Hkv == 0,
      [&] {
        return std::string("[loom native kernels] attention shapes do not fit: q " +
            shape_str(q) + ", k " + shape_str(k) + ", v " + shape_str(v) + ".");
      });
  require(!causal || S >= L, [&] {
    return std::string(
        "[loom native kernels] causal attention needs at least as many keys as queries.");
  });
  std::vector<mx::array> inputs = {q, k, v};
  if (mask) {
    require(mask->dtype() == mx::float32, [&] {
      return std::string("[loom native kernels] attention's mask must be additive float32.");
    });
    inputs.push_back(mx::broadcast_to(*mask, {B, Hq, L, S}, stream));
  }
  if (lengths) {
    require(
        lengths->ndim() == 1 && lengths->dtype() == mx::int32 &&
            (lengths->shape(0) == 1 || lengths->shape(0) == B),
        [&] {
          return std::string("[loom native kernels] attention's lengths must be int32 [1] or [" +
              std::to_string(B) + "], got " + shape_str(*lengths) + " " +
              dtype_str(lengths->dtype()) + ".");
        });
    inputs.push_back(*lengths);
  }
  return make_op(
      {B, Hq, L, Dv}, q.dtype(), NativeOp::kAttention, scale, (mask ? 1 : 0) | (lengths ? 2 : 0),
      causal, std::move(inputs), stream);
}

mx::array silu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  require(gate.dtype() == mx::float32 && up.dtype() == mx::float32, [&] {
    return std::string("[loom native kernels] silu_mul takes float32 gate and up, got " +
        dtype_str(gate.dtype()) + " and " + dtype_str(up.dtype()) + ".");
  });
  require(gate.shape() == up.shape(), [&] {
    return std::string("[loom native kernels] silu_mul's gate and up must share one shape, got " +
        shape_str(gate) + " and " + shape_str(up) + ".");
  });
  return make_op(gate.shape(), mx::float32, NativeOp::kSiluMul, 0.0f, 0, false, {gate, up}, stream);
}

mx::array log_softmax(const mx::array& x, mx::StreamOrDevice s) {
  check_runnable();
  mx::Stream stream = cpu_stream(s);
  require(x.dtype() == mx::float32 && x.ndim() >= 1 && x.shape(-1) > 0, [&] {
    return std::string("[loom native kernels] log_softmax takes float32 x with a last axis, got " +
        shape_str(x) + " " + dtype_str(x.dtype()) + ".");
  });
  return make_op(x.shape(), mx::float32, NativeOp::kLogSoftmax, 0.0f, 0, false, {x}, stream);
}

void NativeOp::eval_cpu(const std::vector<mx::array>& raw, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const mx::Stream s = stream();
  std::vector<mx::array> in;
  for (size_t i = 0; i < raw.size(); ++i) {
    // Attention reads its keys and values through their strides (a cache
    // window is a view of a larger buffer); only a last axis that is not
    // contiguous needs a copy.
    // The mask (input 3 when given) is read through any strides: a mask
    // broadcast over batch and heads stays the [L, S] array it was built as.
    const bool kv = kind_ == kAttention && (i == 1 || i == 2);
    const bool strided_mask = kind_ == kAttention && i == 3 && (iparam_ & 1) != 0;
    const bool ok = strided_mask ||
        (kv ? raw[i].strides().back() == 1 : raw[i].flags().row_contiguous);
    in.push_back(ok ? raw[i] : row_contiguous(raw[i], s));
  }
  auto& encoder = mx::cpu::get_command_encoder(s);
  for (const auto& a : in) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  if (kind_ == kNorm) {
    NormJob job;
    job.x = in[0].data<void>();
    job.x_dtype = code_of(in[0].dtype());
    if (iparam_ != 0) {
      job.w = in[1].data<void>();
      job.w_dtype = code_of(in[1].dtype());
    }
    job.out = out.data<void>();
    job.out_dtype = code_of(out.dtype());
    job.D = in[0].shape(-1);
    job.eps = fparam_;
    const int rows = static_cast<int>(in[0].size() / job.D);
    encoder.dispatch([job, rows]() {
      split(rows, job.D, [&](int a, int b) { rms_norm_rows(job, a, b); });
    });
    return;
  }
  if (kind_ == kSiluMul) {
    const float* gate = in[0].data<float>();
    const float* up = in[1].data<float>();
    float* y = out.data<float>();
    const size_t n = out.size();
    // Blocks of 64 elements; an element costs about as much as 8 of a norm's.
    const int blocks = static_cast<int>((n + 63) / 64);
    encoder.dispatch([gate, up, y, n, blocks]() {
      split(blocks, 64 * 8, [&](int a, int b) {
        silu_mul(gate, up, y, static_cast<size_t>(a) * 64, std::min(n, static_cast<size_t>(b) * 64));
      });
    });
    return;
  }
  if (kind_ == kLogSoftmax) {
    const float* x = in[0].data<float>();
    float* y = out.data<float>();
    const int V = in[0].shape(-1);
    const int rows = static_cast<int>(in[0].size() / V);
    encoder.dispatch([x, y, V, rows]() {
      split(rows, static_cast<long long>(V) * 8, [&](int a, int b) { log_softmax_rows(x, y, V, a, b); });
    });
    return;
  }
  if (kind_ == kRope) {
    const mx::array& x = in[0];
    RopeJob job;
    job.x = x.data<void>();
    job.x_dtype = code_of(x.dtype());
    job.out = out.data<void>();
    job.L = x.shape(-2);
    job.D = x.shape(-1);
    job.R = static_cast<int>(x.size() / (static_cast<size_t>(job.L) * job.D));
    job.dims = iparam_;
    job.traditional = flag_;
    job.inv_freq = in[1].data<float>();
    job.scale = fparam_;
    job.offsets = in[2].data<int32_t>();
    job.n_offsets = in[2].shape(0);
    encoder.dispatch([job]() {
      split(job.R, static_cast<long long>(job.L) * job.D, [&](int a, int b) { rope_rows(job, a, b); });
    });
    return;
  }
  const mx::array& q = in[0];
  const mx::array& k = in[1];
  const mx::array& v = in[2];
  AttentionJob job;
  job.q = q.data<void>();
  job.k = k.data<void>();
  job.v = v.data<void>();
  job.dtype = code_of(q.dtype());
  job.kv_dtype = code_of(k.dtype());
  job.out = out.data<void>();
  job.out_dtype = code_of(out.dtype());
  job.B = q.shape(0);
  job.Hq = q.shape(1);
  job.L = q.shape(2);
  job.D = q.shape(3);
  job.Hkv = k.shape(1);
  job.S = k.shape(2);
  job.Dv = v.shape(3);
  for (int i = 0; i < 3; ++i) {
    job.k_strides[i] = static_cast<size_t>(k.strides()[i]);
    job.v_strides[i] = static_cast<size_t>(v.strides()[i]);
  }
  job.scale = fparam_;
  job.causal = flag_;
  size_t next = 3;
  if ((iparam_ & 1) != 0) {
    const mx::array& mask = in[next++];
    job.mask = mask.data<float>();
    for (int i = 0; i < 4; ++i) {
      job.m_strides[i] = static_cast<size_t>(mask.strides()[i]);
    }
  }
  if ((iparam_ & 2) != 0) {
    job.lengths = in[next].data<int32_t>();
    job.n_lengths = in[next].shape(0);
  }
  encoder.dispatch([job]() {
    const long long each = static_cast<long long>(job.L) * job.S * (job.D + job.Dv);
    const size_t floats = attention_scratch_floats(job);
    split(job.B * job.Hq, each, [&](int a, int b) {
      attention_heads(job, a, b, attention_scratch.get(floats));
    });
  });
}

void NativeOp::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[loom native kernels] have no GPU implementation.");
}

bool NativeOp::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const NativeOp*>(&other);
  return o != nullptr && o->kind_ == kind_ && o->fparam_ == fparam_ && o->iparam_ == iparam_ &&
      o->flag_ == flag_;
}

std::vector<mx::Shape> NativeOp::output_shapes(const std::vector<mx::array>& inputs) {
  if (kind_ != kAttention) {
    return {inputs[0].shape()};
  }
  auto shape = inputs[0].shape();
  shape.back() = inputs[2].shape(3);
  return {shape};
}

}  // namespace loom_cpu

#include "native_common.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>
#include <stdexcept>

#include "cpu_features.h"
#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace loom_cpu {

int code_of(mx::Dtype d) {
  if (d == mx::bfloat16) {
    return kBF16;
  }
  if (d == mx::float16) {
    return kF16;
  }
  return kF32;
}

bool is_float(mx::Dtype d) {
  return d == mx::float32 || d == mx::bfloat16 || d == mx::float16;
}

std::string shape_str(const mx::Shape& shape) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    os << (i ? ", " : "") << shape[i];
  }
  os << (shape.size() == 1 ? ",)" : ")");
  return os.str();
}

std::string shape_str(const mx::array& a) {
  return shape_str(a.shape());
}

std::string dtype_str(mx::Dtype d) {
  std::ostringstream os;
  os << d;
  return os.str();
}

void check_runnable() {
  // The CPU does not change while the process runs.
  static const std::string missing = missing_instructions();
  if (!missing.empty()) {
    throw std::runtime_error(
        "[loom native kernels] this CPU lacks " + missing +
        ", which the native CPU kernels need.");
  }
  // A bad MLX_LOOM_CPU_ISA is an error here, when the graph is built, and
  // never in a worker thread running a kernel.
  active_isa();
}

mx::Stream cpu_stream(mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  require(stream.device == mx::Device::cpu, [&] {
    return std::string(
        "[loom native kernels] run only on the CPU device; the stream given is on the GPU.");
  });
  return stream;
}

namespace {

// Copy a strided array (element size `esize`) into dense row-major order.
void strided_copy(
    const char* src,
    char* dst,
    const std::vector<int>& shape,
    const std::vector<int64_t>& strides,
    size_t esize) {
  const int nd = static_cast<int>(shape.size());
  size_t total = 1;
  for (int d : shape) {
    total *= static_cast<size_t>(d);
  }
  std::vector<int> idx(nd, 0);
  int64_t off = 0;
  for (size_t i = 0; i < total; ++i) {
    std::memcpy(dst + i * esize, src + off * static_cast<int64_t>(esize), esize);
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        off += strides[d];
        break;
      }
      off -= strides[d] * (shape[d] - 1);
      idx[d] = 0;
    }
  }
}

}  // namespace

std::vector<mx::array> begin_eval(
    const std::vector<mx::array>& raw, std::vector<mx::array>& outputs, mx::Stream stream) {
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }
  std::vector<mx::array> inputs;
  inputs.reserve(raw.size());
  for (const auto& a : raw) {
    inputs.push_back(row_contiguous(a, stream));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  return inputs;
}

mx::array row_contiguous(const mx::array& a, mx::Stream stream) {
  if (a.flags().row_contiguous) {
    return a;
  }
  mx::array copy(a.shape(), a.dtype(), nullptr, {});
  copy.set_data(mx::allocator::malloc(copy.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(a);
  encoder.set_output_array(copy);
  std::vector<int> shape(a.shape().begin(), a.shape().end());
  std::vector<int64_t> strides(a.strides().begin(), a.strides().end());
  encoder.dispatch([src = a.data<char>(), dst = copy.data<char>(), shape, strides,
                    esize = a.itemsize()]() { strided_copy(src, dst, shape, strides, esize); });
  encoder.add_temporary(copy);
  return copy;
}

Scratch::~Scratch() {
  std::free(data);
}

float* Scratch::get(size_t floats) {
  if (floats > size) {
    std::free(data);
    size_t bytes = ((floats * sizeof(float)) + 63) / 64 * 64;
    data = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (data == nullptr) {
      size = 0;
      throw std::bad_alloc();
    }
    size = floats;
  }
  return data;
}

}  // namespace loom_cpu

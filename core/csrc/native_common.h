// Checks and scratch memory shared by the MLX primitives (baseline x86-64
// code: it runs before the CPU check).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace loom_cpu {

namespace mx = mlx::core;

// The kernels' dtype code (kernels.h) of a float dtype.
int code_of(mx::Dtype d);
bool is_float(mx::Dtype d);
std::string shape_str(const mx::array& a);
std::string shape_str(const mx::Shape& shape);
std::string dtype_str(mx::Dtype d);
// Throws std::invalid_argument (ValueError in Python) with message() when
// !ok. The message is built only then: these checks run on every call of
// every op, 200+ times per decode step, and building the strings eagerly
// made a product's Python call cost 7.8 us instead of ~1.5.
template <class Message>
void require(bool ok, Message&& message) {
  if (!ok) {
    throw std::invalid_argument(message());
  }
}
// Throws when this CPU lacks the instructions the kernels were built for.
void check_runnable();
mx::Stream cpu_stream(mx::StreamOrDevice s);
// `a` itself when row-contiguous, else a row-contiguous copy made on the
// stream (kept alive until the primitive's kernels have run). Done at
// evaluation rather than as a graph node: most activations are contiguous
// already, and a decode step then builds no extra node per product.
mx::array row_contiguous(const mx::array& a, mx::Stream stream);
// The start of a primitive's evaluation: its outputs allocated, its inputs
// made row-contiguous (row_contiguous), and both registered with the
// stream's encoder, so the kernels may read and write them. Returns the
// inputs to read.
std::vector<mx::array> begin_eval(
    const std::vector<mx::array>& raw, std::vector<mx::array>& outputs, mx::Stream stream);

// Per-thread fp32 scratch, reused across calls (64-byte aligned).
struct Scratch {
  float* data = nullptr;
  size_t size = 0;
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch();
  float* get(size_t floats);
};

}  // namespace loom_cpu

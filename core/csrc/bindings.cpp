// Python bindings of the native CPU kernels (module mlx_loom.cpu._native).
// Built in nanobind's "mlx" domain so that mx.array crosses unchanged.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "cpu_features.h"
#include "native_matmul.h"
#include "threadpool.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_native, m) {
  m.doc() = "Native CPU kernels for mlx-loom: SIMD matrix products on MLX arrays.";

  m.def(
      "cpu_features",
      []() {
        nb::dict out;
        for (const auto& [name, present] : loom_cpu::cpu_features()) {
          out[name.c_str()] = present;
        }
        return out;
      },
      "Instruction sets this CPU supports, detected at run time.");
  m.def(
      "missing_instructions",
      &loom_cpu::missing_instructions,
      "The instruction sets the kernels need that this CPU lacks ('' when none).");
  m.def("threads", &loom_cpu::pool_threads, "Threads one product runs on.");
  m.attr("SMALL_ROWS") = loom_cpu::kSmallRows;

  m.def(
      "dense_matmul",
      [](const mlx::core::array& x,
         const mlx::core::array& w,
         const std::optional<mlx::core::array>& bias) {
        return loom_cpu::dense_matmul(x, w, bias);
      },
      "x"_a,
      "w"_a,
      "bias"_a = nb::none(),
      "x @ w.T (+ bias) for a float32/bfloat16/float16 weight [N, K]; fp32 arithmetic.");
  m.def(
      "affine_matmul",
      [](const mlx::core::array& x,
         const mlx::core::array& w,
         const mlx::core::array& scales,
         const mlx::core::array& biases,
         int bits,
         int group_size,
         const std::optional<mlx::core::array>& bias) {
        return loom_cpu::affine_matmul(x, w, scales, biases, bits, group_size, bias);
      },
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "bits"_a,
      "group_size"_a,
      "bias"_a = nb::none(),
      "x @ dequantize(w).T (+ bias) for MLX affine packing; fp32 arithmetic.");
}

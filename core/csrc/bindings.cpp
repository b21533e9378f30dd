// Python bindings of the native CPU kernels (module mlx_loom.cpu._native).
// Built in nanobind's "mlx" domain so that mx.array crosses unchanged.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "cpu_features.h"
#include "native_activations.h"
#include "native_delta.h"
#include "native_experts.h"
#include "native_matmul.h"
#include "native_ops.h"
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
  m.def(
      "cpu_isa",
      []() { return loom_cpu::isa_name(loom_cpu::active_isa()); },
      "The instruction set the int8-activation kernels use: 'avx512-vnni' or 'avx2' "
      "(MLX_LOOM_CPU_ISA=auto|avx2|avx512 chooses; ValueError for a bad value).");
  m.def(
      "set_cpu_isa",
      &loom_cpu::set_isa,
      "name"_a,
      "Switch the int8 kernels' instruction set ('auto', 'avx2' or 'avx512'; both give "
      "bit-identical results; 'avx512' runs one activation row on it too, 'auto' as "
      "one_row_avx512 says) and return the one in use.");
  m.def(
      "one_row_avx512",
      []() { return loom_cpu::one_row_avx512(); },
      "Whether one activation row's int8 products run on AVX-512 too on this CPU (where the "
      "instruction set in use is AVX-512); only time depends on it.");
  m.def(
      "one_row_avx512_for",
      &loom_cpu::one_row_avx512_for,
      "vendor"_a,
      "family"_a,
      "The rule one_row_avx512 applies, for a cpuid vendor string and display family.");
  m.def("threads", &loom_cpu::pool_threads, "Threads one product runs on.");
  m.attr("SMALL_ROWS") = loom_cpu::kSmallRows;
  m.attr("MAX_PARTS") = loom_cpu::kMaxParts;

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
         const std::optional<mlx::core::array>& bias,
         bool int8_activations) {
        return loom_cpu::affine_matmul(
            x, w, scales, biases, bits, group_size, bias, int8_activations);
      },
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "bits"_a,
      "group_size"_a,
      "bias"_a = nb::none(),
      "int8_activations"_a = false,
      "x @ dequantize(w).T (+ bias) for MLX affine packing; fp32 arithmetic, or (4-bit, "
      "int8_activations) integer products against x quantized to int8 per 32 columns in "
      "products of at most SMALL_ROWS rows.");

  m.def(
      "gated_dense_matmul",
      [](const mlx::core::array& x,
         const mlx::core::array& gate,
         const mlx::core::array& up,
         bool gelu) { return loom_cpu::gated_dense_matmul(x, gate, up, gelu); },
      "x"_a,
      "gate"_a,
      "up"_a,
      "gelu"_a = false,
      "silu(x @ gate.T) * (x @ up.T) as one node for float32 x; bit-equal to the two "
      "dense_matmul calls and silu_mul. gelu: gelu_approx(...) * (...) (GeGLU), bit-equal "
      "to the two calls and gelu_mul.");
  m.def(
      "gated_affine_matmul",
      [](const mlx::core::array& x,
         const mlx::core::array& gate,
         const mlx::core::array& gate_scales,
         const mlx::core::array& gate_biases,
         const mlx::core::array& up,
         const mlx::core::array& up_scales,
         const mlx::core::array& up_biases,
         int bits,
         int group_size,
         bool int8_activations,
         bool gelu) {
        return loom_cpu::gated_affine_matmul(
            x, gate, gate_scales, gate_biases, up, up_scales, up_biases, bits, group_size,
            int8_activations, gelu);
      },
      "x"_a,
      "gate"_a,
      "gate_scales"_a,
      "gate_biases"_a,
      "up"_a,
      "up_scales"_a,
      "up_biases"_a,
      "bits"_a,
      "group_size"_a,
      "int8_activations"_a = false,
      "gelu"_a = false,
      "silu(x @ dequantize(gate).T) * (x @ dequantize(up).T) as one node for float32 x; "
      "bit-equal to the two affine_matmul calls and silu_mul. gelu: gelu_approx(...) * (...) "
      "(GeGLU), bit-equal to the two calls and gelu_mul.");
  m.def(
      "multi_dense_matmul",
      [](const mlx::core::array& x, const std::vector<mlx::core::array>& weights) {
        return loom_cpu::multi_dense_matmul(x, weights);
      },
      "x"_a,
      "weights"_a,
      "[x @ w.T for w in weights] as one node (weights of one row length and dtype); each "
      "output equals dense_matmul bit for bit.");
  m.def(
      "multi_affine_matmul",
      [](const mlx::core::array& x,
         const std::vector<mlx::core::array>& weights,
         const std::vector<mlx::core::array>& scales,
         const std::vector<mlx::core::array>& biases,
         int bits,
         int group_size,
         bool int8_activations) {
        return loom_cpu::multi_affine_matmul(
            x, weights, scales, biases, bits, group_size, int8_activations);
      },
      "x"_a,
      "weights"_a,
      "scales"_a,
      "biases"_a,
      "bits"_a,
      "group_size"_a,
      "int8_activations"_a = false,
      "[x @ dequantize(w).T for each weight] as one node (one width, group size and scale "
      "dtype); each output equals affine_matmul bit for bit.");
  m.attr("MAX_GATHER_PARTS") = loom_cpu::kMaxGatherParts;
  m.def(
      "gather_dense_matmul",
      [](const mlx::core::array& x,
         const mlx::core::array& indices,
         const std::vector<mlx::core::array>& weights,
         bool gated,
         const std::optional<mlx::core::array>& down,
         bool gelu) {
        return loom_cpu::gather_dense_matmul(x, indices, weights, gated, gelu, down);
      },
      "x"_a,
      "indices"_a,
      "weights"_a,
      "gated"_a = false,
      "down"_a = nb::none(),
      "gelu"_a = false,
      "Routed experts: for each (token, expert) pair of indices [..., k], x's row (one per "
      "token or per pair) @ w[expert].T for each stacked weight [experts, N, K]; outputs "
      "indices.shape + [N]. gated: silu(gate) * up as one output (float32 x); down: that "
      "hidden row @ down[expert].T in the same node; gelu (with gated): gelu_tanh(gate) * up "
      "instead (gelu_mul's arithmetic). Each product equals dense_matmul of the expert's rows "
      "bit for bit.");
  m.def(
      "gather_affine_matmul",
      [](const mlx::core::array& x,
         const mlx::core::array& indices,
         const std::vector<mlx::core::array>& weights,
         const std::vector<mlx::core::array>& scales,
         const std::vector<mlx::core::array>& biases,
         int bits,
         int group_size,
         bool int8_activations,
         bool gated,
         const std::optional<mlx::core::array>& down,
         const std::optional<mlx::core::array>& down_scales,
         const std::optional<mlx::core::array>& down_biases,
         bool gelu) {
        return loom_cpu::gather_affine_matmul(
            x, indices, weights, scales, biases, bits, group_size, int8_activations, gated, gelu,
            down, down_scales, down_biases);
      },
      "x"_a,
      "indices"_a,
      "weights"_a,
      "scales"_a,
      "biases"_a,
      "bits"_a,
      "group_size"_a,
      "int8_activations"_a = false,
      "gated"_a = false,
      "down"_a = nb::none(),
      "down_scales"_a = nb::none(),
      "down_biases"_a = nb::none(),
      "gelu"_a = false,
      "gather_dense_matmul for stacked MLX affine weights [experts, N, words] with scales and "
      "biases [experts, N, K / group_size]; each output equals affine_matmul of the expert's "
      "rows bit for bit.");
  m.def(
      "gated_delta",
      [](const mlx::core::array& q,
         const mlx::core::array& k,
         const mlx::core::array& v,
         const mlx::core::array& g,
         const mlx::core::array& beta,
         const mlx::core::array& state,
         const std::optional<mlx::core::array>& mask) {
        auto out = loom_cpu::gated_delta(q, k, v, g, beta, state, mask);
        return nb::make_tuple(out[0], out[1]);
      },
      "q"_a,
      "k"_a,
      "v"_a,
      "g"_a,
      "beta"_a,
      "state"_a,
      "mask"_a = nb::none(),
      "(y, state) of the gated delta rule over T steps as one node, all float32: q, k "
      "[B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv], state [B, Hv, Dv, Dk]; mask "
      "(bool [B, T]) keeps the state at its false steps (y is 0 there).");
  m.def(
      "conv_silu",
      [](const mlx::core::array& x, const mlx::core::array& weight) {
        return loom_cpu::conv_silu(x, weight);
      },
      "x"_a,
      "weight"_a,
      "silu of the depthwise causal convolution, float32: x [B, S + K - 1, C] (the K - 1 "
      "inputs before the chunk, then the chunk), weight [C, K] -> [B, S, C], taps summed in "
      "order.");
  m.def(
      "rms_norm",
      [](const mlx::core::array& x, const std::optional<mlx::core::array>& w, float eps) {
        return loom_cpu::rms_norm(x, w, eps);
      },
      "x"_a,
      "weight"_a = nb::none(),
      "eps"_a,
      "mx.fast.rms_norm(x, weight, eps) as one node; fp32 arithmetic.");
  m.def(
      "rope",
      [](const mlx::core::array& x,
         int dims,
         bool traditional,
         const mlx::core::array& inv_freq,
         float scale,
         const mlx::core::array& offsets) {
        return loom_cpu::rope(x, dims, traditional, inv_freq, scale, offsets);
      },
      "x"_a,
      "dims"_a,
      "traditional"_a,
      "inv_freq"_a,
      "scale"_a,
      "offsets"_a,
      "mx.fast.rope for x [..., L, D] with float32 inverse frequencies [dims / 2] and int32 "
      "offsets [1] or [batch]; fp32 arithmetic.");
  m.def(
      "silu_mul",
      [](const mlx::core::array& gate, const mlx::core::array& up) {
        return loom_cpu::silu_mul(gate, up);
      },
      "gate"_a,
      "up"_a,
      "silu(gate) * up for float32 arrays of one shape, as one node; equals MLX's own "
      "(compiled) evaluation bit for bit.");
  m.def(
      "gelu_mul",
      [](const mlx::core::array& gate, const mlx::core::array& up) {
        return loom_cpu::gelu_mul(gate, up);
      },
      "gate"_a,
      "up"_a,
      "gelu_approx(gate) * up (GeGLU) for float32 arrays of one shape, as one node; the tanh "
      "eight lanes at a time, within 2^-21 |gate * up| of MLX's evaluation.");
  m.def(
      "expert_mix",
      [](const mlx::core::array& y,
         const mlx::core::array& w,
         const std::optional<mlx::core::array>& shared,
         const std::optional<mlx::core::array>& shared_w) {
        return loom_cpu::expert_mix(y, w, shared, shared_w);
      },
      "y"_a,
      "w"_a,
      "shared"_a = nb::none(),
      "shared_w"_a = nb::none(),
      "sum over j of w[..., j] * y[..., j, :] for float32 y [..., k, D] and w [..., k], as one "
      "node; equals MLX's (y * w[..., None]).sum(axis=-2) bit for bit. With a shared expert's "
      "output [..., D] and its gate weight [..., 1], plus shared_w * shared, bit for bit.");
  m.def(
      "softcap",
      [](const mlx::core::array& x, float cap) { return loom_cpu::softcap(x, cap); },
      "x"_a,
      "cap"_a,
      "tanh(x / cap) * cap (a logit soft cap) for a float32 array and a finite cap > 0, as one "
      "node; gelu_mul's tanh, within 2^-21 * cap of MLX's evaluation.");
  m.def(
      "log_softmax",
      [](const mlx::core::array& x) { return loom_cpu::log_softmax(x); },
      "x"_a,
      "x - logsumexp(x, axis=-1, keepdims=True) for float32 x, as one node; equals MLX's own "
      "evaluation bit for bit.");
  m.def(
      "attention",
      [](const mlx::core::array& q,
         const mlx::core::array& k,
         const mlx::core::array& v,
         float scale,
         bool causal,
         const std::optional<mlx::core::array>& mask,
         const std::optional<mlx::core::array>& lengths) {
        return loom_cpu::attention(q, k, v, scale, causal, mask, lengths);
      },
      "q"_a,
      "k"_a,
      "v"_a,
      "scale"_a,
      "causal"_a = false,
      "mask"_a = nb::none(),
      "lengths"_a = nb::none(),
      "softmax(scale * q k^T + mask) v for q [B, Hq, L, D], k/v [B, Hkv, S, D]; an additive "
      "float32 mask broadcastable to [B, Hq, L, S]; lengths (int32 [1] or [B]): each batch "
      "row attends over its first lengths[b] keys; fp32 arithmetic.");
}

// Element-wise gate activations of GLU feed-forwards, AVX2/FMA code (built
// with activations_avx2.cpp's flags; called only after the CPU check).
#pragma once

#include <cstddef>

namespace loom_cpu {

// out[i] = gelu_tanh(gate[i]) * up[i] for i in [i0, i1), where gelu_tanh(x)
// = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), MLX's gelu_approx in
// its operation order. The tanh is computed eight lanes at a time from one
// exp, (1 - e) / (1 + e) with e = exp(-2|u|), not with the C library's
// tanhf (which MLX's CPU backend calls one element at a time), so the result
// is not bit-equal to MLX's: within 2^-21 |gate * up| of it (tested over a
// sweep of inputs; docs/cpu.md), NaN and infinities alike. out may alias
// gate or up.
void gelu_tanh_mul(const float* gate, const float* up, float* out, size_t i0, size_t i1);

// out[i] = tanh(x[i] / cap) * cap for i in [i0, i1): the logit soft cap
// (Gemma), MLX's operation order, the tanh the one gelu_tanh_mul uses. Not
// bit-equal to MLX's (the C library's tanhf): within 2^-21 * cap of it
// (tested over a sweep; docs/cpu.md), NaN and infinities alike. out may
// alias x.
void softcap(const float* x, float cap, float* out, size_t i0, size_t i1);

}  // namespace loom_cpu

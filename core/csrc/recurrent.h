// The gated delta rule's recurrence (Qwen3-Next / Qwen3.5 linear attention),
// AVX2/FMA code (built with recurrent_avx2.cpp's flags; called only after
// the CPU check).
#pragma once

namespace loom_cpu {

// One token's step for one value head: for every row i of the head's state
// s [Dv, Dk] (float32, updated in place),
//   s_i *= g;  delta = (v_i - s_i . k) * beta;  s_i += k * delta;  y_i = s_i . q
// -- mlx.fast.gated_delta_update's step, the state kept in float32. The dot
// products are summed eight lanes at a time with fused multiply-adds, so the
// results are not bit-equal to MLX's element-wise graph: within the bound
// the tests state (a few Dk units of rounding on each sum's magnitude).
void gated_delta_head_step(
    const float* q,
    const float* k,
    const float* v,
    float g,
    float beta,
    float* s,
    float* y,
    int Dv,
    int Dk);

}  // namespace loom_cpu

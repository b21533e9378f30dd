"""Per-backend kernels of the gated delta net and the routed experts.

Each kernel is registered once per backend; the core's kernel registry picks
the device's backend (or refuses). Signatures (all arrays ``mx.array``):

``qwen3_next.gated_delta(q, k, v, g, beta, state) -> (y, state)``
    The gated delta rule over ``T`` steps. ``q, k: [B, T, Hk, Dk]`` (already
    L2-normalised, readout scale folded into q), ``v: [B, T, Hv, Dv]``,
    ``g, beta: [B, T, Hv]``, ``state: [B, Hv, Dv, Dk]`` fp32. Per step:
    ``S = g*S; S += k (beta (v - S k))^T; y = S q``.
``qwen3_next.gated_delta_masked(q, k, v, g, beta, state, mask) -> (y, state)``
    The same with ``mask: [B, T]`` bool; masked steps leave the state unchanged
    (padded prefill). ``y`` at masked steps is unspecified (the cpu kernel
    writes 0); callers discard it.
``qwen3_next.gated_delta_replay(q, k, v, g, beta, state, mask=None) -> state``
    State-only replay of a kept prefix (speculative commit). Bit-identical to
    the state the two kernels above produce over the same inputs.
``qwen3_next.causal_conv_silu(x, tail, weight, ends=None) -> (y, new_tail)``
    Depthwise causal convolution of width ``K`` over ``tail ++ x`` followed by
    SiLU. ``x: [B, S, C]``, ``tail: [B, K-1, C]``, ``weight: [C, K, 1]``;
    ``new_tail`` is the ``K-1`` inputs ending at ``ends[b]`` (right padding) or
    at the end of ``x``.
``qwen3_next.expert_matmul(x, weight, indices, sorted_indices=False) -> y``
    ``y[..., e, :, :] = x @ weight[indices[..., e]].T`` for a dense stacked
    expert weight ``[E, out, in]`` (mlx-lm's ``SwitchLinear`` contract).

CPU evidence (mlx 0.32.4): ``mx.fast.gated_delta_update`` is bit-identical to
mlx-lm's ops recurrence for fp32 inputs, masked or not, in the state and in
``y`` at unmasked steps; it also gives the prefix state bit-identically when
the rest of the window is masked, which is what makes a per-row speculative
commit exact. For bf16 inputs it differs from mlx-lm's ops path by bf16
rounding (both keep the state in fp32).

``mx.gather_mm`` is fp32-only on the CPU, so the cpu ``expert_matmul`` keeps
``gather_mm`` for fp32 (bit-equal to mlx-lm) and, for bf16/fp16, computes the
same products from exactly upcast operands in fp32 and rounds the result once
to the input dtype (see :func:`expert_matmul_cpu`).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from mlx_loom.kernels import Kernel

__all__ = [
    "CAUSAL_CONV",
    "EXPERT_MATMUL",
    "GATED_DELTA",
    "GATED_DELTA_MASKED",
    "GATED_DELTA_REPLAY",
    "KERNEL_NAMES",
    "SUPPORTED_CONV_WIDTHS",
    "cpu_kernels",
    "metal_kernels",
]

GATED_DELTA = "qwen3_next.gated_delta"
GATED_DELTA_MASKED = "qwen3_next.gated_delta_masked"
GATED_DELTA_REPLAY = "qwen3_next.gated_delta_replay"
CAUSAL_CONV = "qwen3_next.causal_conv_silu"
EXPERT_MATMUL = "qwen3_next.expert_matmul"
KERNEL_NAMES: tuple[str, ...] = (
    GATED_DELTA,
    GATED_DELTA_MASKED,
    GATED_DELTA_REPLAY,
    CAUSAL_CONV,
    EXPERT_MATMUL,
)

#: Convolution widths both registrations implement (the Metal source unrolls
#: the taps with a compile-time K; Qwen3-Next and Qwen3.5 use 4).
SUPPORTED_CONV_WIDTHS: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8)

# --- cpu: plain MLX ops --------------------------------------------------------


def gated_delta_cpu(q, k, v, g, beta, state):
    y, state = mx.fast.gated_delta_update(q, k, v, g, beta, state)
    return y, state


def gated_delta_masked_cpu(q, k, v, g, beta, state, mask):
    y, state = mx.fast.gated_delta_update(q, k, v, g, beta, state, mask)
    return y, state


def gated_delta_replay_cpu(q, k, v, g, beta, state, mask=None):
    # The same fused recurrence as the forward; y is produced and dropped (it
    # costs one extra reduction per step, far less than a second code path
    # that might round differently).
    return mx.fast.gated_delta_update(q, k, v, g, beta, state, mask)[1]


def causal_conv_silu_cpu(x, tail, weight, ends=None):
    channels, width = weight.shape[0], tail.shape[1]
    conv_input = mx.concatenate([tail, x], axis=1)
    if ends is None:
        new_tail = mx.contiguous(conv_input[:, conv_input.shape[1] - width :])
    else:
        pos = (ends[:, None] + mx.arange(width))[..., None]
        new_tail = mx.take_along_axis(conv_input, pos, axis=1)
    # Same op as mlx-lm's nn.Conv1d(groups=C, padding=0, bias=False) + nn.silu.
    y = nn.silu(mx.conv1d(conv_input, weight, 1, 0, 1, channels))
    return y, new_tail


def expert_matmul_cpu(x, weight, indices, sorted_indices=False):
    """Routed-expert matmul on the CPU.

    fp32: ``mx.gather_mm`` exactly as mlx-lm's ``SwitchLinear`` (bit-equal).
    bf16/fp16 (``gather_mm`` is fp32-only here): operands are upcast to fp32
    (exact), multiplied with fp32 accumulation and the product is rounded once
    to the input dtype — the precision a bf16 ``gather_mm`` on a GPU delivers.
    Only the weights needed are upcast: when fewer (token, expert) pairs than
    experts are routed (decode), the routed experts' matrices are gathered
    first; otherwise every expert is upcast once and ``gather_mm`` runs in fp32.
    """
    if x.dtype == mx.float32 and weight.dtype == mx.float32:
        return mx.gather_mm(
            x, weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices
        )
    out_dtype = x.dtype
    x32 = x.astype(mx.float32)
    if indices.size < weight.shape[0]:
        w = weight[indices].astype(mx.float32)
        y = mx.matmul(x32, w.swapaxes(-1, -2))
    else:
        y = mx.gather_mm(
            x32,
            weight.astype(mx.float32).swapaxes(-1, -2),
            rhs_indices=indices,
            sorted_indices=sorted_indices,
        )
    return y.astype(out_dtype)


def cpu_kernels() -> list[Kernel]:
    return [
        Kernel(
            GATED_DELTA,
            "cpu",
            gated_delta_cpu,
            description="mx.fast.gated_delta_update (bit-equal to mlx-lm's ops path, fp32)",
        ),
        Kernel(
            GATED_DELTA_MASKED,
            "cpu",
            gated_delta_masked_cpu,
            description="mx.fast.gated_delta_update with a [B, T] step mask",
        ),
        Kernel(
            GATED_DELTA_REPLAY,
            "cpu",
            gated_delta_replay_cpu,
            description="state-only prefix replay via mx.fast.gated_delta_update",
        ),
        Kernel(
            CAUSAL_CONV,
            "cpu",
            causal_conv_silu_cpu,
            description="mx.conv1d (depthwise) + SiLU + tail slice",
        ),
        Kernel(
            EXPERT_MATMUL,
            "cpu",
            expert_matmul_cpu,
            description="gather_mm in fp32; bf16/fp16 upcast to fp32, one rounding",
        ),
    ]


# --- metal: mx.fast.metal_kernel sources (constructed here, run only on Metal) ---

# One thread owns one (batch, value head, value row) of the state and walks the
# T steps, keeping its Dk state entries in registers. MASKED adds the padding
# mask; STATE_ONLY skips y (prefix replay).
_GATED_DELTA_SOURCE = """
    uint dv_idx = thread_position_in_grid.x;
    uint n = thread_position_in_grid.y;          // b * Hv + hv
    if (dv_idx >= Dv) return;
    uint b_idx = n / Hv;
    uint hv_idx = n % Hv;
    uint hk_idx = hv_idx / (Hv / Hk);

    float s[Dk];
    const device StT* s_in = state_in + (n * Dv + dv_idx) * Dk;
    for (int i = 0; i < Dk; ++i) s[i] = static_cast<float>(s_in[i]);

    for (int t = 0; t < T; ++t) {
      uint qk_off = ((b_idx * T + t) * Hk + hk_idx) * Dk;
      uint v_off = ((b_idx * T + t) * Hv + hv_idx) * Dv + dv_idx;
      uint gb_off = (b_idx * T + t) * Hv + hv_idx;
      bool live = MASK_EXPR;
      float out = 0.0f;
      if (live) {
        float gt = static_cast<float>(g[gb_off]);
        float kv = 0.0f;
        for (int i = 0; i < Dk; ++i) {
          s[i] *= gt;
          kv += s[i] * static_cast<float>(k[qk_off + i]);
        }
        float delta = (static_cast<float>(v[v_off]) - kv) * static_cast<float>(beta[gb_off]);
        for (int i = 0; i < Dk; ++i) {
          s[i] += static_cast<float>(k[qk_off + i]) * delta;
          out += s[i] * static_cast<float>(q[qk_off + i]);
        }
      }
      WRITE_Y
    }
    device StT* s_out = state_out + (n * Dv + dv_idx) * Dk;
    for (int i = 0; i < Dk; ++i) s_out[i] = static_cast<StT>(s[i]);
"""

# One thread per (batch, channel): K taps over tail ++ x, SiLU, then the tail.
_CAUSAL_CONV_SOURCE = """
    uint c = thread_position_in_grid.x;
    uint b = thread_position_in_grid.y;
    if (c >= C) return;
    constexpr int W = K - 1;
    int total = W + S;
    // input row r of tail ++ x
    #define IN(r) ((r) < W ? static_cast<float>(tail[(b * W + (r)) * C + c]) \\
                           : static_cast<float>(x[(b * S + (r) - W) * C + c]))
    for (int t = 0; t < S; ++t) {
      float acc = 0.0f;
      for (int j = 0; j < K; ++j) acc += static_cast<float>(weight[c * K + j]) * IN(t + j);
      float act = acc / (1.0f + metal::exp(-acc));
      y[(b * S + t) * C + c] = static_cast<InT>(act);
    }
    int end = END_EXPR;
    for (int j = 0; j < W; ++j) {
      int r = end + j;
      new_tail[(b * W + j) * C + c] = r < total ? static_cast<InT>(IN(r)) : static_cast<InT>(0);
    }
    #undef IN
"""


def _gated_delta_metal_source(*, masked: bool, state_only: bool) -> str:
    src = _GATED_DELTA_SOURCE.replace("MASK_EXPR", "mask[b_idx * T + t]" if masked else "true")
    write = "" if state_only else "y[v_off] = static_cast<InT>(out);"
    return src.replace("WRITE_Y", write)


def _metal_gated_delta(*, masked: bool, state_only: bool) -> tuple[Callable[..., object], str]:
    """A wrapper over the Metal kernel(s); the replay builds a masked and an unmasked variant."""
    variants = (False, True) if state_only else (masked,)
    kernels = {
        m: mx.fast.metal_kernel(
            name=f"qwen3_next_gated_delta{'_masked' if m else ''}{'_replay' if state_only else ''}",
            input_names=["q", "k", "v", "g", "beta", "state_in"] + (["mask"] if m else []),
            output_names=["state_out"] if state_only else ["y", "state_out"],
            source=_gated_delta_metal_source(masked=m, state_only=state_only),
        )
        for m in variants
    }

    def run(q, k, v, g, beta, state, mask=None):
        B, T, Hk, Dk = k.shape
        Hv, Dv = v.shape[2:]
        use_mask = masked or mask is not None
        inputs = [q, k, v, g, beta, state] + ([mask] if use_mask else [])
        shapes = [state.shape] if state_only else [(B, T, Hv, Dv), state.shape]
        dtypes = [state.dtype] if state_only else [q.dtype, state.dtype]
        out = kernels[use_mask](
            inputs=inputs,
            template=[
                ("InT", q.dtype),
                ("StT", state.dtype),
                ("T", T),
                ("Dk", Dk),
                ("Dv", Dv),
                ("Hk", Hk),
                ("Hv", Hv),
            ],
            grid=(Dv, B * Hv, 1),
            threadgroup=(min(Dv, 32), 1, 1),
            output_shapes=shapes,
            output_dtypes=dtypes,
        )
        return out[0] if state_only else (out[0], out[1])

    return run, _gated_delta_metal_source(masked=masked, state_only=state_only)


def _metal_causal_conv() -> tuple[Callable[..., object], str]:
    kernels = {
        has_ends: mx.fast.metal_kernel(
            name=f"qwen3_next_causal_conv_silu{'_ends' if has_ends else ''}",
            input_names=["x", "tail", "weight"] + (["ends"] if has_ends else []),
            output_names=["y", "new_tail"],
            source=_CAUSAL_CONV_SOURCE.replace("END_EXPR", "ends[b]" if has_ends else "S"),
        )
        for has_ends in (False, True)
    }

    def run(x, tail, weight, ends=None):
        B, S, C = x.shape
        K = weight.shape[1]
        inputs = [x, tail, weight.reshape(C, K)] + ([ends] if ends is not None else [])
        y, new_tail = kernels[ends is not None](
            inputs=inputs,
            template=[("InT", x.dtype), ("C", C), ("K", K), ("S", S)],
            grid=(C, B, 1),
            threadgroup=(min(C, 256), 1, 1),
            output_shapes=[(B, S, C), (B, K - 1, C)],
            output_dtypes=[x.dtype, x.dtype],
        )
        return y, new_tail

    return run, _CAUSAL_CONV_SOURCE


def _expert_matmul_metal(x, weight, indices, sorted_indices=False):
    # gather_mm runs natively on Metal in every float dtype.
    return mx.gather_mm(
        x, weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices
    )


def metal_kernels() -> list[Kernel]:
    """Metal registrations. Constructing them needs no GPU; calling them does."""
    out = []
    for name, masked, state_only in (
        (GATED_DELTA, False, False),
        (GATED_DELTA_MASKED, True, False),
        (GATED_DELTA_REPLAY, False, True),
    ):
        fn, source = _metal_gated_delta(masked=masked, state_only=state_only)
        out.append(
            Kernel(
                name,
                "metal",
                fn,
                source=source,
                description="one thread per state row, Dk entries in registers",
            )
        )
    fn, source = _metal_causal_conv()
    out.append(
        Kernel(
            CAUSAL_CONV,
            "metal",
            fn,
            source=source,
            description="one thread per (row, channel): taps, SiLU, tail",
        )
    )
    out.append(
        Kernel(
            EXPERT_MATMUL,
            "metal",
            _expert_matmul_metal,
            description="mx.gather_mm (native on Metal in every float dtype)",
        )
    )
    return out

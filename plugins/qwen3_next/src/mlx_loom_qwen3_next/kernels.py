"""Per-backend kernels of the gated delta net, and the routed-expert kernel.

Each kernel is registered once per backend; the core's kernel registry picks
the device's backend (or refuses). Signatures (all arrays ``mx.array``):

``qwen3_next.gated_delta(q, k, v, g, beta, state) -> (y, state)``
    The gated delta rule over ``T`` steps. ``q, k: [B, T, Hk, Dk]`` (already
    L2-normalised, readout scale folded into q), ``v: [B, T, Hv, Dv]``,
    ``g, beta: [B, T, Hv]``, ``state: [B, Hv, Dv, Dk]`` fp32. Per step:
    ``S = g*S; S += k (beta (v - S k))^T; y = S q``.
``qwen3_next.gated_delta_masked(q, k, v, g, beta, state, mask) -> (y, state)``
    The same with ``mask: [B, T]`` bool; masked steps leave the state unchanged
    (padded prefill). ``y`` at masked steps is unspecified; callers discard it.
``qwen3_next.gated_delta_replay(q, k, v, g, beta, state, mask=None, lengths=None) -> state``
    State-only replay of a kept prefix (speculative commit): the forward's
    state statements over each row's first ``lengths[b]`` steps (all ``T``
    when ``None``), so its state is the forward's over the kept tokens, bit
    for bit. ``mask`` is the verify forward's padding, as above.
``qwen3_next.causal_conv_silu(x, tail, weight, ends=None) -> (y, new_tail)``
    Depthwise causal convolution of width ``K`` over ``tail ++ x`` followed by
    SiLU. ``x: [B, S, C]``, ``tail: [B, K-1, C]``, ``weight: [C, K, 1]``;
    ``new_tail`` is the ``K-1`` inputs ending at ``ends[b]`` (right padding) or
    at the end of ``x``.
``qwen3_next.switch_glu(x, indices, gate, up, down, activation) -> y``
    The routed-expert GLU (:mod:`mlx_loom.nn.experts`, one bf16-on-CPU
    strategy shared with Gemma 4).

Backends, honestly:

* ``cpu`` and ``cuda`` — MLX ops, which run on every MLX backend:
  ``mx.fast.gated_delta_update`` (an MLX op with an ops fallback wherever no
  native kernel exists; on the CPU it is bit-identical to mlx-lm's ops
  recurrence for fp32 inputs, masked or not, and gives the prefix state
  bit-identically when the rest of the window is masked, which is what makes
  a per-row speculative commit exact; for bf16 it differs from mlx-lm's ops
  path by bf16 rounding, both keeping the state in fp32), ``mx.conv1d`` +
  ``nn.silu``, and the shared expert GLU.
* ``metal`` — the gated delta rule in mlx-lm's Metal arithmetic, one family
  per geometry for *every* path (:func:`gated_delta_family`): mlx-lm's packed
  Dk = 128 kernel (eight value rows per SIMD-group, an explicit butterfly
  sum) for every real Qwen3-Next / Qwen3.5 geometry, its simd_sum kernel for
  other key dims that are multiples of 32, its ops recurrence for the rest.
  mlx-lm itself runs padded prefill on the simd_sum kernel even where its
  forward is packed, and the two sum in different orders; here the padded
  forward and the state-only replay are derived from the forward's own
  template (same state statements, same order), so a padded row equals the
  row alone and a replayed prefix equals the forward over it. The unmasked
  forward is mlx-lm's kernel statement for statement with mlx-lm's grid,
  so Metal logits can be bit-equal to mlx-lm's solo path. The causal conv is
  one fused kernel that rounds exactly where ``mx.conv1d`` + ``nn.silu`` round
  (fp32 tap accumulation rounded to the input dtype, then MLX's sigmoid and
  product in the input dtype); :func:`causal_conv_silu_emulated` reproduces
  those rounding steps with ops and is tested against the ops path bit for
  bit. These sources are constructed here and checked structurally against
  their references; they only run on a Metal device.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_loom.nn import expert_kernels
from mlx_loom.plugin import Kernel

__all__ = [
    "CAUSAL_CONV",
    "GATED_DELTA",
    "GATED_DELTA_MASKED",
    "GATED_DELTA_REPLAY",
    "KERNEL_NAMES",
    "SUPPORTED_CONV_WIDTHS",
    "SWITCH_GLU",
    "causal_conv_silu_emulated",
    "causal_conv_silu_ops",
    "gated_delta_family",
    "gated_delta_metal_sources",
    "gated_delta_steps",
    "kernels",
    "metal_kernels",
    "native_cpu_kernels",
    "ops_kernels",
]

GATED_DELTA = "qwen3_next.gated_delta"
GATED_DELTA_MASKED = "qwen3_next.gated_delta_masked"
GATED_DELTA_REPLAY = "qwen3_next.gated_delta_replay"
CAUSAL_CONV = "qwen3_next.causal_conv_silu"
SWITCH_GLU = "qwen3_next.switch_glu"
KERNEL_NAMES: tuple[str, ...] = (
    GATED_DELTA,
    GATED_DELTA_MASKED,
    GATED_DELTA_REPLAY,
    CAUSAL_CONV,
    SWITCH_GLU,
)

#: Convolution widths every registration implements (the Metal source unrolls
#: the taps with a compile-time K; Qwen3-Next and Qwen3.5 use 4).
SUPPORTED_CONV_WIDTHS: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8)

# --- MLX ops (cpu and cuda) ------------------------------------------------------


def gated_delta_ops(q, k, v, g, beta, state):
    y, state = mx.fast.gated_delta_update(q, k, v, g, beta, state)
    return y, state


def gated_delta_masked_ops(q, k, v, g, beta, state, mask):
    y, state = mx.fast.gated_delta_update(q, k, v, g, beta, state, mask)
    return y, state


def gated_delta_replay_ops(q, k, v, g, beta, state, mask=None, lengths=None):
    # The same fused recurrence as the forward; y is produced and dropped (it
    # costs one extra reduction per step, far less than a second code path
    # that might round differently). Steps after a row's kept length are
    # masked: the op keeps the state there, and gives the prefix state bit for
    # bit (tested), so this is the forward's state over the kept tokens.
    if lengths is not None:
        kept = mx.arange(q.shape[1])[None] < lengths[:, None]
        mask = kept if mask is None else mask & kept
    return mx.fast.gated_delta_update(q, k, v, g, beta, state, mask)[1]


def _conv_input(x: mx.array, tail: mx.array, ends: mx.array | None):
    width = tail.shape[1]
    conv_input = mx.concatenate([tail, x], axis=1)
    if ends is None:
        new_tail = mx.contiguous(conv_input[:, conv_input.shape[1] - width :])
    else:
        pos = (ends[:, None] + mx.arange(width))[..., None]
        new_tail = mx.take_along_axis(conv_input, pos, axis=1)
    return conv_input, new_tail


def causal_conv_silu_ops(x, tail, weight, ends=None):
    conv_input, new_tail = _conv_input(x, tail, ends)
    # Same ops as mlx-lm's nn.Conv1d(groups=C, padding=0, bias=False) + nn.silu.
    y = nn.silu(mx.conv1d(conv_input, weight, 1, 0, 1, weight.shape[0]))
    return y, new_tail


def causal_conv_silu_emulated(x, tail, weight, ends=None):
    """The Metal conv kernel's arithmetic, step for step, in ops (a test oracle).

    Per output: taps accumulated in fp32 from 0 in tap order (MLX's depthwise
    ``conv1d`` does the same on the CPU and on Metal), rounded once to the
    input dtype; then ``sigmoid`` of that rounded value and the product, each
    in the input dtype — the rounding points of ``nn.silu`` on a ``conv1d``
    output. Bit-equal to :func:`causal_conv_silu_ops` for bf16, fp16 and
    fp32 (tested); an fp32 SiLU of the unrounded sum is not.
    """
    conv_input, new_tail = _conv_input(x, tail, ends)
    S, K = x.shape[1], weight.shape[1]
    acc = mx.zeros(x.shape, dtype=mx.float32)
    for j in range(K):
        acc = acc + conv_input[:, j : j + S].astype(mx.float32) * weight[:, j, 0].astype(mx.float32)
    conv = acc.astype(x.dtype)
    return conv * mx.sigmoid(conv), new_tail


def ops_kernels() -> list[Kernel]:
    """The MLX-ops registrations: every one for ``cpu`` and for ``cuda``."""
    every = " (MLX ops: runs on every backend; registered for cpu and cuda)"
    table: list[tuple[str, Callable[..., object], str]] = [
        (
            GATED_DELTA,
            gated_delta_ops,
            "mx.fast.gated_delta_update (bit-equal to mlx-lm's ops path on the CPU, fp32)",
        ),
        (GATED_DELTA_MASKED, gated_delta_masked_ops, "mx.fast.gated_delta_update, [B, T] mask"),
        (GATED_DELTA_REPLAY, gated_delta_replay_ops, "state-only replay of the forward op"),
        (CAUSAL_CONV, causal_conv_silu_ops, "mx.conv1d (depthwise) + SiLU + tail slice"),
    ]
    out = [
        Kernel(name, backend, fn, description=what + every)
        for name, fn, what in table
        for backend in ("cpu", "cuda")
    ]
    return out + [k for k in expert_kernels(SWITCH_GLU) if k.backend in ("cpu", "cuda")]


# --- the core's native CPU kernel sets -------------------------------------------


def native_cpu_kernels(
    native: ModuleType, ops: dict[str, Callable[..., Any]]
) -> dict[str, Callable[..., Any]]:
    """The recurrence and the causal conv on the core's native CPU extension
    (:class:`~.graph.Kernels` fields).

    What the native kernel sets (``cpu-native``, ``cpu-native-int8-act``) run
    instead of ``mx.fast.gated_delta_update``, whose CPU form is ~10 MLX
    operations per token (about a third of a 512-token prefill's CPU time on
    the Qwen3-Next-shaped benchmark row). ``native.gated_delta`` is one node
    for all ``T`` steps, fp32 throughout (the state is fp32 either way): the
    same statements per step, each dot product summed in eight fixed lanes,
    so not mlx-lm's bits but within fp32 rounding of them (tested). Every
    (row, head) is computed on its own and masked steps leave the state as
    it was, so a padded row equals the row alone and the replay below
    equals the forward's state over the kept steps, bit for bit (tested).
    Half-precision activations (``compute_dtype="checkpoint"`` on a bf16
    checkpoint) keep ``ops``, the kernels the graph had, as the conv does:
    their rounding points are MLX's. The compute dtype is fixed per model,
    so the forward, the padded forward and the replay always agree.
    """

    def run(q, k, v, g, beta, state, mask):
        f32 = [a.astype(mx.float32) for a in (k, v, g, beta, state)]
        return native.gated_delta(q, *f32, mask)

    def native_fp32(q) -> bool:
        return q.dtype == mx.float32

    def forward(q, k, v, g, beta, state):
        if not native_fp32(q):
            return ops["gated_delta"](q, k, v, g, beta, state)
        return run(q, k, v, g, beta, state, None)

    def masked(q, k, v, g, beta, state, mask):
        if not native_fp32(q):
            return ops["gated_delta_masked"](q, k, v, g, beta, state, mask)
        return run(q, k, v, g, beta, state, mask)

    def replay(q, k, v, g, beta, state, mask=None, lengths=None):
        if not native_fp32(q):
            return ops["gated_delta_replay"](q, k, v, g, beta, state, mask=mask, lengths=lengths)
        if lengths is not None:
            kept = mx.arange(q.shape[1])[None] < lengths[:, None]
            mask = kept if mask is None else mask & kept
        return run(q, k, v, g, beta, state, mask)[1]

    def causal_conv(x, tail, weight, ends=None):
        # MLX's depthwise conv1d on the CPU costs ~170 ms per layer at 2048
        # tokens of 2048 channels; the native node sums the same taps in the
        # same order, then SiLU in fp32 (not nn.silu's rounding: ~1 ulp).
        # Half-precision activations keep MLX's ops and their rounding points.
        if x.dtype != mx.float32 or weight.dtype != mx.float32:
            return causal_conv_silu_ops(x, tail, weight, ends)
        conv_input, new_tail = _conv_input(x, tail, ends)
        return native.conv_silu(conv_input, weight.reshape(weight.shape[0], -1)), new_tail

    return {
        "gated_delta": forward,
        "gated_delta_masked": masked,
        "gated_delta_replay": replay,
        "causal_conv": causal_conv,
    }


# --- the ops recurrence mlx-lm runs where it has no kernel ------------------------


@mx.compile
def _delta_step(q, k, v, g, beta, state):
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y.astype(q.dtype), state


@mx.compile
def _delta_step_masked(q, k, v, g, beta, state, live):
    before = state
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    state = mx.where(mx.expand_dims(live, axis=(1, 2, 3)), state, before)
    return y.astype(q.dtype), state


def gated_delta_steps(q, k, v, g, beta, state, mask=None):
    """The recurrence one step at a time in compiled ops: mlx-lm's ``gated_delta_ops``.

    The same op order per step (decay, key read-out, delta, rank-one update,
    query read-out; masked steps keep the old state), so it gives mlx-lm's
    bits on any device; the Metal registration uses it where mlx-lm does
    (key dims that are not a multiple of 32).
    """
    groups = v.shape[2] // k.shape[2]
    if groups > 1:
        q, k = mx.repeat(q, groups, -2), mx.repeat(k, groups, -2)
    ys = []
    for t in range(q.shape[1]):
        if mask is None:
            y, state = _delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        else:
            y, state = _delta_step_masked(
                q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, mask[:, t]
            )
        ys.append(y)
    return mx.stack(ys, axis=1), state


# --- metal: mx.fast.metal_kernel sources (constructed here, run only on Metal) ----

# The recurrence's Metal sources are written once per arithmetic as a
# *template*, and every path derives its source from it: the forward, the
# padded (masked) forward and the state-only replay. A line tagged ``@out``
# exists only to produce ``y`` (the replay drops it); a line tagged ``@mask``
# exists only in the masked variants (padded prefill, and a replay whose verify
# forward was padded). ``MASK_EXPR`` is the step's validity, ``STEPS`` how many
# steps run: ``T`` for a forward, ``lengths[batch]`` (the row's kept tokens)
# for a replay. So the state statements of the three paths are the same text,
# in the same order, on the same operands: one arithmetic per family, which is
# what makes a padded row equal the row alone and a replayed prefix equal the
# forward over it (tested on the derived sources, since no GPU runs here).

# One SIMD-group of 32 lanes per (row, value head, value row); each lane keeps
# Dk / 32 interleaved state entries in registers and the two dot products are
# reduced with simd_sum. Statement for statement the computation of mlx-lm's
# scalar-gate kernel (its unmasked one writes ``if (true)``).
_SIMD_TEMPLATE = """
    auto row = thread_position_in_grid.z;
    auto batch = row / Hv;
    auto vhead = row % Hv;
    auto khead = vhead / (Hv / Hk);
    constexpr int per_lane = Dk / 32;

    // q, k: [B, T, Hk, Dk] for this batch row and key head
    auto qp = q + batch * T * Hk * Dk + khead * Dk;  // @out
    auto kp = k + batch * T * Hk * Dk + khead * Dk;

    // v, y: [B, T, Hv, Dv] for this batch row and value head
    auto vp = v + batch * T * Hv * Dv + vhead * Dv;
    y += batch * T * Hv * Dv + vhead * Dv;  // @out

    auto lane = thread_position_in_threadgroup.x;
    auto vrow = thread_position_in_grid.y;

    // state: [B, Hv, Dv, Dk]; this SIMD-group owns one Dv row
    auto src = state_in + (row * Dv + vrow) * Dk;
    auto dst = state_out + (row * Dv + vrow) * Dk;

    float acc[per_lane];
    for (int j = 0; j < per_lane; ++j) {
      auto idx = per_lane * lane + j;
      acc[j] = static_cast<float>(src[idx]);
    }

    // g, beta: [B, T, Hv]
    auto gp = g + batch * T * Hv;
    auto bp = beta + batch * T * Hv;

    for (int step = 0; step < STEPS; ++step) {
      if (MASK_EXPR) {
        float kv = 0.0f;
        for (int j = 0; j < per_lane; ++j) {
          auto idx = per_lane * lane + j;
          acc[j] = acc[j] * gp[vhead];
          kv += acc[j] * kp[idx];
        }
        kv = simd_sum(kv);

        auto d = (vp[vrow] - kv) * bp[vhead];

        float o = 0.0f;  // @out
        for (int j = 0; j < per_lane; ++j) {
          auto idx = per_lane * lane + j;
          acc[j] = acc[j] + kp[idx] * d;
          o += acc[j] * qp[idx];  // @out
        }
        o = simd_sum(o);  // @out
        if (thread_index_in_simdgroup == 0) {  // @out
          y[vrow] = static_cast<InT>(o);  // @out
        }  // @out
      } else {  // @out
        y[vrow] = static_cast<InT>(0);  // @out
      }
      // advance every pointer to the next step
      qp += Hk * Dk;  // @out
      kp += Hk * Dk;
      vp += Hv * Dv;
      y += Hv * Dv;  // @out
      gp += Hv;
      bp += Hv;
    }
    for (int j = 0; j < per_lane; ++j) {
      auto idx = per_lane * lane + j;
      dst[idx] = static_cast<StT>(acc[j]);
    }
"""

# Dk = 128, scalar gate: eight value rows per SIMD-group, four lanes per row,
# each lane holding 32 contiguous state entries. The sums are the explicit
# butterfly mlx-lm's packed kernel writes (in-lane pairwise tree over eight
# 4-element chains, then xor-1 and xor-2 shuffles within the row group);
# without the ``@mask`` lines it is mlx-lm's packed kernel statement for
# statement. mlx-lm runs it only unmasked and falls back to the simd_sum
# kernel for padded prefill, whose sum is ordered differently; here the padded
# forward and the replay keep this arithmetic.
_PACKED_TEMPLATE = """
    constexpr int lanes_per_row = 4;
    constexpr int rows_per_group = 32 / lanes_per_row;
    constexpr int per_lane = Dk / lanes_per_row;
    constexpr int chains = per_lane / 4;

    auto row = thread_position_in_grid.z;
    auto batch = row / Hv;
    auto vhead = row % Hv;
    auto khead = vhead / (Hv / Hk);

    auto simd_lane = thread_index_in_simdgroup;
    auto row_in_group = simd_lane / lanes_per_row;
    auto part = simd_lane & (lanes_per_row - 1);
    auto group = thread_position_in_grid.y;
    auto vrow = group * rows_per_group + row_in_group;

    // q, k: [B, T, Hk, Dk]; this lane's contiguous quarter of the key dims
    auto qp = q + (batch * T * Hk + khead) * Dk + part * per_lane;  // @out
    auto kp = k + (batch * T * Hk + khead) * Dk + part * per_lane;

    // v, y: [B, T, Hv, Dv]
    auto vp = v + (batch * T * Hv + vhead) * Dv;
    y += (batch * T * Hv + vhead) * Dv;  // @out

    // state: [B, Hv, Dv, Dk]
    auto src = state_in + (row * Dv + vrow) * Dk + part * per_lane;
    auto dst = state_out + (row * Dv + vrow) * Dk + part * per_lane;

    float acc[per_lane];
    for (int j = 0; j < per_lane; ++j) {
      acc[j] = static_cast<float>(src[j]);
    }

    // g, beta: [B, T, Hv]
    auto gp = g + batch * T * Hv;
    auto bp = beta + batch * T * Hv;

    for (int step = 0; step < STEPS; ++step) {
      if (MASK_EXPR) {  // @mask
      float decay = static_cast<float>(gp[vhead]);

      float sums[chains];
      for (int c = 0; c < chains; ++c) {
        float s = 0.0f;
        for (int j = 0; j < 4; ++j) {
          int e = c * 4 + j;
          acc[e] = acc[e] * decay;
          s += acc[e] * static_cast<float>(kp[e]);
        }
        sums[c] = s;
      }
      float kv =
          ((sums[0] + sums[1]) + (sums[2] + sums[3])) +
          ((sums[4] + sums[5]) + (sums[6] + sums[7]));
      kv += simd_shuffle_xor(kv, 1);
      kv += simd_shuffle_xor(kv, 2);

      auto d =
          (static_cast<float>(vp[vrow]) - kv) *
          static_cast<float>(bp[vhead]);

      for (int c = 0; c < chains; ++c) {
        float s = 0.0f;  // @out
        for (int j = 0; j < 4; ++j) {
          int e = c * 4 + j;
          acc[e] = acc[e] + static_cast<float>(kp[e]) * d;
          s += acc[e] * static_cast<float>(qp[e]);  // @out
        }
        sums[c] = s;  // @out
      }
      float o =  // @out
          ((sums[0] + sums[1]) + (sums[2] + sums[3])) +  // @out
          ((sums[4] + sums[5]) + (sums[6] + sums[7]));  // @out
      o += simd_shuffle_xor(o, 1);  // @out
      o += simd_shuffle_xor(o, 2);  // @out
      if (part == 0) {  // @out
        y[vrow] = static_cast<InT>(o);  // @out
      }  // @out
      } else {  // @mask @out
        y[vrow] = static_cast<InT>(0);  // @mask @out
      }  // @mask

      qp += Hk * Dk;  // @out
      kp += Hk * Dk;
      vp += Hv * Dv;
      y += Hv * Dv;  // @out
      gp += Hv;
      bp += Hv;
    }

    for (int j = 0; j < per_lane; ++j) {
      dst[j] = static_cast<StT>(acc[j]);
    }
"""

_TAGS = re.compile(r"\s*//((?:\s*@\w+)+)\s*$")


def _derive(template: str, *, masked: bool, replay: bool) -> str:
    """One path's source from a family's template (see the tags above)."""
    lines = []
    for line in template.split("\n"):
        tagged = _TAGS.search(line)
        tags = set(tagged.group(1).split()) if tagged else set()
        if ("@out" in tags and replay) or ("@mask" in tags and not masked):
            continue
        lines.append(line[: tagged.start()] if tagged else line)
    source = "\n".join(lines)
    source = source.replace("MASK_EXPR", "mask[batch * T + step]" if masked else "true")
    return source.replace("STEPS", "lengths[batch]" if replay else "T")


#: The Metal arithmetic families of the recurrence, by name.
_TEMPLATES = {"simd": _SIMD_TEMPLATE, "packed": _PACKED_TEMPLATE}

#: MLX's Metal ``Sigmoid`` functor applied to the rounded conv output ``conv``
#: (``auto y = 1 / (1 + metal::precise::exp(metal::abs(x))); return (x < 0) ? y
#: : 1 - y;`` with ``T = InT``): the same expression types, so the same roundings.
_SIGMOID_OF_CONV = """
      auto e = 1 / (1 + metal::precise::exp(metal::abs(conv)));
      InT sig = (conv < 0) ? e : 1 - e;
"""

# One thread per (row, channel): the K taps over tail ++ x accumulated in fp32
# as MLX's depthwise_conv_1d does, rounded to InT like conv1d's output, SiLU
# with MLX's sigmoid and product in InT (nn.silu's rounding), then the tail.
_CAUSAL_CONV_SOURCE = (
    """
    uint c = thread_position_in_grid.x;
    uint b = thread_position_in_grid.y;
    if (c >= C) return;
    constexpr int W = K - 1;
    int total = W + S;
    // input row r of tail ++ x
    #define IN(r) ((r) < W ? tail[(b * W + (r)) * C + c] : x[(b * S + (r) - W) * C + c])
    for (int t = 0; t < S; ++t) {
      float acc = 0.0f;
      for (int j = 0; j < K; ++j) acc += static_cast<float>(IN(t + j)) * weight[c * K + j];
      InT conv = static_cast<InT>(acc);
"""
    + _SIGMOID_OF_CONV
    + """
      y[(b * S + t) * C + c] = static_cast<InT>(conv * sig);
    }
    int end = END_EXPR;
    for (int j = 0; j < W; ++j) {
      int r = end + j;
      new_tail[(b * W + j) * C + c] = r < total ? static_cast<InT>(IN(r)) : static_cast<InT>(0);
    }
    #undef IN
"""
)

_DELTA_INPUTS = ["q", "k", "v", "g", "beta", "state_in", "T"]
# The replay reads no query and writes no output: only the state.
_REPLAY_INPUTS = ["k", "v", "g", "beta", "state_in", "T"]

#: Every Metal path of the recurrence: (path, masked).
_PATHS: tuple[tuple[str, bool], ...] = (
    ("forward", False),
    ("masked", True),
    ("replay", False),
    ("replay_masked", True),
)


def gated_delta_metal_sources() -> dict[str, dict[str, str]]:
    """The Metal sources of the recurrence: ``{family: {path: source}}``.

    Families ``simd`` and ``packed`` (see :func:`gated_delta_family`); paths
    ``forward`` (mlx-lm's kernel), ``masked`` (padded prefill), ``replay`` and
    ``replay_masked`` (state only, each row stopping at its kept length).
    """
    return {
        family: {
            path: _derive(template, masked=masked, replay=path.startswith("replay"))
            for path, masked in _PATHS
        }
        for family, template in _TEMPLATES.items()
    }


def gated_delta_family(Dk: int, Dv: int, g_dtype: mx.Dtype, state_dtype: mx.Dtype) -> str:
    """Which arithmetic runs the recurrence on Metal for this geometry: one for every path.

    ``ops`` where mlx-lm runs ops (key dims not a multiple of 32), ``packed``
    where mlx-lm's dispatch picks its packed kernel for an unmasked call
    (Dk = 128, Dv a multiple of 8, fp32 gate and state: every real Qwen3-Next
    and Qwen3.5 geometry), ``simd`` otherwise. The choice depends on the
    geometry only, never on whether a call is masked or a replay, so solo
    prefill, decode, padded batch prefill and speculative replay sum in one
    order. (mlx-lm's own dispatch sends masked calls to the simd kernel, so
    its padded batch prefill differs from its solo prefill there.)
    """
    if Dk < 32 or Dk % 32:
        return "ops"
    if Dk == 128 and Dv % 8 == 0 and g_dtype == mx.float32 and state_dtype == mx.float32:
        return "packed"
    return "simd"


#: Launch geometry per family: (value rows per SIMD-group, threadgroup).
_LAUNCH: dict[str, tuple[int, tuple[int, int, int]]] = {
    "simd": (1, (32, 4, 1)),
    "packed": (8, (32, 2, 1)),
}


class _MetalGatedDelta:
    """The recurrence on Metal: one family's kernels for the forward, padded and replay paths."""

    def __init__(self) -> None:
        sources = gated_delta_metal_sources()
        self.kernels: dict[tuple[str, str], object] = {}
        for family, paths in sources.items():
            for path, masked in _PATHS:
                replay = path.startswith("replay")
                inputs = (_REPLAY_INPUTS if replay else _DELTA_INPUTS) + (
                    ["mask"] if masked else []
                )
                self.kernels[family, path] = mx.fast.metal_kernel(
                    name=f"qwen3_next_gated_delta_{family}_{path}",
                    input_names=inputs + (["lengths"] if replay else []),
                    output_names=["state_out"] if replay else ["y", "state_out"],
                    source=paths[path],
                )

    def _launch(self, family: str, path: str, inputs: list, k, v, state, **out):
        B, T, Hk, Dk = k.shape
        Hv, Dv = v.shape[2:]
        rows, threadgroup = _LAUNCH[family]
        kernel = self.kernels[family, path]
        return kernel(  # type: ignore[operator]
            inputs=inputs,
            template=[
                ("InT", out.get("in_dtype", k.dtype)),
                ("StT", state.dtype),
                ("Dk", Dk),
                ("Dv", Dv),
                ("Hk", Hk),
                ("Hv", Hv),
            ],
            grid=(32, Dv // rows, B * Hv),
            threadgroup=threadgroup,
            output_shapes=out["shapes"],
            output_dtypes=out["dtypes"],
        )

    def __call__(self, q, k, v, g, beta, state, mask=None):
        """``(y, state)``: the forward (``mask=None``) or the padded forward."""
        B, T, Hk, Dk = k.shape
        Hv, Dv = v.shape[2:]
        family = gated_delta_family(Dk, Dv, g.dtype, state.dtype)
        if family == "ops":
            return gated_delta_steps(q, k, v, g, beta, state, mask)
        inputs = [q, k, v, g, beta, state, T] + ([mask] if mask is not None else [])
        y, state = self._launch(
            family,
            "forward" if mask is None else "masked",
            inputs,
            k,
            v,
            state,
            in_dtype=q.dtype,
            shapes=[(B, T, Hv, Dv), state.shape],
            dtypes=[q.dtype, state.dtype],
        )
        return y, state

    def replay(self, q, k, v, g, beta, state, mask=None, lengths=None):
        """The state after each row's first ``lengths[b]`` steps (all ``T``: ``None``)."""
        B, T, Hk, Dk = k.shape
        Hv, Dv = v.shape[2:]
        family = gated_delta_family(Dk, Dv, g.dtype, state.dtype)
        if family == "ops":
            # mlx-lm's ops recurrence, as the forward runs it here; the steps
            # after a row's kept length are masked (the state stays).
            if lengths is not None:
                kept = mx.arange(T)[None] < lengths[:, None]
                mask = kept if mask is None else mask & kept
            return gated_delta_steps(q, k, v, g, beta, state, mask)[1]
        if lengths is None:
            lengths = mx.full((B,), T, dtype=mx.int32)
        inputs = [k, v, g, beta, state, T] + ([mask] if mask is not None else [])
        (state,) = self._launch(
            family,
            "replay" if mask is None else "replay_masked",
            inputs + [lengths.astype(mx.int32)],
            k,
            v,
            state,
            in_dtype=q.dtype,
            shapes=[state.shape],
            dtypes=[state.dtype],
        )
        return state


def _metal_causal_conv() -> Callable[..., object]:
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

    return run


def metal_kernels() -> list[Kernel]:
    """Metal registrations. Constructing them needs no GPU; calling them does."""
    delta = _MetalGatedDelta()
    sources = gated_delta_metal_sources()

    def both(path: str) -> str:
        return "\n".join(f"// {family}\n{paths[path]}" for family, paths in sources.items())

    recurrence = (
        "one arithmetic per geometry for forward, padded prefill and replay: mlx-lm's packed "
        "Dk=128 kernel, else its simd_sum kernel, else its ops recurrence (Dk not a multiple "
        "of 32)"
    )
    metal = [
        Kernel(GATED_DELTA, "metal", delta, source=both("forward"), description=recurrence),
        Kernel(
            GATED_DELTA_MASKED,
            "metal",
            delta,
            source=both("masked"),
            description=recurrence + ", [B, T] mask",
        ),
        Kernel(
            GATED_DELTA_REPLAY,
            "metal",
            delta.replay,
            source=both("replay"),
            description="the forward's state statements only, each row stopping at its "
            "kept length",
        ),
        Kernel(
            CAUSAL_CONV,
            "metal",
            _metal_causal_conv(),
            source=_CAUSAL_CONV_SOURCE,
            description="one thread per (row, channel): fp32 taps rounded like conv1d, "
            "SiLU rounded like nn.silu, tail",
        ),
    ]
    return metal + [k for k in expert_kernels(SWITCH_GLU) if k.backend == "metal"]


def kernels() -> list[Kernel]:
    """Every registration of this plugin (what ``loom_kernels`` returns)."""
    return [*ops_kernels(), *metal_kernels()]

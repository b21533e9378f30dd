"""The gated delta recurrence and the causal conv on the core's native CPU kernel sets.

``native.gated_delta`` and ``native.conv_silu`` replace
``mx.fast.gated_delta_update`` and ``mx.conv1d`` + ``nn.silu`` under
``cpu-native`` / ``cpu-native-int8-act`` (``cpu-ops`` keeps mlx-lm's bits,
tested in the parity tests). Claims: within fp32 rounding of the MLX ops; a
padded row equals the row alone and a replay equals the forward's state over
the kept steps, bit for bit; a conv over chunks equals the conv over the
whole; the model runs them as one node each per layer and a speculative
commit still equals a fresh forward.
"""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from mlx_loom.cache.recurrent import RecurrentCache
from mlx_loom.cpu import native
from mlx_loom.host import resolve_model
from mlx_loom.loader import build_model
from mlx_loom_qwen3_next.kernels import causal_conv_silu_ops, native_cpu_kernels

pytestmark = pytest.mark.skipif(
    native.unavailable_reason() is not None, reason=str(native.unavailable_reason())
)


def inputs(B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, seed: int = 0):
    key = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((B, T, Hk, Dk), key=key[0]) * 0.3
    k = mx.random.normal((B, T, Hk, Dk), key=key[1]) * 0.3
    v = mx.random.normal((B, T, Hv, Dv), key=key[2])
    g = mx.random.uniform(0.7, 1.0, (B, T, Hv), key=key[3])
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv), key=key[4])
    state = mx.random.normal((B, Hv, Dv, Dk), key=key[5]) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("Dk,Dv", [(64, 32), (20, 12)])  # 20: a tail past the 8-lane blocks
def test_the_native_recurrence_is_within_fp32_rounding_of_mlx(T, Dk, Dv):
    args = inputs(2, T, 2, 4, Dk, Dv)
    want_y, want_s = mx.fast.gated_delta_update(*args)
    y, s = native.module().gated_delta(*args)
    assert y.shape == want_y.shape and s.shape == want_s.shape
    # Sums of Dk products in another order, T steps deep: a few ulps of the
    # magnitudes involved, never a different computation.
    assert mx.abs(y - want_y).max().item() <= 1e-5 * max(1.0, mx.abs(want_y).max().item())
    assert mx.abs(s - want_s).max().item() <= 1e-5 * max(1.0, mx.abs(want_s).max().item())
    assert not mx.array_equal(y, mx.zeros_like(y))


def _unreached(*_args, **_kwargs):
    raise AssertionError("float32 inputs took the ops kernels")


UNREACHED = {
    name: _unreached for name in ("gated_delta", "gated_delta_masked", "gated_delta_replay")
}


def test_half_precision_activations_keep_the_graphs_own_recurrence():
    """bf16 compute keeps MLX's rounding points (the kernels the graph had), as the
    conv does; float32 takes the native node."""
    taken = []
    ops = {
        name: (lambda *a, _n=name, **kw: taken.append(_n) or "ops")
        for name in ("gated_delta", "gated_delta_masked", "gated_delta_replay")
    }
    kn = native_cpu_kernels(native.module(), ops)
    q, k, v, g, beta, state = inputs(1, 3, 2, 4, 16, 8)
    half = [a.astype(mx.bfloat16) for a in (q, k, v, g, beta)]
    mask = mx.array([[True, True, False]])
    assert kn["gated_delta"](*half, state) == "ops"
    assert kn["gated_delta_masked"](*half, state, mask) == "ops"
    assert kn["gated_delta_replay"](*half, state, mask, mx.array([2])) == "ops"
    assert taken == ["gated_delta", "gated_delta_masked", "gated_delta_replay"]
    y, _ = kn["gated_delta"](q, k, v, g, beta, state)
    assert y.dtype == mx.float32 and taken == ["gated_delta", "gated_delta_masked", "gated_delta_replay"]


def test_a_padded_row_equals_the_row_alone_and_a_replay_the_forward():
    kn = native_cpu_kernels(native.module(), UNREACHED)
    q, k, v, g, beta, state = inputs(2, 9, 2, 4, 64, 32, seed=3)
    mask = mx.array([[True] * 9, [True] * 6 + [False] * 3])
    y, s = kn["gated_delta_masked"](q, k, v, g, beta, state, mask)
    alone_y, alone_s = kn["gated_delta"](
        q[1:, :6], k[1:, :6], v[1:, :6], g[1:, :6], beta[1:, :6], state[1:]
    )
    assert mx.array_equal(y[1, :6], alone_y[0]) and mx.array_equal(s[1], alone_s[0])
    full_y, full_s = kn["gated_delta"](q[:1], k[:1], v[:1], g[:1], beta[:1], state[:1])
    assert mx.array_equal(y[0], full_y[0]) and mx.array_equal(s[0], full_s[0])
    # Replay of the kept steps (4 of row 0, 6 of row 1): the forward's state there.
    lengths = mx.array([4, 6])
    replayed = kn["gated_delta_replay"](q, k, v, g, beta, state, mask, lengths)
    for b, n in enumerate((4, 6)):
        one = kn["gated_delta"](
            q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], g[b : b + 1, :n],
            beta[b : b + 1, :n], state[b : b + 1],
        )[1]
        assert mx.array_equal(replayed[b], one[0])


def test_leading_masked_steps_and_a_row_with_none_leave_the_state_where_it_was():
    # The kernel reads each head's state from the input until a step of the
    # row runs, then updates the output in place: a row whose first steps are
    # masked (left padding) must equal the row alone, a row with no step
    # running must hand its state on unchanged, and the input state must
    # never be written.
    kn = native_cpu_kernels(native.module(), UNREACHED)
    q, k, v, g, beta, state = inputs(3, 7, 2, 4, 20, 12, seed=5)
    before = mx.array(state)
    mask = mx.array([[False, False, False] + [True] * 4, [False] * 7, [True] * 7])
    y, s = kn["gated_delta_masked"](q, k, v, g, beta, state, mask)
    alone_y, alone_s = kn["gated_delta"](
        q[:1, 3:], k[:1, 3:], v[:1, 3:], g[:1, 3:], beta[:1, 3:], state[:1]
    )
    assert mx.array_equal(y[0, 3:], alone_y[0]) and mx.array_equal(s[0], alone_s[0])
    assert mx.array_equal(y[0, :3], mx.zeros_like(y[0, :3]))
    assert mx.array_equal(s[1], state[1]) and mx.array_equal(y[1], mx.zeros_like(y[1]))
    assert not mx.array_equal(s[2], state[2])
    assert mx.array_equal(state, before)


def test_the_native_conv_is_within_rounding_of_mlx_and_chunks_agree():
    kn = native_cpu_kernels(native.module(), UNREACHED)
    C, K = 40, 4
    x = mx.random.normal((2, 23, C), key=mx.random.key(1))
    weight = mx.random.normal((C, K, 1), key=mx.random.key(2)) * 0.5
    tail = mx.random.normal((2, K - 1, C), key=mx.random.key(3))
    y, new_tail = kn["causal_conv"](x, tail, weight)
    want, want_tail = causal_conv_silu_ops(x, tail, weight)
    assert mx.abs(y - want).max().item() <= 1e-5 * mx.abs(want).max().item()
    assert mx.array_equal(new_tail, want_tail)
    first, mid = kn["causal_conv"](x[:, :10], tail, weight)
    second, end = kn["causal_conv"](x[:, 10:], mid, weight)
    assert mx.array_equal(mx.concatenate([first, second], axis=1), y)
    assert mx.array_equal(end, new_tail)


def test_bad_inputs_are_refused_with_what_was_wrong():
    q, k, v, g, beta, state = inputs(1, 3, 2, 4, 16, 8)
    nat = native.module()
    with pytest.raises(ValueError, match="float32"):
        nat.gated_delta(q.astype(mx.float16), k, v, g, beta, state)
    with pytest.raises(ValueError, match="shapes do not fit"):
        nat.gated_delta(q, k, v, g, beta, state[:, :2])
    with pytest.raises(ValueError, match=r"mask must be bool \[B, T\]"):
        nat.gated_delta(q, k, v, g, beta, state, mx.ones((1, 2), dtype=mx.bool_))
    with pytest.raises(ValueError, match="conv_silu shapes do not fit"):
        nat.conv_silu(mx.zeros((1, 5, 8)), mx.zeros((6, 4)))


@pytest.mark.parametrize("kernels", ["cpu-native", "cpu-ops"])
def test_the_model_runs_the_recurrence_natively_only_on_the_native_sets(
    kernels, ckpt_dir, tmp_path
):
    path = ckpt_dir("qwen3_next-q4")
    model = build_model(resolve_model(path, compute_dtype="float32", cpu_kernels=kernels)).module
    spec, fresh = model.make_cache(), model.make_cache()
    prompt, window, keep = [1, 5, 7, 9, 11, 200, 3], [23, 99, 4, 180], 2
    logits = model(mx.array([prompt]), cache=spec)
    dot = tmp_path / "graph.dot"
    mx.export_to_dot(str(dot), logits)
    nodes = re.findall(r'label ="([A-Za-z_0-9]+)', dot.read_text())
    assert ("LoomDeltaRule" in nodes) == (kernels == "cpu-native"), nodes
    assert ("LoomConvSilu" in nodes) == (kernels == "cpu-native"), nodes
    # A speculative round on the native recurrence: commit == a fresh forward.
    for c in spec:
        if isinstance(c, RecurrentCache):
            c.begin_round()
    model(mx.array([window]), cache=spec)
    for c in spec:
        if isinstance(c, RecurrentCache):
            c.commit(keep)
        else:
            c.trim(len(window) - keep)
    model(mx.array([prompt]), cache=fresh)
    model(mx.array([window[:keep]]), cache=fresh)
    nxt = mx.array([[77]])
    assert mx.array_equal(model(nxt, cache=spec), model(nxt, cache=fresh))


def test_the_gated_norm_in_float32_takes_the_native_gate_with_the_same_bits():
    # In float32 the gated norm's casts are no-ops, so silu(z) * normed goes
    # through swiglu: one vectorised native node on a native set, where MLX's
    # compiled kernel takes a scalar exp per element. The bits are those of
    # the graph's own compiled function, on either set.
    from mlx_loom.cpu.ops import forward_kernels
    from mlx_loom.nn import rms_norm
    from mlx_loom_qwen3_next.graph import GatedRMSNorm, _gate_normed

    norm = GatedRMSNorm(64, 1e-6)
    norm.weight = mx.random.uniform(0.5, 1.5, (64,), key=mx.random.key(1))
    x = mx.random.normal((3, 2, 4, 64), key=mx.random.key(2))
    z = mx.random.normal((3, 2, 4, 64), key=mx.random.key(3)) * 4
    want = _gate_normed(x, z, rms_norm(x, norm.weight, norm.eps))
    assert mx.array_equal(norm(x, z), want)
    with forward_kernels("cpu-native"):
        got = norm(x, z)
        want_native = _gate_normed(x, z, rms_norm(x, norm.weight, norm.eps))
    assert mx.array_equal(got, want_native)
    # half precision keeps the graph's own function (one rounding to bf16)
    h, hz = x.astype(mx.bfloat16), z.astype(mx.bfloat16)
    assert mx.array_equal(norm(h, hz), _gate_normed(h, hz, rms_norm(h, norm.weight, norm.eps)))

"""The native gated delta recurrence (``gated_delta``; Qwen3-Next / Qwen3.5 linear attention).

MLX's ``mx.fast.gated_delta_update`` is, on the CPU, a graph of element-wise
and reduction nodes per token; the native node updates each state row in
one pass, its two dot products summed eight lanes at a time with fused
multiply-adds, so it is not bit-equal to MLX. The claims:

* one step is within the rounding bound of the exact (float64) step's
  magnitudes, counted for both evaluations (below), outputs and state;
* a chunk of T tokens equals T one-token calls bit for bit (the same
  arithmetic per step), on one thread or the pool;
* value heads read their key head (``h // (Hv / Hk)``) as MLX repeats them;
* a padded (masked) batch row equals the row alone; a masked step keeps
  the state;
* the graph takes it only in a native float32 forward; whole
  Qwen3-Next models keep mlx-lm's greedy tokens on the native sets
  (tests/cpu/test_model_parity.py) and the compiled step equals the eager
  one (tests/cpu/test_compiled_step.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_loom.cpu import native, ops
from mlx_loom.cpu.ops import forward_kernels
from mlx_loom.nn import native_gated_delta, native_gated_delta_replay

nat = native.module()
U = 2.0**-24


def operands(B=1, T=1, Hk=2, Hv=4, Dk=64, Dv=32, seed=0):
    keys = iter(mx.random.split(mx.random.key(seed), 8))
    n = lambda shape: mx.random.normal(shape, key=next(keys))  # noqa: E731
    q = n((B, T, Hk, Dk)) / Dk
    k = n((B, T, Hk, Dk))
    k = k / mx.sqrt((k * k).sum(-1, keepdims=True))  # L2-normalised, as the graph does
    v = n((B, T, Hv, Dv))
    g = mx.exp(-mx.abs(n((B, T, Hv))))
    beta = mx.sigmoid(n((B, T, Hv)))
    state = n((B, Hv, Dv, Dk)) * 0.5
    return q, k, v, g, beta, state


def bound_of_one_step(q, k, v, g, beta, state):
    """Per output and per state element: twice the rounding error either
    evaluation may make, from the exact step's magnitudes (float64)."""
    f = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    groups = v.shape[2] // q.shape[2]
    q, k = np.repeat(f(q), groups, 2)[:, 0], np.repeat(f(k), groups, 2)[:, 0]  # [B, Hv, Dk]
    v, g, beta, s = f(v)[:, 0], f(g)[:, 0], f(beta)[:, 0], f(state)
    Dk = q.shape[-1]
    s1 = s * g[..., None, None]
    kv = np.einsum("bhij,bhj->bhi", s1, k)
    kv_mag = np.einsum("bhij,bhj->bhi", np.abs(s1), np.abs(k))
    delta = (v - kv) * beta[..., None]
    err_kv = (Dk + 2) * U * kv_mag + U * np.abs(v - kv)
    err_delta = np.abs(beta[..., None]) * err_kv + U * np.abs(delta)
    s2 = s1 + k[:, :, None, :] * delta[..., None]
    err_s2 = np.abs(k)[:, :, None, :] * err_delta[..., None] + 3 * U * (np.abs(s1) + np.abs(s2))
    y_mag = np.einsum("bhij,bhj->bhi", np.abs(s2), np.abs(q))
    err_y = (Dk + 2) * U * y_mag + np.einsum("bhij,bhj->bhi", err_s2, np.abs(q))
    return 2 * err_y, 2 * err_s2


@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(2, 4, 64, 32), (1, 1, 60, 16), (4, 4, 128, 128)])
def test_one_step_is_within_the_rounding_bound_of_mlx(Hk, Hv, Dk, Dv):
    args = operands(B=2, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, seed=Dk)
    y, state = nat.gated_delta(*args)
    y_mlx, state_mlx = mx.fast.gated_delta_update(*args)
    err_y, err_s = bound_of_one_step(*args)
    dy = np.abs(np.asarray(y, np.float64) - np.asarray(y_mlx, np.float64))[:, 0]
    ds = np.abs(np.asarray(state, np.float64) - np.asarray(state_mlx, np.float64))
    assert np.all(dy <= err_y) and np.all(ds <= err_s)
    assert np.any(ds > 0) or np.any(dy > 0)  # not MLX's own arithmetic


@pytest.mark.parametrize("B,Hv,Dk,Dv,T", [(1, 4, 64, 32, 6), (2, 16, 64, 64, 40)])  # serial, pool
def test_a_chunk_equals_its_tokens_one_at_a_time(B, Hv, Dk, Dv, T):
    q, k, v, g, beta, state = operands(B=B, T=T, Hk=Hv // 2, Hv=Hv, Dk=Dk, Dv=Dv, seed=T)
    y, final = nat.gated_delta(q, k, v, g, beta, state)
    s = state
    for t in range(T):
        sl = slice(t, t + 1)
        yt, s = nat.gated_delta(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], s)
        assert mx.array_equal(yt, y[:, sl]), t
    assert mx.array_equal(s, final)


def test_the_graph_takes_it_only_in_a_native_float32_forward():
    args = operands(seed=3)
    assert native_gated_delta(*args) is None
    with forward_kernels("cpu-ops"):
        assert native_gated_delta(*args) is None
    with forward_kernels("cpu-native"):
        got = native_gated_delta(*args)
        half = native_gated_delta(*(a.astype(mx.bfloat16) for a in args))
        per_channel = native_gated_delta(*args[:3], mx.ones(args[0].shape[:2] + (4, 64)), *args[4:])
    assert got is not None and mx.array_equal(got[0], nat.gated_delta(*args)[0])
    assert half is None and per_channel is None
    assert ops.gated_delta(*args) is not None


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: (a[0][..., :32], *a[1:]), "q and k"),
        (lambda a: (*a[:2], a[2][:, :, :3], *a[3:]), "multiple of key heads"),
        (lambda a: (*a[:3], a[3][..., :2], *a[4:]), "g and beta"),
        (lambda a: (*a[:5], a[5][:, :, :8]), "state must be"),
        (lambda a: (*a[:5], a[5].astype(mx.bfloat16)), "float32"),
    ],
)
def test_bad_operands_are_refused_with_what_was_wrong(change, match):
    with pytest.raises(ValueError, match=match):
        nat.gated_delta(*change(operands(seed=4)))


def test_the_rollback_replay_gives_the_forwards_state_at_each_rows_kept_length():
    # A speculative round's commit replays the kept tokens after the forward's
    # hook is gone: the replay keeps the native kernel, so the state is the
    # forward's at that token bit for bit (MLX's replay would round otherwise).
    q, k, v, g, beta, state = operands(B=3, T=5, seed=6)
    assert native_gated_delta_replay(lambda *a: None) is None
    with forward_kernels("cpu-native"):
        replay = native_gated_delta_replay(lambda *a: "fallback")
    assert replay is not None
    whole = nat.gated_delta(q, k, v, g, beta, state)[1]
    assert mx.array_equal(replay(q, k, v, g, beta, state), whole)
    lengths = mx.array([2, 0, 5], dtype=mx.int32)
    got = replay(q, k, v, g, beta, state, None, lengths)
    for b, n in enumerate((2, 0, 5)):
        row = slice(b, b + 1)
        want = state[row] if n == 0 else nat.gated_delta(
            *(a[row, :n] for a in (q, k, v, g, beta)), state[row]
        )[1]
        assert mx.array_equal(got[row], want), b
    assert replay(q, k, v, g, beta, state.astype(mx.bfloat16)) == "fallback"


def test_a_padded_row_equals_the_row_alone_and_masked_steps_keep_the_state():
    # Left padding, as the engine's batches have it: row 0 starts 2 steps late.
    q, k, v, g, beta, state = operands(B=2, T=5, seed=8)
    mask = mx.array([[False, False, True, True, True], [True] * 5])
    y, final = nat.gated_delta(q, k, v, g, beta, state, mask)
    alone_y, alone = nat.gated_delta(*(a[:1, 2:] for a in (q, k, v, g, beta)), state[:1])
    assert mx.array_equal(final[:1], alone) and mx.array_equal(y[:1, 2:], alone_y)
    unmasked_y, unmasked = nat.gated_delta(q, k, v, g, beta, state)
    assert mx.array_equal(final[1:], unmasked[1:]) and mx.array_equal(y[1:], unmasked_y[1:])
    with forward_kernels("cpu-native"):
        assert native_gated_delta(q, k, v, g, beta, state, mask.astype(mx.int32)) is None
    with pytest.raises(ValueError, match="mask must be"):
        nat.gated_delta(q, k, v, g, beta, state, mask[:, :3])

"""The Metal registrations are the computations they claim, checked where no GPU runs them.

Gated delta rule. Our Metal sources must be mlx-lm's kernels' computation
(``mlx_lm/models/gated_delta.py``) so Metal logits can equal mlx-lm's. The
check is a structural fingerprint: the token stream of a source without
comments and whitespace, every local name replaced by its order of first
appearance. The kernel's interface (its inputs, outputs and template
parameters), Metal's builtins and the C keywords keep their names. Two
sources with equal fingerprints run the same statements, in the same order,
on the same operands. Names and comments may differ, nothing else. mlx-lm's
sources are captured by constructing its kernels with a recording stand-in
for ``mx.fast.metal_kernel``, and its dispatch by calling its launcher with
recording kernels.

One arithmetic per geometry. The geometry alone picks the family (packed,
simd, ops), and each family's padded forward and state-only replay are
derived from the forward's template; the tests pin which kernel each path
launches and that the replay keeps every statement that writes the state,
in order, stopping at each row's kept length.

Causal conv. The fused kernel must round where ``mx.conv1d`` + ``nn.silu``
round. Its CPU emulation (the kernel's steps in ops) is compared bit for bit
with the ops path, and the kernel's SiLU must be MLX's own Metal ``Sigmoid``
functor (from the installed MLX headers) applied in the input dtype.
"""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import mlx
import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.gated_delta as reference
import pytest

from mlx_loom_qwen3_next import kernels as qk

_INTERFACE = {
    *("q", "k", "v", "g", "beta", "state_in", "state_out", "y", "mask", "T"),
    *("InT", "StT", "Dk", "Dv", "Hk", "Hv"),
}
_BUILTINS = {
    *("auto", "float", "int", "constexpr", "for", "if", "else", "true", "static_cast", "return"),
    *("thread_position_in_grid", "thread_position_in_threadgroup", "thread_index_in_simdgroup"),
    *("simd_sum", "simd_shuffle_xor", "metal", "precise", "exp", "abs"),
}
_TOKEN = re.compile(
    r"//[^\n]*|/\*.*?\*/|\.[A-Za-z_]\w*|[A-Za-z_]\w*|\d+\.\d*f?|\d+f?"
    r"|\+\+|\+=|-=|\*=|==|<=|>=|&&|\|\||::|[^\s\w]",
    re.S,
)


def fingerprint(source: str, keep: set[str] = _INTERFACE | _BUILTINS) -> list[str]:
    names: dict[str, str] = {}
    out = []
    for tok in _TOKEN.findall(source):
        if tok.startswith(("//", "/*")):
            continue
        if re.fullmatch(r"[A-Za-z_]\w*", tok) and tok not in keep:
            tok = names.setdefault(tok, f"local{len(names)}")
        out.append(tok)
    return out


def _reference_sources() -> dict[str, dict]:
    made: list[dict] = []
    with (
        mock.patch.object(mx.metal, "is_available", return_value=True),
        mock.patch.object(mx.fast, "metal_kernel", side_effect=lambda **kw: made.append(kw)),
    ):
        reference._make_gated_delta_kernel(has_mask=False, vectorized=False)
        reference._make_gated_delta_kernel(has_mask=True, vectorized=False)
        reference._make_gated_delta_packed_kernel()
    return dict(zip(("plain", "masked", "packed"), made, strict=True))


#: Our (family, path) whose source must be each mlx-lm kernel's computation.
_MLX_LMS = {"plain": ("simd", "forward"), "masked": ("simd", "masked"), "packed": ("packed", "forward")}


@pytest.mark.parametrize("variant", ["plain", "masked", "packed"])
def test_gated_delta_metal_source_is_mlx_lms_computation(variant):
    theirs = _reference_sources()[variant]
    family, path = _MLX_LMS[variant]
    ours = qk.gated_delta_metal_sources()[family][path]
    assert fingerprint(ours) == fingerprint(theirs["source"])


def test_the_fingerprint_tells_a_changed_operation_apart():
    ours = qk.gated_delta_metal_sources()["simd"]["forward"]
    changed = ours.replace("acc[j] = acc[j] * gp[vhead];", "acc[j] = acc[j] + gp[vhead];")
    assert changed != ours
    assert fingerprint(changed) != fingerprint(ours)


def test_the_padded_packed_kernel_is_mlx_lms_packed_kernel_under_a_step_guard():
    """Padded prefill keeps the packed arithmetic (mlx-lm would switch to simd_sum)."""
    masked = qk.gated_delta_metal_sources()["packed"]["masked"]
    guard = "if (mask[batch * T + step]) {"
    otherwise = re.compile(r"\}\s*else\s*\{\s*y\[vrow\] = static_cast<InT>\(0\);\s*\}")
    assert masked.count(guard) == 1 and len(otherwise.findall(masked)) == 1
    unguarded = otherwise.sub("", masked.replace(guard, ""))
    assert fingerprint(unguarded) == fingerprint(_reference_sources()["packed"]["source"])


_STATE = re.compile(r"^\s*(acc\[|kv\b|float kv\b|auto d\b|float decay\b|dst\[|kp\b|vp\b|gp\b|bp\b)")


def _statements(source: str) -> list[str]:
    body = re.sub(r"//[^\n]*", "", source)
    return [" ".join(s.split()) for s in re.split(r"[;{}]", body) if s.strip()]


@pytest.mark.parametrize("family", ["simd", "packed"])
@pytest.mark.parametrize("masked", [False, True])
def test_the_replay_runs_the_forwards_state_statements_and_stops_at_the_kept_length(
    family, masked
):
    sources = qk.gated_delta_metal_sources()[family]
    forward = _statements(sources["masked" if masked else "forward"])
    replay = _statements(sources["replay_masked" if masked else "replay"])
    # Only the loop bound differs in what is kept: T for a forward, the row's kept length.
    assert "for (int step = 0" in forward and "step < T" in forward
    assert "step < lengths[batch]" in replay and "step < T" not in replay
    replay = ["step < T" if s == "step < lengths[batch]" else s for s in replay]
    # The replay is the forward with statements removed, in the forward's order ...
    it = iter(forward)
    assert all(any(s == f for f in it) for s in replay)
    dropped = [s for s in forward if s not in replay]
    assert dropped, "the replay must drop the output statements"
    # ... and none it removes touches the state or the inputs the state reads.
    assert not [s for s in dropped if _STATE.match(s)]
    write_guards = {"else", "if (thread_index_in_simdgroup == 0)", "if (part == 0)"}
    assert all(re.search(r"\b(y|o|qp|s)\b", s) or s in write_guards for s in dropped)
    assert not re.search(r"(?<![.\w])(y|q|qp)\b", "\n".join(replay))


class _Recorder:
    """Stands in for a constructed Metal kernel: records the launch, returns zeros."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __call__(self, **launch):
        self.calls.append((self.name, launch))
        shapes, dtypes = launch["output_shapes"], launch["output_dtypes"]
        return [mx.zeros(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]


def _launch_signature(launch: dict) -> tuple:
    inputs = tuple(x if isinstance(x, int) else (tuple(x.shape), x.dtype) for x in launch["inputs"])
    return (
        inputs,
        tuple(launch["template"]),
        tuple(launch["grid"]),
        tuple(launch["threadgroup"]),
        tuple(map(tuple, launch["output_shapes"])),
        tuple(launch["output_dtypes"]),
    )


def _case(Dk: int, Dv: int, dtype: mx.Dtype, masked: bool):
    B, T, Hk, Hv = 2, 3, 2, 4
    q = mx.zeros((B, T, Hk, Dk), dtype)
    v = mx.zeros((B, T, Hv, Dv), dtype)
    g, beta = mx.zeros((B, T, Hv), mx.float32), mx.zeros((B, T, Hv), dtype)
    state = mx.zeros((B, Hv, Dv, Dk), mx.float32)
    mask = mx.ones((B, T), mx.bool_) if masked else None
    return q, q, v, g, beta, state, mask


def _recording() -> tuple[qk._MetalGatedDelta, list]:
    calls: list = []
    delta = qk._MetalGatedDelta()
    delta.kernels = {key: _Recorder("/".join(key), calls) for key in delta.kernels}
    return delta, calls


def _mlx_lm_launches(args, monkeypatch) -> list:
    theirs: list = []
    for name in ("plain", "masked", "packed"):
        attr = {"plain": "", "masked": "_masked", "packed": "_packed"}[name]
        monkeypatch.setattr(reference, f"_gated_delta_kernel{attr}", _Recorder(name, theirs))
    reference.gated_delta_kernel(*args)
    return theirs


@pytest.mark.parametrize(
    "Dk,Dv,dtype,family",
    [
        (128, 16, mx.float32, "packed"),
        (128, 16, mx.bfloat16, "packed"),
        (128, 12, mx.float32, "simd"),  # Dv not a multiple of 8
        (64, 16, mx.bfloat16, "simd"),
        (32, 8, mx.float16, "simd"),
    ],
)
def test_every_path_of_a_geometry_runs_one_family(Dk, Dv, dtype, family, monkeypatch):
    """Forward, padded prefill and replay launch the same family; the forward is mlx-lm's."""
    delta, ours = _recording()
    forward = _case(Dk, Dv, dtype, masked=False)
    padded = _case(Dk, Dv, dtype, masked=True)
    delta(*forward)
    delta(*padded)
    delta.replay(*forward[:6], None, mx.array([1, 3], mx.int32))
    delta.replay(*padded, mx.array([2, 0], mx.int32))
    assert [name for name, _ in ours] == [
        f"{family}/forward",
        f"{family}/masked",
        f"{family}/replay",
        f"{family}/replay_masked",
    ]
    # The unmasked forward is mlx-lm's launch, input for input.
    (theirs,) = _mlx_lm_launches(forward, monkeypatch)
    assert _launch_signature(ours[0][1]) == _launch_signature(theirs[1])
    # Every path launches the forward's grid and threadgroup (one thread per
    # state entry in the same places), the replay with the kept lengths and
    # the state as its only output.
    for _, launch in ours[1:]:
        assert launch["grid"] == ours[0][1]["grid"]
        assert launch["threadgroup"] == ours[0][1]["threadgroup"]
    for _, launch in ours[2:]:
        assert launch["output_shapes"] == [forward[5].shape]
        assert launch["inputs"][-1].dtype == mx.int32


def test_mlx_lm_pads_on_another_arithmetic_than_its_packed_forward(monkeypatch):
    """Why the padded path is ours: mlx-lm sends a masked Dk=128 call to simd_sum."""
    masked = _case(128, 16, mx.float32, masked=True)
    (theirs,) = _mlx_lm_launches(masked, monkeypatch)
    (unmasked,) = _mlx_lm_launches(_case(128, 16, mx.float32, masked=False), monkeypatch)
    assert (theirs[0], unmasked[0]) == ("masked", "packed")
    delta, ours = _recording()
    delta(*masked)
    assert ours[0][0] == "packed/masked"


def _random_case(dtype, Dk=16, T=5):
    keys = mx.random.split(mx.random.key(7), 6)
    B, Hk, Hv, Dv = 2, 2, 4, 8
    q = mx.random.normal((B, T, Hk, Dk), key=keys[0]).astype(dtype) * 0.3
    k = mx.random.normal((B, T, Hk, Dk), key=keys[1]).astype(dtype) * 0.3
    v = mx.random.normal((B, T, Hv, Dv), key=keys[2]).astype(dtype)
    g = mx.random.uniform(0.5, 1.0, (B, T, Hv), key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv), key=keys[4]).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk), key=keys[5])
    return q, k, v, g, beta, state


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_key_dims_mlx_lm_runs_in_ops_take_its_ops_recurrence_bit_for_bit(dtype, masked):
    q, k, v, g, beta, state = _random_case(dtype)
    mask = mx.array([[True] * 5, [True, True, False, False, False]]) if masked else None
    want_y, want_state = reference.gated_delta_ops(q, k, v, g, beta, state, mask)
    # Dk = 16 < 32: mlx-lm's dispatch (and ours, on Metal) takes the ops recurrence.
    assert qk.gated_delta_family(16, 8, g.dtype, state.dtype) == "ops"
    got_y, got_state = qk._MetalGatedDelta()(q, k, v, g, beta, state, mask)
    assert mx.array_equal(got_state, want_state)
    assert mx.array_equal(got_y, want_y)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_ops_family_replay_stops_each_row_at_its_kept_length(dtype):
    q, k, v, g, beta, state = _random_case(dtype)
    delta = qk._MetalGatedDelta()
    got = delta.replay(q, k, v, g, beta, state, None, mx.array([2, 5], mx.int32))
    for row, keep in enumerate((2, 5)):
        part = [x[row : row + 1, :keep] for x in (q, k, v, g, beta)]
        _, want = delta(*part, state[row : row + 1])
        assert mx.array_equal(got[row : row + 1], want)


def test_the_replay_registration_is_the_state_only_replay():
    replay = {k.name: k for k in qk.metal_kernels()}[qk.GATED_DELTA_REPLAY]
    q, k, v, g, beta, state = _random_case(mx.float32)
    forward = qk._MetalGatedDelta()(q, k, v, g, beta, state)[1]
    assert mx.array_equal(replay.fn(q, k, v, g, beta, state), forward)
    assert "lengths[batch]" in replay.source and "y[" not in replay.source


@pytest.mark.parametrize(
    "geometry,family",
    [
        # Qwen3-Next-80B-A3B and the Qwen3.5 family: linear key/value heads of 128.
        ((128, 128), "packed"),
        ((64, 64), "simd"),
        ((48, 64), "ops"),
    ],
)
def test_the_family_depends_on_the_geometry_alone(geometry, family):
    Dk, Dv = geometry
    assert qk.gated_delta_family(Dk, Dv, mx.float32, mx.float32) == family


# --- the fused causal conv --------------------------------------------------------


def _conv_case(dtype: mx.Dtype, S: int = 37):
    B, C, K = 2, 96, 4
    x = (mx.random.normal((B, S, C), key=mx.random.key(1)) * 2).astype(dtype)
    tail = (mx.random.normal((B, K - 1, C), key=mx.random.key(2)) * 2).astype(dtype)
    w = (mx.random.normal((C, K, 1), key=mx.random.key(3)) * 0.7).astype(dtype)
    return x, tail, w


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=str)
@pytest.mark.parametrize("with_ends", [False, True])
def test_conv_kernel_emulation_equals_the_ops_path_bit_for_bit(dtype, with_ends):
    x, tail, w = _conv_case(dtype)
    ends = mx.array([30, 37]) if with_ends else None
    y, new_tail = qk.causal_conv_silu_emulated(x, tail, w, ends)
    want_y, want_tail = qk.causal_conv_silu_ops(x, tail, w, ends)
    assert y.dtype == dtype
    assert mx.array_equal(y, want_y)
    assert mx.array_equal(new_tail, want_tail)


def test_an_fp32_silu_of_the_unrounded_sum_is_not_what_the_ops_path_computes():
    """Why the kernel rounds before its SiLU: the old fp32 SiLU differs in bf16."""
    x, tail, w = _conv_case(mx.bfloat16)
    xin = mx.concatenate([tail, x], axis=1)
    acc = sum(
        xin[:, j : j + x.shape[1]].astype(mx.float32) * w[:, j, 0].astype(mx.float32)
        for j in range(4)
    )
    fused_fp32 = (acc * mx.sigmoid(acc)).astype(mx.bfloat16)
    assert not mx.array_equal(fused_fp32, nn.silu(mx.conv1d(xin, w, 1, 0, 1, 96)))


def _mlx_metal_sigmoid() -> tuple[str, str]:
    header = Path(mlx.__path__[0]) / "include/mlx/backend/metal/kernels/unary_ops.h"
    body = re.search(r"struct Sigmoid \{.*?\n\};", header.read_text(), re.S)
    assert body is not None, f"no Sigmoid functor in {header}"
    first = re.search(r"auto \w+ = (.*?);", body.group(0), re.S)
    result = re.search(r"return (.*?);", body.group(0), re.S)
    return first.group(1), result.group(1)


def test_conv_kernel_silu_is_mlxs_metal_sigmoid_in_the_input_dtype():
    source = qk._CAUSAL_CONV_SOURCE
    e_expr, sig_expr = _mlx_metal_sigmoid()
    ours = re.search(r"auto e = (.*?);\s*InT sig = (.*?);", source, re.S)
    assert ours is not None
    # The functor's (x, y) and our (conv, e) are locals: they map one to one.
    ref = fingerprint(f"{e_expr} ; {sig_expr}", keep=_BUILTINS)
    got = fingerprint(f"{ours.group(1)} ; {ours.group(2)}", keep=_BUILTINS)
    assert got == ref
    # The conv sum is rounded to the input dtype first, the product after.
    assert "InT conv = static_cast<InT>(acc);" in source
    assert "static_cast<InT>(conv * sig)" in source

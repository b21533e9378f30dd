"""The native SwiGLU gate, gated gate+up product and log-softmax: bit-equal to MLX.

``silu_mul`` repeats MLX's own element-wise arithmetic (its exp polynomial,
its rounding to the nearest integer in double, the same fused multiply-adds),
so it is compared bit for bit with the compiled MLX function mlx-lm uses and
with the eager graph. The gated product runs the same kernels as two separate
products, so it is compared bit for bit with them followed by ``silu_mul``,
on both kernel paths (matrix-vector up to SMALL_ROWS rows, GEMM above) and
for every width. ``log_softmax`` repeats MLX's logsumexp (the same exps,
summed in the same order), compared bit for bit with ``logits -
mx.logsumexp(logits)``. Then: how a model and the engine pick them up, per
family, and that logits and log-probabilities are those of MLX's graph bit
for bit.
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_loom.nn.activations as activations
from mlx_loom.cpu import layers, native, ops
from mlx_loom.cpu.ops import forward_kernels
from mlx_loom.forward_hooks import current_silu_mul
from mlx_loom.nn import GatedMLP, swiglu

nat = native.module()


def bits_of(a: mx.array) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


def assert_bit_equal(got: mx.array, want: mx.array) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = np.asarray(got), np.asarray(want)
    same = (g.view(np.uint32) == w.view(np.uint32)) | (np.isnan(g) & np.isnan(w))
    differ = int((~same).sum())
    assert same.all(), f"{differ} of {same.size} differ, e.g. {g[~same][:3]} vs {w[~same][:3]}"


def rand(shape, dtype=mx.float32, seed=0, scale=1.0) -> mx.array:
    return (scale * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


# Where exp's branches and roundings change: its +-88 cut-offs, x log2(e) just
# below and at halves (MLX rounds x + 0.5 in double), signed zeros,
# subnormals, the largest floats, infinities and NaN.
HALVES = np.array([(k + 0.5) / 1.442695 for k in range(-60, 60)], np.float32)
SPECIALS = np.concatenate(
    [
        np.array(
            [0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 87.99, 88.0, 88.01, -87.99, -88.0, -88.01],
            np.float32,
        ),
        np.array([3.4e38, -3.4e38, np.inf, -np.inf, np.nan, -np.nan], np.float32),
        HALVES,
        np.nextafter(HALVES, np.float32(np.inf)),
        np.nextafter(HALVES, np.float32(-np.inf)),
    ]
)


@pytest.mark.parametrize("scale", [0.01, 1.0, 6.0, 40.0, 300.0])
def test_silu_mul_equals_mlx_compiled_swiglu_bit_for_bit(scale):
    n = 20_011  # not a multiple of 8: the tail runs through the same lanes
    g = np.asarray(rand((n,), seed=1, scale=scale)).copy()
    g[: SPECIALS.size] = SPECIALS
    gate, up = mx.array(g), rand((n,), seed=2, scale=scale)
    got = nat.silu_mul(gate, up)
    assert_bit_equal(got, activations._swiglu_ops(gate, up))
    assert_bit_equal(got, nn.silu(gate) * up)


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5, 17), (2, 1, 2816)])
def test_silu_mul_keeps_the_shape_of_any_operands(shape):
    gate, up = rand(shape, seed=3, scale=4.0), rand(shape, seed=4)
    assert_bit_equal(nat.silu_mul(gate, up), activations._swiglu_ops(gate, up))


def test_silu_mul_reads_strided_operands():
    gate, up = rand((16, 40), seed=5, scale=3.0).T, rand((40, 16), seed=6)
    assert_bit_equal(nat.silu_mul(gate, up), activations._swiglu_ops(gate, up))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: nat.silu_mul(mx.zeros((4,), mx.bfloat16), mx.zeros((4,), mx.bfloat16)), "float32"),
        (lambda: nat.silu_mul(mx.zeros((4,)), mx.zeros((5,))), "shape"),
        (lambda: nat.silu_mul(mx.zeros((4,)), mx.zeros((1, 4))), "shape"),
    ],
)
def test_silu_mul_refuses_what_it_does_not_compute(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def labels(out: mx.array, tmp_path) -> list[str]:
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), out)
    return re.findall(r'label ="([A-Za-z_0-9]+)', path.read_text())


def test_swiglu_takes_the_native_gate_only_in_a_native_forward_and_only_for_float32(tmp_path):
    gate, up = rand((2, 300), seed=7, scale=3.0), rand((2, 300), seed=8)
    outside = swiglu(gate, up)
    assert current_silu_mul() is None
    assert "LoomSiluMul" not in labels(outside, tmp_path)
    with forward_kernels("cpu-native"):
        assert current_silu_mul() is ops.silu_mul
        inside = swiglu(gate, up)
        assert "LoomSiluMul" in labels(inside, tmp_path)
        half = swiglu(gate.astype(mx.bfloat16), up.astype(mx.bfloat16))
        assert "LoomSiluMul" not in labels(half, tmp_path)
        assert half.dtype == mx.bfloat16
    with forward_kernels("cpu-ops"):
        assert current_silu_mul() is None
    assert_bit_equal(inside, outside)


# --- the gated product ------------------------------------------------------


def quantized(N, K, bits, group_size, scale_dtype, seed):
    wq, s, b = mx.quantize(rand((N, K), seed=seed), group_size=group_size, bits=bits)
    return wq, s.astype(scale_dtype), b.astype(scale_dtype)


ROWS = [1, 3, nat.SMALL_ROWS, nat.SMALL_ROWS + 1, 70]


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize(
    "bits,group_size,int8",
    [(4, 64, False), (4, 64, True), (4, 32, True), (8, 64, False), (2, 128, False)]
    + [(3, 64, False), (5, 32, False), (6, 64, False)],
)
def test_gated_affine_product_equals_two_products_and_the_gate(M, bits, group_size, int8):
    N, K = 200, 384
    x = rand((M, K), seed=9)
    g = quantized(N, K, bits, group_size, mx.bfloat16, seed=10)
    u = quantized(N, K, bits, group_size, mx.bfloat16, seed=11)
    got = nat.gated_affine_matmul(x, *g, *u, bits, group_size, int8)
    gate = nat.affine_matmul(x, *g, bits, group_size, None, int8)
    up = nat.affine_matmul(x, *u, bits, group_size, None, int8)
    assert_bit_equal(got, nat.silu_mul(gate, up))


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("w_dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_gated_dense_product_equals_two_products_and_the_gate(M, w_dtype):
    N, K = 67, 300  # row and column tails
    x = rand((1, M, K), seed=12)
    gw, uw = rand((N, K), w_dtype, seed=13), rand((N, K), w_dtype, seed=14)
    got = nat.gated_dense_matmul(x, gw, uw)
    assert got.shape == (1, M, N)
    assert_bit_equal(got, nat.silu_mul(nat.dense_matmul(x, gw), nat.dense_matmul(x, uw)))


def test_gated_rows_of_a_batch_equal_the_rows_alone():
    x = rand((5, 256), seed=15)
    g, u = quantized(96, 256, 4, 64, mx.float32, 16), quantized(96, 256, 4, 64, mx.float32, 17)
    batch = nat.gated_affine_matmul(x, *g, *u, 4, 64, True)
    for m in range(5):
        alone = nat.gated_affine_matmul(x[m : m + 1], *g, *u, 4, 64, True)
        assert_bit_equal(batch[m : m + 1], alone)


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda: nat.gated_dense_matmul(mx.zeros((1, 8)), mx.zeros((4, 8)), mx.zeros((5, 8))),
            "share one shape",
        ),
        (
            lambda: nat.gated_dense_matmul(
                mx.zeros((1, 8)), mx.zeros((4, 8)), mx.zeros((4, 8), mx.bfloat16)
            ),
            "share one shape and dtype",
        ),
        (
            lambda: nat.gated_dense_matmul(
                mx.zeros((1, 8), mx.bfloat16), mx.zeros((4, 8)), mx.zeros((4, 8))
            ),
            "float32 x",
        ),
        (
            lambda: nat.gated_affine_matmul(
                mx.zeros((1, 64)),
                *quantized(8, 64, 4, 64, mx.float32, 1),
                *quantized(8, 64, 4, 64, mx.bfloat16, 2),
                4,
                64,
            ),
            "scales",
        ),
        (
            lambda: nat.gated_affine_matmul(
                mx.zeros((1, 64)),
                *quantized(8, 64, 8, 64, mx.float32, 1),
                *quantized(8, 64, 8, 64, mx.float32, 2),
                8,
                64,
                True,
            ),
            "4-bit",
        ),
    ],
)
def test_gated_products_refuse_mismatched_pairs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- the gated MLP module ---------------------------------------------------


def native_mlp(dims=64, hidden=96, *, activation=swiglu, bits=4, bias=False, int8=False):
    mlp = GatedMLP(dims, hidden, activation=activation, bias=bias)
    mx.eval(mlp.parameters())
    if bits:
        nn.quantize(mlp, group_size=32, bits=bits)
    for _, mod in mlp.named_modules():
        if layers.swappable(mod):
            layers.swap_in(mod, mx.float32, int8_activations=int8)
    return mlp


def unfused(mlp: GatedMLP, x: mx.array) -> mx.array:
    return GatedMLP.__call__(mlp, x)


@pytest.mark.parametrize("bits,int8", [(4, False), (4, True), (8, False), (0, False)])
@pytest.mark.parametrize("rows", [1, 40])
def test_the_gated_mlp_is_one_node_and_equals_its_unfused_forward(bits, int8, rows, tmp_path):
    mlp = native_mlp(bits=bits, int8=int8)
    assert type(mlp) is ops.NativeGatedMLP
    x = rand((1, rows, 64), seed=18)
    got = mlp(x)
    kind = "Dense" if bits == 0 else "Affine"
    assert f"LoomGated{kind}Matmul" in "".join(labels(got, tmp_path))
    with forward_kernels("cpu-native"):
        assert_bit_equal(got, unfused(mlp, x))


@pytest.mark.parametrize(
    "build,x_dtype",
    [
        (lambda: native_mlp(bias=True), mx.float32),
        (lambda: native_mlp(), mx.bfloat16),
    ],
    ids=["biases", "bfloat16-x"],
)
def test_the_gated_mlp_runs_its_own_forward_where_the_pair_does_not_fit(build, x_dtype, tmp_path):
    mlp = build()
    x = rand((1, 2, 64), x_dtype, seed=19)
    got = mlp(x)
    assert not any(label.startswith("LoomGated") for label in labels(got, tmp_path))
    assert_bit_equal(got, unfused(mlp, x))


def test_a_projection_wrapped_by_something_else_is_not_fused(tmp_path):
    mlp = native_mlp()

    class Wrapped(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x):
            return self.inner(x)

    mlp.up_proj = Wrapped(mlp.up_proj)
    x = rand((1, 1, 64), seed=20)
    assert not any(label.startswith("LoomGated") for label in labels(mlp(x), tmp_path))


# --- per family --------------------------------------------------------------


@pytest.fixture(
    scope="module",
    params=[(f, k) for f in ("llama", "qwen3_next", "gemma4_text") for k in ("bf16", "q4")],
    ids=lambda p: "-".join(p),
)
def family_checkpoint(request, checkpoints):
    family, kind = request.param
    return family, checkpoints(family, kind)


def decode_logits(model, tokens=(1, 2, 3)):
    cache = model.make_cache()
    mx.eval(model(mx.array([list(tokens)]), cache))
    return model(mx.array([[4]]), cache)


FUSED = ("LoomGated", "LoomMulti", "LoomSiluMul")


@pytest.mark.parametrize("kernels", ["cpu-native", "cpu-native-int8-act"])
def test_each_family_decodes_bit_equal_with_and_without_the_fused_nodes(
    family_checkpoint, kernels, monkeypatch, tmp_path
):
    import mlx_loom
    from mlx_loom.nn import projections

    family, path = family_checkpoint
    # Eager forwards: a compiled step would replay its first trace (fused)
    # for the second decode too. Compiled equals eager: test_compiled_step.py.
    monkeypatch.setenv("MLX_LOOM_COMPILED_STEP", "0")
    model, _ = mlx_loom.load(path, compute_dtype="float32", cpu_kernels=kernels)
    fused = decode_logits(model)
    names = labels(fused, tmp_path)
    # Every family projects q, k and v together; the SwiGLU ones also fuse
    # their MLP's gate (Gemma 4's GeGLU MLP is one expert node instead:
    # test_native_geglu.py).
    assert any(n.startswith("LoomMulti") for n in names), names
    if family in ("llama", "qwen3_next"):
        assert any(n.startswith("LoomGated") or n == "LoomSiluMul" for n in names), names
    mx.eval(fused)
    monkeypatch.setattr(activations, "current_silu_mul", lambda: None)
    monkeypatch.setattr(ops.NativeGatedMLP, "_gated", lambda self, x: None)
    monkeypatch.setattr(projections, "_joint", None)
    plain = decode_logits(model)
    assert not any(n.startswith(FUSED) for n in labels(plain, tmp_path))
    assert_bit_equal(fused, plain)


# --- projections of one activation --------------------------------------------


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("bits,int8", [(4, True), (4, False), (8, False), (3, False)])
def test_a_multi_output_affine_product_equals_each_product(M, bits, int8):
    x = rand((1, M, 256), seed=24)
    parts = [quantized(N, 256, bits, 64, mx.bfloat16, seed) for seed, N in enumerate((96, 40, 8))]
    outs = nat.multi_affine_matmul(x, *(list(t) for t in zip(*parts, strict=True)), bits, 64, int8)
    assert len(outs) == 3
    for out, (w, s, b) in zip(outs, parts, strict=True):
        assert_bit_equal(out, nat.affine_matmul(x, w, s, b, bits, 64, None, int8))


@pytest.mark.parametrize("M", ROWS)
def test_a_multi_output_dense_product_equals_each_product(M):
    x = rand((M, 300), seed=25)
    weights = [rand((N, 300), mx.bfloat16, seed=N) for N in (67, 9)]
    for out, w in zip(nat.multi_dense_matmul(x, weights), weights, strict=True):
        assert_bit_equal(out, nat.dense_matmul(x, w))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: nat.multi_dense_matmul(mx.zeros((1, 8)), []), "1 to"),
        (
            lambda: nat.multi_dense_matmul(mx.zeros((1, 8)), [mx.zeros((4, 8)), mx.zeros((4, 9))]),
            "row length",
        ),
        (
            lambda: nat.multi_affine_matmul(
                mx.zeros((1, 64)),
                [quantized(8, 64, 4, 64, mx.float32, 1)[0]],
                [],
                [],
                4,
                64,
            ),
            "one scales",
        ),
        (
            lambda: nat.multi_affine_matmul(
                mx.zeros((1, 64)),
                *(
                    list(t)
                    for t in zip(
                        quantized(8, 64, 4, 64, mx.float32, 1),
                        quantized(8, 64, 4, 64, mx.bfloat16, 2),
                        strict=True,
                    )
                ),
                4,
                64,
            ),
            "scale dtype",
        ),
    ],
)
def test_multi_output_products_refuse_what_they_cannot_share(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def native_linears(*sizes, bits=4, bias=False, K=64):
    mods = [nn.Linear(K, n, bias=bias) for n in sizes]
    out = []
    for m in mods:
        mx.eval(m.parameters())
        m = nn.QuantizedLinear.from_linear(m, group_size=32, bits=bits) if bits else m
        layers.swap_in(m, mx.float32)
        out.append(m)
    return out


def test_project_runs_linears_read_the_same_way_as_one_node(tmp_path):
    from mlx_loom.nn import project

    x = rand((1, 2, 64), seed=26)
    q, k, v = native_linears(32, 16, 16)
    outs = project(x, q, k, v)
    names = labels(mx.concatenate(outs, axis=-1), tmp_path)
    assert names.count("LoomMultiAffineMatmul") == 1 and "LoomAffineMatmul" not in names
    for out, m in zip(outs, (q, k, v), strict=True):
        assert_bit_equal(out, m(x))


@pytest.mark.parametrize(
    "mods",
    [
        lambda: native_linears(32, 16, bits=4) + native_linears(16, bits=8),
        lambda: native_linears(32) + native_linears(16, bits=0),
        lambda: native_linears(32, 16, bias=True),
        lambda: native_linears(32),
        lambda: [nn.Linear(64, 32), nn.Linear(64, 16)],
    ],
    ids=["mixed-widths", "mixed-kinds", "biases", "one", "not-native"],
)
def test_project_calls_each_layer_where_they_are_not_read_the_same_way(mods, tmp_path):
    from mlx_loom.nn import project

    layers_ = mods()
    x = rand((1, 1, 64), seed=27)
    outs = project(x, *layers_)
    assert len(outs) == len(layers_)
    assert not any(n.startswith("LoomMulti") for n in labels(outs[0], tmp_path))
    for out, m in zip(outs, layers_, strict=True):
        assert_bit_equal(out, m(x))


# --- log-softmax ---------------------------------------------------------------


def mlx_log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("V", [1, 7, 255, 256, 257, 8192, 32000])
@pytest.mark.parametrize("scale", [0.1, 4.0, 60.0, 400.0])
def test_log_softmax_equals_mlx_bit_for_bit(V, scale):
    x = rand((3, V), seed=21, scale=scale)
    assert_bit_equal(nat.log_softmax(x), mlx_log_softmax(x))


@pytest.mark.parametrize(
    "row",
    [
        [np.inf, 1.0, 2.0],
        [-np.inf, -np.inf, -np.inf],
        [np.nan, 1.0, 2.0],
        [1.0, 2.0, np.nan],
        [-np.inf, 0.0, 5.0],
        [0.0, -0.0, 0.0],
        [3.4e38, -3.4e38, 1.0],
    ],
)
def test_log_softmax_keeps_mlx_results_for_infinite_and_nan_logits(row):
    x = mx.array(np.array([row * 5], np.float32))  # 15 columns: lanes and a tail
    assert_bit_equal(nat.log_softmax(x), mlx_log_softmax(x))


def test_log_softmax_rows_are_independent_and_shape_is_kept():
    x = rand((2, 3, 1000), seed=22, scale=5.0)
    got = nat.log_softmax(x)
    assert_bit_equal(got, mlx_log_softmax(x))
    assert_bit_equal(got[1, 2], nat.log_softmax(x[1, 2]))


def test_log_softmax_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float32"):
        nat.log_softmax(mx.zeros((2, 8), mx.bfloat16))


def test_logprobs_take_the_native_kernel_only_inside_native_kernels(tmp_path):
    from mlx_loom.engine.sampling import logprobs_from_logits

    logits = rand((2, 500), seed=23, scale=3.0)
    assert "LoomLogSoftmax" not in labels(logprobs_from_logits(logits), tmp_path)
    with forward_kernels("cpu-native-int8-act"):
        inside = logprobs_from_logits(logits)
        assert "LoomLogSoftmax" in labels(inside, tmp_path)
        half = logprobs_from_logits(logits.astype(mx.bfloat16))
        assert "LoomLogSoftmax" not in labels(half, tmp_path)
    assert_bit_equal(inside, mlx_log_softmax(logits))


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "gemma4_text"])
def test_the_engine_reports_mlx_log_probabilities_on_the_native_kernels(
    family, checkpoints, monkeypatch
):
    import importlib

    import mlx_loom
    from mlx_loom.generation.loop import generate_tokens

    sampling = importlib.import_module("mlx_loom.engine.sampling")
    model, _ = mlx_loom.load(
        checkpoints(family, "q4"), compute_dtype="float32", cpu_kernels="cpu-native"
    )
    used = []
    kernel = ops.log_softmax
    monkeypatch.setattr(ops, "log_softmax", lambda x: used.append(x.shape) or kernel(x))

    def run():
        steps = generate_tokens(model, [1, 2, 3], model.make_cache(), max_tokens=6)
        return [(token, np.asarray(lp)) for token, lp in steps]

    native_run = run()
    assert len(used) == 6
    monkeypatch.setattr(sampling, "current_log_softmax", lambda: None)
    plain_run = run()
    assert len(used) == 6
    assert [t for t, _ in native_run] == [t for t, _ in plain_run]
    for (_, a), (_, b) in zip(native_run, plain_run, strict=True):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))

"""The native CPU kernels against an fp64 reference, and the properties the engine relies on.

Bound (stated in ``core/csrc/kernels_avx2.cpp``): each weight becomes one fp32
value (bf16/fp16 exactly, an affine code as ``fma(scale, q, bias)``), products
accumulate in fp32, so ``|y - y64| <= K * 2^-23 * sum_k |x_k| |w_k|`` — the
classic dot-product bound with a factor 2 of margin — plus one rounding of
the output when it is bf16/fp16. For affine matrix-vector products the sum is
factored per group (``s * sum x q + b * sum x``), so the magnitude term is
``sum_k |x_k| (|s| q_k + |b|)``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_loom.cpu import native

from .conftest import needs_avx512, on_both_isas
from .test_model_parity import FAMILIES, greedy, ours

nat = native.module()
U = 2.0**-23
HALF_ULP = {mx.float32: 0.0, mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11}


def f64(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32), dtype=np.float64)


def assert_within_bound(y: mx.array, ref: np.ndarray, magnitude: np.ndarray, K: int) -> None:
    got = f64(y)
    tol = K * U * magnitude + HALF_ULP[y.dtype] * np.abs(ref) + 1e-30
    worst = np.max(np.abs(got - ref) / tol)
    assert worst <= 1.0, f"error {worst:.2f}x the bound"


def rand(shape, dtype=mx.float32, seed=0) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def quantized(N: int, K: int, bits: int, group_size: int, scale_dtype=mx.float32, seed=1):
    w = rand((N, K), seed=seed)
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    return wq, s.astype(scale_dtype), b.astype(scale_dtype)


# The matrix-vector kernel serves up to SMALL_ROWS rows, the GEMM the rest.
ROWS = [1, 3, nat.SMALL_ROWS, nat.SMALL_ROWS + 1, 40]


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("w_dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_dense_product_is_within_the_fp32_bound(M, w_dtype):
    N, K = 67, 300  # neither a multiple of 8: row and column tails
    x, w, bias = rand((M, K), seed=2), rand((N, K), w_dtype, seed=3), rand((N,), seed=4)
    y = nat.dense_matmul(x, w, bias)
    xs, ws = f64(x), f64(w)
    assert y.shape == (M, N) and y.dtype == mx.float32
    assert_within_bound(y, xs @ ws.T + f64(bias), np.abs(xs) @ np.abs(ws).T, K)


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_affine_product_is_within_the_fp32_bound(M, bits, group_size):
    N, K = 37, 384
    wq, s, b = quantized(N, K, bits, group_size, mx.bfloat16)
    x = rand((M, K), seed=5)
    y = nat.affine_matmul(x, wq, s, b, bits, group_size)
    q = f64(mx.dequantize(wq, mx.ones_like(s), mx.zeros_like(b), group_size=group_size, bits=bits))
    scale = np.repeat(f64(s), group_size, axis=1)
    offset = np.repeat(f64(b), group_size, axis=1)
    xs = f64(x)
    ref = xs @ (scale * q + offset).T
    assert_within_bound(y, ref, np.abs(xs) @ (np.abs(scale) * q + np.abs(offset)).T, K)


@pytest.mark.parametrize("M", [1, 5])
def test_4bit_rows_of_an_odd_number_of_32_groups_are_within_the_bound(M):
    # 4-bit codes are decoded 64 at a time; a row of 11 groups of 32 ends
    # with one 32-code block.
    N, K, group_size = 19, 352, 32
    wq, s, b = quantized(N, K, 4, group_size, mx.bfloat16)
    x = rand((M, K), seed=21)
    y = nat.affine_matmul(x, wq, s, b, 4, group_size)
    q = f64(mx.dequantize(wq, mx.ones_like(s), mx.zeros_like(b), group_size=group_size, bits=4))
    scale = np.repeat(f64(s), group_size, axis=1)
    offset = np.repeat(f64(b), group_size, axis=1)
    xs = f64(x)
    ref = xs @ (scale * q + offset).T
    assert_within_bound(y, ref, np.abs(xs) @ (np.abs(scale) * q + np.abs(offset)).T, K)


@pytest.mark.parametrize("M", [1, 20])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_affine_product_equals_mlx_quantized_matmul_within_the_bound(M, scale_dtype):
    N, K = 64, 256
    wq, s, b = quantized(N, K, 4, 64, scale_dtype)
    x = rand((M, K), seed=6)
    ours = nat.affine_matmul(x, wq, s, b, 4, 64)
    theirs = mx.quantized_matmul(x, wq, s, b, group_size=64, bits=4)
    assert ours.dtype == theirs.dtype
    deq = f64(mx.dequantize(wq, s, b, group_size=64, bits=4))
    magnitude = np.abs(f64(x)) @ np.abs(deq).T
    # Both sit within twice the bound of each other (MLX's own sum has one too).
    assert np.max(np.abs(f64(ours) - f64(theirs)) / (2 * 8 * K * U * magnitude)) <= 1.0


@pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [
        (mx.bfloat16, mx.bfloat16),
        (mx.float32, mx.bfloat16),
        (mx.bfloat16, mx.float32),
        (mx.float16, mx.float16),
        (mx.float16, mx.bfloat16),
    ],
    ids=str,
)
def test_output_dtype_follows_mlx_promotion(x_dtype, w_dtype):
    x, w = rand((2, 64), x_dtype), rand((8, 64), w_dtype)
    assert nat.dense_matmul(x, w).dtype == (x @ w.T).dtype


@pytest.mark.parametrize("M", [1, 5, 30])
def test_half_precision_output_is_the_fp32_result_rounded_once(M):
    x = rand((M, 128), mx.bfloat16)
    w = rand((48, 128), mx.bfloat16)
    exact = nat.dense_matmul(x.astype(mx.float32), w)
    assert mx.array_equal(nat.dense_matmul(x, w), exact.astype(mx.bfloat16))
    wq, s, b = quantized(48, 128, 4, 32, mx.bfloat16)
    exact_q = nat.affine_matmul(x.astype(mx.float32), wq, s, b, 4, 32)
    assert mx.array_equal(nat.affine_matmul(x, wq, s, b, 4, 32), exact_q.astype(mx.bfloat16))


@pytest.mark.parametrize("kind", ["dense-bf16", "affine-4", "affine-8"])
def test_small_batch_rows_equal_the_same_rows_alone(kind):
    # Batched decode and speculative verification must reproduce one-token decode.
    K, N = 256, 96
    x = rand((nat.SMALL_ROWS, K), seed=8)
    if kind == "dense-bf16":
        w = rand((N, K), mx.bfloat16)

        def run(a):
            return nat.dense_matmul(a, w)
    else:
        bits = int(kind.split("-")[1])
        wq, s, b = quantized(N, K, bits, 64, mx.bfloat16)

        def run(a, bits=bits):
            return nat.affine_matmul(a, wq, s, b, bits, 64)

    batch = run(x)
    for m in range(nat.SMALL_ROWS):
        assert mx.array_equal(batch[m], run(x[m : m + 1])[0]), f"row {m}"
    assert mx.array_equal(batch[2:5], run(x[2:5]))


def test_gemm_rows_do_not_depend_on_the_other_rows():
    K, N = 300, 150
    rows = 2 * nat.SMALL_ROWS + 5
    first = nat.SMALL_ROWS + 1  # the fewest rows that still take the GEMM
    x = rand((rows, K), seed=9)
    w = rand((N, K), mx.bfloat16)
    wq, s, b = quantized(N, 320, 4, 64)
    xq = rand((rows, 320), seed=10)
    assert mx.array_equal(nat.dense_matmul(x, w)[:first], nat.dense_matmul(x[:first], w))
    assert mx.array_equal(
        nat.affine_matmul(xq, wq, s, b, 4, 64)[5 : 5 + first],
        nat.affine_matmul(xq[5 : 5 + first], wq, s, b, 4, 64),
    )


def test_repeated_products_are_bit_identical():
    x, w = rand((1, 1024), seed=11), rand((2048, 1024), mx.bfloat16)
    first = nat.dense_matmul(x, w)
    for _ in range(5):
        assert mx.array_equal(nat.dense_matmul(x, w), first)


def test_leading_dimensions_and_strided_inputs_are_handled():
    x = rand((2, 3, 64), seed=12)
    w = rand((16, 64))
    y = nat.dense_matmul(x, w)
    assert y.shape == (2, 3, 16)
    assert mx.array_equal(y.reshape(6, 16), nat.dense_matmul(x.reshape(6, 64), w))
    strided = rand((64, 6), seed=13).T  # a transposed view, not row-contiguous
    assert mx.array_equal(nat.dense_matmul(strided, w), nat.dense_matmul(mx.array(strided), w))


def test_an_empty_batch_gives_an_empty_result():
    y = nat.dense_matmul(mx.zeros((0, 32)), rand((8, 32)))
    assert y.shape == (0, 8)


def test_the_kernels_run_inside_compiled_functions():
    w = rand((32, 64), mx.bfloat16)
    wq, s, b = quantized(32, 64, 8, 32)

    def step(x):
        return nat.dense_matmul(x, w) + nat.affine_matmul(x, wq, s, b, 8, 32)

    x = rand((3, 64), seed=14)
    assert mx.array_equal(mx.compile(step)(x), step(x))
    shapeless = mx.compile(step, shapeless=True)
    for rows in (1, 4):
        xr = rand((rows, 64), seed=rows)
        assert mx.array_equal(shapeless(xr), step(xr))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: nat.dense_matmul(mx.zeros((1, 8)), mx.zeros((4, 16))), "columns"),
        (lambda: nat.dense_matmul(mx.zeros((1, 8), mx.int32), mx.zeros((4, 8))), "float32"),
        (lambda: nat.dense_matmul(mx.zeros((1, 8)), mx.zeros((4, 8)), mx.zeros((3,))), "bias"),
        (lambda: nat.dense_matmul(mx.zeros((1, 8)), mx.zeros((8,))), "2-D"),
        (
            lambda: nat.affine_matmul(
                mx.zeros((1, 64)), *quantized(8, 64, 4, 32), bits=7, group_size=32
            ),
            "bits",
        ),
        (
            lambda: nat.affine_matmul(
                mx.zeros((1, 64)), *quantized(8, 64, 4, 32), bits=4, group_size=48
            ),
            "group size",
        ),
        (
            lambda: nat.affine_matmul(
                mx.zeros((1, 64)), *quantized(8, 64, 4, 32), bits=4, group_size=64
            ),
            "scales",
        ),
    ],
)
def test_bad_inputs_are_refused_with_what_was_wrong(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_cpu_features_report_what_the_kernels_need():
    features = native.cpu_features()
    assert set(native.REQUIRED_INSTRUCTIONS) <= set(features)
    assert native.unavailable_reason() is None
    assert nat.threads() >= 1


# --- 4-bit matrix-vector products on AVX-512 ----------------------------------


@needs_avx512
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_avx512_fp32_4bit_products_give_the_avx2_results_bit_for_bit(isa, group_size, scale_dtype):
    # Every row count the matrix-vector kernel serves (passes of eight and
    # every remainder), rows ending in an odd group of 32 (K % 64 == 32),
    # half-precision activations and outputs, and a bias.
    rng = np.random.default_rng(group_size)
    widths = [group_size, 3 * group_size, 1024, 2816] + ([96, 1056] if group_size == 32 else [])
    for trial, K in enumerate(widths):
        N = 37 if trial % 2 else 130
        wq, s, b = quantized(N, K, 4, group_size, scale_dtype, seed=trial)
        bias = rand((N,), seed=3)
        for M in list(range(1, 10)) + [15, 16, 17, nat.SMALL_ROWS]:
            dtype = [mx.float32, mx.bfloat16, mx.float16][int(rng.integers(0, 3))]
            x = rand((M, K), dtype, seed=100 * trial + M)
            a, v = on_both_isas(isa, lambda: nat.affine_matmul(x, wq, s, b, 4, group_size, bias))
            assert a.dtype == v.dtype
            assert mx.array_equal(a, v), (K, M, dtype)


@needs_avx512
@pytest.mark.parametrize("kind", ["f32", "bf16", "f16", "q4", "q8"])
def test_the_avx512_gemm_gives_the_avx2_results_bit_for_bit(isa, kind):
    # Past SMALL_ROWS rows the blocked GEMM runs (a prefill): on AVX-512 its
    # micro-kernel takes twelve rows and two panels (32 weight rows) at a
    # time, on AVX2 six rows and one panel. Row counts that leave every
    # remainder of twelve, weight rows that end in a lone panel or a
    # partial one, widths with a last short slice of K, and a bias: every
    # output is the same chain of multiply-adds, so the same bits.
    rng = np.random.default_rng(len(kind))
    for trial, (M, N, K) in enumerate(
        [(nat.SMALL_ROWS + 1, 37, 320), (45, 130, 1088), (100, 16, 64), (131, 300, 512)]
    ):
        w = rand((N, K), seed=trial) * 0.05
        bias = rand((N,), seed=7) if trial % 2 else None
        x = rand((M, K), [mx.float32, mx.bfloat16][int(rng.integers(0, 2))], seed=50 + trial)
        if kind in ("q4", "q8"):
            bits = 4 if kind == "q4" else 8
            wq, s, b = mx.quantize(w, group_size=64, bits=bits)
            run = lambda: nat.affine_matmul(x, wq, s, b, bits, 64, bias)  # noqa: E731
        else:
            wd = w.astype({"f32": mx.float32, "bf16": mx.bfloat16, "f16": mx.float16}[kind])
            run = lambda: nat.dense_matmul(x, wd, bias)  # noqa: E731
        a, v = on_both_isas(isa, run)
        assert mx.array_equal(a, v), (kind, M, N, K)


@needs_avx512
@pytest.mark.parametrize("M", [1, 3, 9])
def test_the_fused_and_routed_4bit_products_reach_the_avx512_kernel_alike(isa, M):
    K, N, E = 192, 48, 4
    x = rand((M, K), seed=9)
    g, gs, gb = quantized(N, K, 4, 64, mx.bfloat16, seed=2)
    u, us, ub = quantized(N, K, 4, 64, mx.bfloat16, seed=3)
    for gelu in (False, True):
        gated = on_both_isas(
            isa, lambda: nat.gated_affine_matmul(x, g, gs, gb, u, us, ub, 4, 64, False, gelu)
        )
        assert mx.array_equal(*gated)
    multi = on_both_isas(
        isa, lambda: mx.stack(nat.multi_affine_matmul(x, [g, u], [gs, us], [gb, ub], 4, 64, False))
    )
    assert mx.array_equal(*multi)
    wq, s, b = mx.quantize(rand((E, N, K), seed=4), group_size=64, bits=4)
    idx = mx.array(np.random.default_rng(M).integers(0, E, (M, 2)).astype(np.int32))
    routed = on_both_isas(
        isa, lambda: nat.gather_affine_matmul(x, idx, [wq], [s], [b], 4, 64, False)[0]
    )
    assert mx.array_equal(*routed)


@needs_avx512
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_decodes_the_same_logits_on_either_instruction_set(checkpoints, family, isa):
    path = checkpoints(family, "q4")
    runs = []
    for name in ("avx2", "avx512"):
        isa(name)
        model, make_cache = ours(path, "float32", "cpu-native")
        runs.append(greedy(model, make_cache))
    (tokens_a, steps_a), (tokens_b, steps_b) = runs
    assert tokens_a == tokens_b
    for i, (a, b) in enumerate(zip(steps_a, steps_b, strict=True)):
        assert mx.array_equal(a, b), f"step {i}"

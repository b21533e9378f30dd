"""The ``cpu-native-int8-act`` kernel set: 4-bit products against int8 activations.

What is claimed (``core/csrc/kernels.h``), and tested here:

* the arithmetic: each row of x is quantized per block of 32 columns,
  ``d = max|x| / 127``, ``x_q = rint(x * (127 / max|x|))`` clipped to
  +-127, and the product is ``(d * x_q) @ dequantize(W).T`` computed in
  fp32 — the kernel equals a float64 evaluation of exactly that within fp32
  rounding (``|err| <= K * 2^-23 * sum |x'| |w|``);
* the bound that follows: against the exact product of x itself, an output
  is off by at most ``sum_k |w_k| d_k / 2`` plus the same fp32 rounding;
* the engine's properties: rows of a batch equal the rows alone bit for bit,
  repeated products are bit-identical, and products over more than
  ``SMALL_ROWS`` rows (prefill) take int8 activations too, each row still
  equal to the row alone;
* the instruction sets: the AVX-512 VNNI kernel (where this CPU has it) gives
  the AVX2 kernel's results bit for bit, for the linears, the gated pair and
  the routed experts, and ``MLX_LOOM_CPU_ISA`` picks the set or is refused;
* per family (Llama, Qwen3-Next, Gemma 4, 4-bit checkpoints): the model on
  this set computes what its forward with that activation rounding put in
  front of every 4-bit product computes (the same graph with the rounding
  done by MLX ops and the fp32 kernel), and differs from ``cpu-native``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_loom.cpu import experts, layers, native, ops
from mlx_loom.cpu.path import resolve_cpu_path
from mlx_loom.nn import activations, norm, projections

from .conftest import AVX512, needs_avx512
from .conftest import on_both_isas as _both
from .test_model_parity import FAMILIES, greedy, max_relative_gap, ours

nat = native.module()
U = 2.0**-23


def rand(shape, seed, scale=1.0) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)) * scale


def quantized(N: int, K: int, group_size: int, scale_dtype=mx.float32, seed=1):
    wq, s, b = mx.quantize(rand((N, K), seed, 0.05), group_size=group_size, bits=4)
    return wq, s.astype(scale_dtype), b.astype(scale_dtype)


def dequantized(wq, s, b, group_size) -> np.ndarray:
    w = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size, bits=4)
    return np.asarray(w, dtype=np.float64)


def int8_rounded(x: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """x as the kernel sees it (``d * x_q``, float64) and the steps d per column."""
    x32 = np.asarray(x, dtype=np.float32)
    M, K = x32.shape
    blocks = x32.reshape(M, K // 32, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    step = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv), -127, 127)
    rounded = (q.astype(np.float64) * step.astype(np.float64)).reshape(M, K)
    steps = np.repeat(step[..., 0].astype(np.float64), 32, axis=1)
    return rounded, steps


def product(x, wq, s, b, group_size, int8=True):
    return nat.affine_matmul(x, wq, s, b, 4, group_size, None, int8)


SHAPES = [(1024, 64), (1024, 32), (1024, 128), (96, 32), (160, 32), (2816, 64)]


@pytest.mark.parametrize("K,group_size", SHAPES)
@pytest.mark.parametrize("M", [1, 3, nat.SMALL_ROWS, nat.SMALL_ROWS + 9])
def test_the_kernel_computes_the_stated_arithmetic(M, K, group_size):
    wq, s, b = quantized(67, K, group_size)
    x = rand((M, K), seed=M + K)
    got = np.asarray(product(x, wq, s, b, group_size), dtype=np.float64)
    w = dequantized(wq, s, b, group_size)
    rounded, _ = int8_rounded(x)
    tol = K * U * (np.abs(rounded) @ np.abs(w).T) + 1e-30
    worst = np.max(np.abs(got - rounded @ w.T) / tol)
    assert worst <= 1.0, f"error {worst:.2f}x the fp32 rounding bound"


@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("K,group_size", SHAPES)
def test_the_error_against_the_exact_product_is_within_the_stated_bound(K, group_size, scale_dtype):
    wq, s, b = quantized(50, K, group_size, scale_dtype)
    x = rand((4, K), seed=7)
    got = np.asarray(product(x, wq, s, b, group_size), dtype=np.float64)
    w = dequantized(wq, s, b, group_size)
    x64 = np.asarray(x, dtype=np.float64)
    _, steps = int8_rounded(x)
    bound = (steps / 2) @ np.abs(w).T + K * U * (np.abs(x64) @ np.abs(w).T) * 1.01
    err = np.abs(got - x64 @ w.T)
    assert np.all(err <= bound)
    # and the rounding really happened: the fp32 kernel is far closer
    exact_err = np.abs(np.asarray(product(x, wq, s, b, group_size, int8=False)) - x64 @ w.T)
    assert err.max() > 100 * exact_err.max()


def test_zero_and_constant_blocks_are_exact():
    K = 128
    wq, s, b = quantized(16, K, 64)
    x = mx.concatenate([mx.zeros((1, 64)), mx.full((1, 64), 0.5)], axis=1)
    got = np.asarray(product(x, wq, s, b, 64), dtype=np.float64)
    ref = np.asarray(x, dtype=np.float64) @ dequantized(wq, s, b, 64).T
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("M", [1, 3, nat.SMALL_ROWS + 9])  # AVX2 one row, AVX-512 passes, blocked
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_activation_makes_its_row_nan_and_leaves_the_others_alone(M, bad):
    # Over float activations a NaN or an infinity reaches every output of its
    # row; quantized, it must not vanish into a finite block (a NaN is never
    # a block's maximum), so its block's step carries it.
    wq, s, b = quantized(33, 256, 64, mx.bfloat16)
    x = np.asarray(rand((M, 256), seed=3))
    row = M // 2
    x[row, 77] = bad
    got = np.asarray(product(mx.array(x), wq, s, b, 64))
    assert np.isnan(got[row]).all()
    clean = [m for m in range(M) if m != row]
    assert np.isfinite(got[clean]).all()
    for m in clean[:3]:
        alone = np.asarray(product(mx.array(x[m : m + 1]), wq, s, b, 64))
        assert np.array_equal(got[m : m + 1], alone)


@pytest.mark.parametrize("K", [1024, 2816, 160])
@pytest.mark.parametrize("M", [2, 16, 17, 33])
def test_every_set_of_activation_rows_gives_each_row_its_result_alone(M, K):
    # Many rows are taken in sets sized by K (each tile of weight rows is
    # read once per set); a row's bits never depend on its set or its place.
    wq, s, b = quantized(37, K, 32, mx.bfloat16, seed=K)
    x = rand((M, K), seed=M + 5)
    batch = product(x, wq, s, b, 32)
    for m in range(M):
        assert mx.array_equal(batch[m : m + 1], product(x[m : m + 1], wq, s, b, 32)), m


def test_batch_rows_equal_the_rows_alone_bit_for_bit():
    wq, s, b = quantized(70, 1024, 64, mx.bfloat16)
    x = rand((7, 1024), seed=11)
    batch = product(x, wq, s, b, 64)
    for m in range(7):
        assert mx.array_equal(batch[m : m + 1], product(x[m : m + 1], wq, s, b, 64))
    assert mx.array_equal(batch, product(x, wq, s, b, 64))


def test_prefill_sized_products_take_int8_activations_row_by_row():
    # Above SMALL_ROWS the same kernel runs over blocks of weight rows (a
    # prefill chunk): every row still equals the row alone, so chunked
    # prefill and batched rows reproduce one-row products bit for bit.
    wq, s, b = quantized(41, 256, 64, mx.bfloat16)
    M = 2 * nat.SMALL_ROWS + 3
    x = rand((M, 256), seed=5)
    batch = product(x, wq, s, b, 64)
    for m in (0, 1, nat.SMALL_ROWS, M - 1):
        assert mx.array_equal(batch[m : m + 1], product(x[m : m + 1], wq, s, b, 64))
    assert mx.array_equal(batch[:7], product(x[:7], wq, s, b, 64))
    assert not mx.array_equal(batch, product(x, wq, s, b, 64, int8=False))


def test_other_widths_are_refused_by_name():
    w = rand((8, 64), seed=2)
    wq, s, b = mx.quantize(w, group_size=32, bits=8)
    with pytest.raises(ValueError, match="int8 activations are implemented for 4-bit"):
        nat.affine_matmul(rand((1, 64), seed=3), wq, s, b, 8, 32, None, True)


# --- the kernel set --------------------------------------------------------


def test_the_set_is_resolved_by_name_and_never_by_default():
    assert resolve_cpu_path("cpu").kernel_set == "cpu-native"
    path = resolve_cpu_path("cpu", cpu_kernels="cpu-native-int8-act")
    assert path.kernel_set == "cpu-native-int8-act"
    assert path.threads == native.threads()
    assert "cpu-native-int8-act, " in path.describe_kernels()
    assert path.isa == native.cpu_isa()
    assert f"int8 products on {path.isa}" in path.describe_kernels()


def test_only_4bit_modules_are_marked():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.four = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4)
            self.eight = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=8)
            self.embed = nn.QuantizedEmbedding(32, 64, group_size=32, bits=4)

    from mlx_loom.cpu.path import apply_cpu_path

    model = Mixed()
    apply_cpu_path(model, resolve_cpu_path("cpu", cpu_kernels="cpu-native-int8-act"))
    assert model.four.int8_activations and model.embed.int8_activations
    assert not model.eight.int8_activations
    other = Mixed()
    apply_cpu_path(other, resolve_cpu_path("cpu", cpu_kernels="cpu-native"))
    assert not other.four.int8_activations


def _rounding_in_front_of_every_4bit_product(monkeypatch) -> None:
    """Make ``cpu-native`` 4-bit modules round their input as the int8 set does, with MLX ops."""

    def every_row_rounded(x: mx.array) -> mx.array:
        K = x.shape[-1]
        blocks = x.astype(mx.float32).reshape(*x.shape[:-1], K // 32, 32)
        amax = mx.max(mx.abs(blocks), axis=-1, keepdims=True)
        inv = mx.where(amax > 0, 127.0 / amax, 0.0)
        q = mx.clip(mx.round(blocks * inv), -127, 127)
        return (q * (amax / 127.0)).reshape(x.shape).astype(x.dtype)

    rounded = every_row_rounded  # every size: decode and prefill alike

    # The fp32 kernel on the rounded input: what the int8 kernel states it computes.
    linear = layers.NativeQuantizedLinear.__call__
    head = layers.NativeQuantizedEmbedding.as_linear
    monkeypatch.setattr(
        layers.NativeQuantizedLinear,
        "__call__",
        lambda self, x: linear(self, rounded(x) if self.bits == 4 else x),
    )
    monkeypatch.setattr(
        layers.NativeQuantizedEmbedding,
        "as_linear",
        lambda self, x: head(self, rounded(x) if self.bits == 4 else x),
    )
    # Gate and up, and q, k and v, as separate products, so that each passes
    # through the patched call (the fused nodes are bit-equal to them:
    # test_native_gates.py, test_native_kernels.py).
    monkeypatch.setattr(ops.NativeGatedMLP, "_gated", lambda self, x: None)
    monkeypatch.setattr(projections, "_joint", None)
    # Routed experts: each projection's gather on its own (the one-node layer
    # equals them: test_native_experts.py). Every row of a 4-bit expert
    # product takes int8 activations, whatever the rows per expert.
    gather = experts.NativeQuantizedSwitchLinear.gather
    monkeypatch.setattr(experts.NativeSwitchGLU, "_native", lambda self, x, indices: None)
    monkeypatch.setattr(
        experts.NativeQuantizedSwitchLinear,
        "gather",
        lambda self, x, i, s: gather(self, every_row_rounded(x) if self.bits == 4 else x, i, s),
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_computes_its_forward_with_int8_activations(checkpoints, family, monkeypatch):
    path = checkpoints(family, "q4")
    # The GeGLU gate stays MLX's in both runs (the native one is within a few
    # ulps of it: test_native_geglu.py). The emulation matches the int8
    # products to ~1e-7, not bit for bit, and the tiny random Gemma 4 turns
    # any such difference that flips one int8 rounding downstream into another
    # distribution: scaling MLX's gate by 1 - 1e-7 alone moves this gap from
    # 1e-6 to 0.34. Holding the gate fixed keeps the test on the products.
    monkeypatch.setattr(activations, "current_gelu_mul", lambda: None)
    monkeypatch.setattr(norm, "current_rms_norm", lambda: None)
    model, make_cache = ours(path, "float32", "cpu-native-int8-act")
    marked = [m for _, m in model.module.named_modules() if getattr(m, "int8_activations", False)]
    assert marked, "no 4-bit module runs on int8 activations"
    tokens, mine = greedy(model, make_cache)
    _, native_run = greedy(*ours(path, "float32", "cpu-native"), forced=tokens)
    with monkeypatch.context() as patch:
        _rounding_in_front_of_every_4bit_product(patch)
        _, emulated = greedy(*ours(path, "float32", "cpu-native"), forced=tokens)
    gap = max_relative_gap(mine, emulated)
    assert gap <= 1e-4
    assert max_relative_gap(mine, native_run) > 10 * max(gap, 1e-7)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_verify_window_equals_one_token_steps_bit_for_bit(checkpoints, family):
    # Each activation row is quantized on its own, so a speculative verify
    # window (several rows in one product) reproduces one-token decode.
    model, make_cache = ours(checkpoints(family, "q4"), "float32", "cpu-native-int8-act")
    window = [11, 23, 5, 77]
    stepped, windowed = make_cache(), make_cache()
    # 4 + 4 tokens: within the tiny Gemma 4's sliding window of 8. A window
    # that crosses the wrap of a rotating cache reads its keys in another
    # order than the one-token steps (temporal vs ring), so attention's sums
    # differ in the last bits there -- already the input of layer 0's experts
    # differed by ~6e-7 with MLX's gather_qmm; this test is about products.
    model(mx.array([[1, 5, 7, 42]]), cache=stepped)
    model(mx.array([[1, 5, 7, 42]]), cache=windowed)
    steps = [model(mx.array([[t]]), cache=stepped)[0, -1] for t in window]
    together = model(mx.array([window]), cache=windowed)[0]
    for i, logits in enumerate(steps):
        assert mx.array_equal(together[i], logits), f"position {i}"


# --- the instruction sets --------------------------------------------------



@needs_avx512
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_avx512_vnni_gives_the_avx2_results_bit_for_bit(isa, group_size, scale_dtype):
    rng = np.random.default_rng(group_size)
    for trial in range(8):
        # Widths with a last odd group of 32 (group size 32), odd and even
        # weight rows, every row count from decode (1) to a prefill chunk.
        K = group_size * int(rng.integers(1, 5)) + (32 if group_size == 32 and trial % 2 else 0)
        N = int(rng.integers(1, 24)) if trial % 3 else 131  # odd, past a block of 64 rows
        # (One row reaches the AVX-512 kernel because the set is named; 10
        # and 14 reach its passes of 2 and 6 rows after a full pass of 8.)
        M = [1, 2, 3, 4, 5, 7, 8, 10, 13, 14, 31, nat.SMALL_ROWS, nat.SMALL_ROWS + 1, 77][
            (trial + group_size) % 14
        ]
        wq, s, b = quantized(N, K, group_size, scale_dtype, seed=trial)
        x = rand((M, K), seed=100 + trial)
        bias = rand((N,), seed=3)
        a, v = _both(isa, lambda: nat.affine_matmul(x, wq, s, b, 4, group_size, bias, True))
        assert mx.array_equal(a, v), (M, N, K)
        # every row of the many-row call equals that row alone, on both sets
        row = M // 2
        alone = nat.affine_matmul(x[row : row + 1], wq, s, b, 4, group_size, bias, True)
        assert mx.array_equal(v[row : row + 1], alone)


@needs_avx512
@pytest.mark.parametrize("K", [992, 1024, 1056, 1088, 2048])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_avx512_tiles_and_passes_give_the_avx2_bits(isa, K, scale_dtype):
    # The AVX-512 kernel takes sixteen weight rows at a time (37 rows: two
    # whole tiles and a last one of 5, padded), passes of up to eight
    # activation rows (from the ninth row on, the later passes reuse the
    # codes the first one transposed) and blocks of 32 columns, the last
    # one alone at 992 and 1056 columns. Every case gives AVX2's bits, at
    # every row count a decode batch has. A tile's scale and bias tables take
    # whole blocks of sixteen groups in one transpose and the rest eight rows
    # at a time: 16 and 32 groups (1024, 2048) are whole blocks, 17, 31 and
    # 33 leave 1, 15 and 1, in each dtype scales are stored in.
    group_size = 32 if K % 64 else 64
    wq, s, b = quantized(37, K, group_size, scale_dtype, seed=K)
    for M in (1, 2, 3, 5, 8, 9, 16, 17, 23, 31):
        x = rand((M, K), seed=M)
        a, v = _both(isa, lambda: nat.affine_matmul(x, wq, s, b, 4, group_size, None, True))
        assert mx.array_equal(a, v), (M, K)


@needs_avx512
@pytest.mark.parametrize("M", [1, 9, nat.SMALL_ROWS + 5])
def test_the_fused_nodes_and_routed_experts_reach_the_avx512_kernel_alike(isa, M):
    K, N, E = 128, 48, 4
    x = rand((M, K), seed=9)
    g, gs, gb = quantized(N, K, 32, seed=2)
    u, us, ub = quantized(N, K, 32, seed=3)
    gated = _both(isa, lambda: nat.gated_affine_matmul(x, g, gs, gb, u, us, ub, 4, 32, True))
    assert mx.array_equal(*gated)
    multi = _both(
        isa, lambda: mx.stack(nat.multi_affine_matmul(x, [g, u], [gs, us], [gb, ub], 4, 32, True))
    )
    assert mx.array_equal(*multi)
    wq, s, b = mx.quantize(rand((E, N, K), seed=4, scale=0.05), group_size=32, bits=4)
    idx = mx.array(np.random.default_rng(M).integers(0, E, (M, 2)).astype(np.int32))
    routed = _both(isa, lambda: nat.gather_affine_matmul(x, idx, [wq], [s], [b], 4, 32, True)[0])
    assert mx.array_equal(*routed)
    assert not mx.array_equal(
        routed[0], nat.gather_affine_matmul(x, idx, [wq], [s], [b], 4, 32, False)[0]
    )


def test_the_instruction_set_is_switched_by_name_and_refused_otherwise(isa):
    assert isa("avx2") == "avx2" and nat.cpu_isa() == "avx2"
    assert isa("auto") == ("avx512-vnni" if AVX512 else "avx2")
    with pytest.raises(ValueError, match="must be auto, avx2 or avx512"):
        isa("sse2")
    if not AVX512:
        with pytest.raises(ValueError, match="lacks AVX-512"):
            isa("avx512")


def _cpu_identity() -> tuple[str, int] | None:
    """This CPU's vendor string and display family, as Linux reports them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    fields = dict(
        (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in text.splitlines())
    )
    if "vendor_id" not in fields or "cpu family" not in fields:
        return None
    return fields["vendor_id"], int(fields["cpu family"])


def test_one_row_takes_avx512_by_the_cpu_rule_or_when_named(isa):
    # The rule as data: AMD's Zen 5 and later (512-bit vector units) run one
    # activation row on AVX-512; Zen 4, which splits 512-bit operations, and
    # Intel do not. Only time depends on it: the bits are the same.
    rule = nat.one_row_avx512_for
    assert rule("AuthenticAMD", 0x1A) and rule("AuthenticAMD", 0x1B)
    assert not rule("AuthenticAMD", 0x19) and not rule("AuthenticAMD", 0x17)
    assert not rule("GenuineIntel", 6) and not rule("GenuineIntel", 0x1A) and not rule("", 0)
    identity = _cpu_identity()
    isa("auto")
    if identity is not None:
        assert nat.one_row_avx512() == rule(*identity)
    shown = resolve_cpu_path("cpu", cpu_kernels="cpu-native-int8-act").describe_kernels()
    assert ("(one row on avx2)" in shown) == (AVX512 and not nat.one_row_avx512())
    if AVX512:
        isa("avx512")
        assert nat.one_row_avx512()


@pytest.mark.parametrize("value,expected", [("avx2", "avx2"), ("avx9", None)])
def test_the_environment_variable_picks_the_set_or_is_refused(value, expected):
    # A fresh process: the variable is read once, at first use.
    code = (
        "from mlx_loom.cpu.path import resolve_cpu_path\n"
        "from mlx_loom.errors import KernelUnavailable\n"
        "try:\n"
        "    p = resolve_cpu_path('cpu', cpu_kernels='cpu-native-int8-act')\n"
        "    print('isa', p.isa, p.describe_kernels())\n"
        "except KernelUnavailable as e:\n"
        "    print('refused', e)\n"
    )
    env = dict(os.environ, MLX_LOOM_CPU_ISA=value)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    if expected is None:
        assert out.startswith("refused") and "MLX_LOOM_CPU_ISA" in out and "avx9" in out
    else:
        assert out.startswith(f"isa {expected} ") and f"int8 products on {expected}" in out

"""Routed experts on the native kernels (``mlx_loom.cpu.experts``).

The gathered node groups the (token, expert) pairs by expert and runs each
expert's rows through the native linears' kernels, so the claims are:

* bit-equal to ``dense_matmul`` / ``affine_matmul`` (and the gated product)
  of each expert's rows — sorted or unsorted indices, batches, prefill
  lengths where an expert gets more than ``SMALL_ROWS`` rows (the GEMM;
  with int8 activations the int8 kernel at every row count);
* within the native products' fp32 bound of MLX's ``gather_mm`` /
  ``gather_qmm`` (what the native linears hold against ``quantized_matmul``);
* the SwiGLU layer as one node equals the unfused native products and gate;
* whole models (Qwen3-Next, Gemma 4 MoE, Qwen3-MoE) keep mlx-lm's greedy tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_loom.cpu import experts as expert_swaps
from mlx_loom.cpu import native
from mlx_loom.cpu.experts import (
    NativeQuantizedSwitchLinear,
    NativeSwitchGLU,
    NativeSwitchLinear,
)
from mlx_loom.cpu.layers import native_modules, swap_in
from mlx_loom.host import resolve_model
from mlx_loom.loader import build_model
from mlx_loom.nn import SwitchGLU, geglu, gather_switch_glu, swiglu

nat = native.module()
U = 2.0**-23
E, K, N = 6, 128, 48
H = 64  # the GLU layers' expert width (a whole group for the down product)


def rand(shape, dtype=mx.float32, seed=0) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def f64(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32), dtype=np.float64)


def routes(T: int, k: int, seed: int, sort: bool = False) -> mx.array:
    """k distinct experts per token (as a router picks), optionally sorted per token."""
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.uint32)
    return mx.array(np.sort(idx, axis=1) if sort else idx)


def stack(kind: str, n: int = N, k: int = K, seed: int = 1):
    """``(weights, call)``: a stacked weight and ``call(x, w_of_expert) -> x @ w.T`` natively."""
    if kind.startswith("dense"):
        dtype = {"dense-f32": mx.float32, "dense-bf16": mx.bfloat16}[kind]
        w = rand((E, n, k), dtype, seed)
        return (w,), lambda x, e: nat.dense_matmul(x, w[e])
    bits = int(kind.split("-")[1])
    wq, s, b = mx.quantize(rand((E * n, k), seed=seed), group_size=64, bits=bits)
    wq, s, b = (a.reshape(E, n, -1) for a in (wq, s, b))
    s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    return (wq, s, b), lambda x, e: nat.affine_matmul(x, wq[e], s[e], b[e], bits, 64)


def gathered(kind: str, x, idx, weights, **kw):
    if kind.startswith("dense"):
        return nat.gather_dense_matmul(x, idx, [weights[0]], **kw)[0]
    bits = int(kind.split("-")[1])
    wq, s, b = weights
    return nat.gather_affine_matmul(x, idx, [wq], [s], [b], bits, 64, **kw)[0]


def per_expert(x_rows: np.ndarray, pair_rows: np.ndarray, idx: np.ndarray, n: int, product):
    """The reference: each expert's pairs in pair order, one native call on their rows."""
    flat = idx.reshape(-1)
    out: dict[int, mx.array] = {}
    for e in np.unique(flat):
        pairs = np.flatnonzero(flat == e)
        y = product(x_rows[mx.array(pair_rows[pairs].astype(np.int32))], int(e))
        for i, p in enumerate(pairs):
            out[int(p)] = y[i]
    return mx.stack([out[p] for p in range(flat.size)]).reshape(*idx.shape, n)


KINDS = ["dense-f32", "dense-bf16", "affine-2", "affine-3", "affine-4", "affine-5", "affine-6", "affine-8"]


# 1 token (decode), 3 (a batch), 40 tokens x 4 experts over 6 (prefill: some
# experts get more than SMALL_ROWS rows and take the GEMM).
@pytest.mark.parametrize("T,k", [(1, 4), (3, 2), (40, 4)])
@pytest.mark.parametrize("kind", KINDS)
def test_gathered_product_equals_the_native_product_of_each_experts_rows(kind, T, k):
    weights, product = stack(kind)
    x = rand((T, K), seed=T)
    idx = routes(T, k, seed=T)
    y = gathered(kind, x, idx, weights)
    assert y.shape == (T, k, N) and y.dtype == mx.float32
    token_of_pair = np.repeat(np.arange(T), k)
    assert mx.array_equal(y, per_expert(x, token_of_pair, np.asarray(idx), N, product))
    # One row per pair (the down projection's input) and int32 indices.
    xp = rand((T, k, K), seed=T + 1)
    yp = gathered(kind, xp, idx.astype(mx.int32), weights)
    ref = per_expert(xp.reshape(-1, K), np.arange(T * k), np.asarray(idx), N, product)
    assert mx.array_equal(yp, ref)


def test_int8_experts_take_the_int8_kernel_at_every_row_count():
    # A prefill chunk: 64 tokens x 4 experts over 6, so some expert meets more
    # than SMALL_ROWS rows. Each expert's rows equal affine_matmul with int8
    # activations on them (the int8 kernel at any row count, as the linears),
    # not the fp32 GEMM.
    T, k = 64, 4
    (wq, s, b), _ = stack("affine-4")
    x = rand((T, K), seed=5)
    idx = routes(T, k, seed=5)
    assert np.bincount(np.asarray(idx).reshape(-1)).max() > nat.SMALL_ROWS
    y = nat.gather_affine_matmul(x, idx, [wq], [s], [b], 4, 64, int8_activations=True)[0]

    def int8_product(xr, e):
        return nat.affine_matmul(xr, wq[e], s[e], b[e], 4, 64, None, True)

    token_of_pair = np.repeat(np.arange(T), k)
    assert mx.array_equal(y, per_expert(x, token_of_pair, np.asarray(idx), N, int8_product))
    fp32 = nat.gather_affine_matmul(x, idx, [wq], [s], [b], 4, 64)[0]
    assert not mx.array_equal(y, fp32)


@pytest.mark.parametrize("sort", [False, True], ids=["unsorted", "sorted"])
@pytest.mark.parametrize("kind", ["dense-f32", "affine-4", "affine-8"])
def test_gathered_product_is_within_the_fp32_bound_of_mlx_gather(kind, sort):
    # B=2, L=9 (a batch of prefill rows), top-3; MLX's graph as mlx-lm runs it.
    weights, _ = stack(kind)
    x = rand((2, 9, K), seed=4)
    idx = routes(18, 3, seed=5, sort=sort).reshape(2, 9, 3)
    xe = mx.expand_dims(x, (-2, -3))
    if kind == "dense-f32":
        theirs = mx.gather_mm(xe, weights[0].swapaxes(-1, -2), rhs_indices=idx)
        deq = f64(weights[0])
    else:
        bits = int(kind.split("-")[1])
        wq, s, b = weights
        s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
        theirs = mx.gather_qmm(
            xe, wq, s32, b32, rhs_indices=idx, transpose=True, group_size=64, bits=bits
        )
        deq = f64(mx.dequantize(wq, s32, b32, group_size=64, bits=bits))
    ours = gathered(kind, x, idx, weights)
    theirs = theirs.squeeze(-2)
    assert ours.shape == theirs.shape
    experts = deq[np.asarray(idx).reshape(18, 3)]
    mag = np.einsum("tk,tpnk->tpn", np.abs(f64(x).reshape(18, K)), np.abs(experts))
    err = np.abs(f64(ours) - f64(theirs)).reshape(18, 3, N)
    # Both sums sit within the fp32 bound of the exact one: twice it apart.
    assert np.max(err / (2 * K * U * mag + 1e-30)) <= 1.0


def glu(kind: str, activation=swiglu, int8: bool = False, native_set: bool = True) -> SwitchGLU:
    """A SwitchGLU with random experts (the same for every call), swapped in as the
    native set does, or (``native_set=False``) as ``cpu-ops`` runs it in float32."""
    layer = SwitchGLU(K, H, E, kernel=gather_switch_glu, activation=activation)
    for i, name in enumerate(("gate_proj", "up_proj", "down_proj")):
        proj = getattr(layer, name)
        proj.weight = (rand(proj.weight.shape, seed=i) * 0.2).astype(mx.bfloat16)
        if kind.startswith("affine"):
            q = proj.to_quantized(group_size=64, bits=int(kind.split("-")[1]))
            q.scales, q.biases = q.scales.astype(mx.bfloat16), q.biases.astype(mx.bfloat16)
            setattr(layer, name, q)
    if not native_set:
        layer.set_dtype(mx.float32)
        return layer
    for _, mod in layer.named_modules():
        if type(mod) is SwitchGLU or type(mod) in expert_swaps.SWAPS:
            swap_in(mod, mx.float32, int8_activations=int8)
    return layer


@pytest.mark.parametrize("T", [1, 4, 40])
@pytest.mark.parametrize(
    "kind,int8", [("dense-bf16", False), ("affine-4", False), ("affine-4", True), ("affine-6", False)]
)
def test_the_swiglu_layer_is_one_node_equal_to_the_native_gated_and_down_products(kind, int8, T):
    layer = glu(kind, int8=int8)
    assert type(layer) is NativeSwitchGLU
    gate, up, down = layer.gate_proj, layer.up_proj, layer.down_proj
    x = rand((1, T, K), seed=7)
    idx = routes(T, 2, seed=8).reshape(1, T, 2)
    y = layer(x, idx)
    assert y.shape == (1, T, 2, K)

    def expert(xr, e):
        if isinstance(gate, NativeQuantizedSwitchLinear):
            h = nat.gated_affine_matmul(
                xr, gate.weight[e], gate.scales[e], gate.biases[e],
                up.weight[e], up.scales[e], up.biases[e], gate.bits, 64, gate.int8_activations,
            )
            return nat.affine_matmul(
                h, down.weight[e], down.scales[e], down.biases[e], down.bits, 64, None,
                down.int8_activations,
            )
        assert isinstance(gate, NativeSwitchLinear)
        return nat.dense_matmul(nat.gated_dense_matmul(xr, gate.weight[e], up.weight[e]), down.weight[e])

    ref = per_expert(x.reshape(-1, K), np.repeat(np.arange(T), 2), np.asarray(idx), K, expert)
    assert mx.array_equal(y, ref)
    if int8:  # the int8 set changes the numbers: not the fp32 node's
        assert gate.int8_activations and not mx.array_equal(y, glu(kind)(x, idx))


@pytest.mark.parametrize("activation", [swiglu, geglu], ids=["swiglu", "geglu"])
@pytest.mark.parametrize("kind", ["dense-bf16", "affine-4"])
def test_the_native_layer_stays_close_to_mlx_ops(kind, activation):
    # GeGLU (Gemma 4): gate+up one node, MLX's activation, down one node.
    layer = glu(kind, activation)
    x = rand((2, 5, K), seed=9)
    idx = routes(10, 3, seed=10).reshape(2, 5, 3)
    ours = layer(x, idx)
    theirs = glu(kind, activation, native_set=False)(x, idx)
    scale = float(mx.max(mx.abs(theirs)).item())
    assert float(mx.max(mx.abs(ours - theirs)).item()) <= 1e-5 * scale


def test_a_decode_batch_reproduces_each_token_alone():
    layer = glu("affine-4")
    x = rand((8, 1, K), seed=11)
    idx = routes(8, 3, seed=12).reshape(8, 1, 3)
    batch = layer(x, idx)
    for b in range(8):
        assert mx.array_equal(batch[b], layer(x[b : b + 1], idx[b : b + 1])[0]), b


def test_an_index_outside_the_stack_gives_nan_rows_not_a_read_outside_it():
    (w,), _ = stack("dense-f32")
    idx = mx.array([[1, E + 3]], dtype=mx.uint32)
    y = nat.gather_dense_matmul(rand((1, K)), idx, [w])[0]
    assert not mx.any(mx.isnan(y[0, 0])).item() and mx.all(mx.isnan(y[0, 1])).item()


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda w: nat.gather_dense_matmul(mx.zeros((2, K)), mx.zeros((2, 2)), [w]), "indices"),
        (lambda w: nat.gather_dense_matmul(mx.zeros((3, K)), mx.zeros((2, 2), mx.uint32), [w]), "rows"),
        (lambda w: nat.gather_dense_matmul(mx.zeros((2, 7)), mx.zeros((2, 2), mx.uint32), [w]), "x must"),
        (lambda w: nat.gather_dense_matmul(mx.zeros((2, K)), mx.zeros((2, 1), mx.uint32), [w[0]]), "3-D"),
        (
            lambda w: nat.gather_dense_matmul(
                mx.zeros((2, K), mx.bfloat16), mx.zeros((2, 1), mx.uint32), [w, w], gated=True
            ),
            "float32 x",
        ),
    ],
)
def test_bad_inputs_are_refused_with_what_was_wrong(call, match):
    with pytest.raises(ValueError, match=match):
        call(mx.zeros((E, N, K)))


def test_the_node_runs_inside_compiled_functions():
    layer = glu("affine-4")
    x = rand((1, 1, K), seed=13)
    idx = routes(1, 2, seed=14).reshape(1, 1, 2)
    assert mx.array_equal(mx.compile(layer)(x, idx), layer(x, idx))


# --- whole models ------------------------------------------------------------------

GEMMA4_MOE = {
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 64,
}
PROMPT = [1, 5, 7, 42, 99, 3, 17, 200, 8, 64, 31, 2]


def greedy_tokens(model, make_cache, steps: int = 6) -> list[int]:
    cache = make_cache()
    logits = model(mx.array([PROMPT]), cache=cache)[:, -1, :]
    tokens = []
    for _ in range(steps):
        tokens.append(int(np.asarray(mx.argmax(logits, axis=-1)).reshape(-1)[0]))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[:, -1, :]
    return tokens


@pytest.mark.parametrize("kind", ["bf16", "q4"])
@pytest.mark.parametrize(
    "family,config",
    [("qwen3_next", {}), ("gemma4_text", GEMMA4_MOE), ("qwen3_moe", {})],
    ids=["qwen3_next", "gemma4", "qwen3_moe"],
)
def test_moe_models_on_native_experts_keep_mlx_lm_greedy_tokens(checkpoints, family, config, kind):
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    path = checkpoints(family, kind, **config)
    model = build_model(resolve_model(path, compute_dtype="float32", cpu_kernels="cpu-native"))
    counts = native_modules(model.module)
    assert counts.get("NativeSwitchGLU", 0) >= 1
    projections = "NativeQuantizedSwitchLinear" if kind == "q4" else "NativeSwitchLinear"
    assert counts.get(projections, 0) >= 2 * counts["NativeSwitchGLU"]
    oracle = load_model(path)[0]
    oracle.set_dtype(mx.float32)
    theirs = greedy_tokens(oracle, lambda: make_prompt_cache(oracle))
    assert greedy_tokens(model, model.make_cache) == theirs

"""The native norm, RoPE and attention against fp64 references, and how models pick them up.

Bounds (fp32 arithmetic, inputs converted exactly, outputs rounded once):
norm and attention are sums of at most ``n`` fp32 terms, within
``n * 2^-23`` of the magnitude of their terms; RoPE's angles are fp32
products ``position * inv_freq`` like MLX's, so its bound is the angle's
rounding times the position (plus the rotation's own few roundings). Half
precision outputs add one rounding (half an ulp of the result).
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_loom.cpu import native, ops
from mlx_loom.cpu.ops import forward_kernels
from mlx_loom.forward_hooks import current_attention

nat = native.module()
U = 2.0**-23
HALF_ULP = {mx.float32: 0.0, mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11}
# Half the spacing of float16's subnormals: the rounding of results below its normal range.
SUBNORMAL = {mx.float32: 0.0, mx.bfloat16: 0.0, mx.float16: 2.0**-25}


def f64(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32), dtype=np.float64)


def rand(shape, dtype=mx.float32, seed=0) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def worst(got: mx.array, ref: np.ndarray, tol: np.ndarray) -> float:
    tol = tol + HALF_ULP[got.dtype] * np.abs(ref) + SUBNORMAL[got.dtype] + 1e-30
    return float(np.max(np.abs(f64(got) - ref) / tol))


# --- RMS norm ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("width", [7, 64, 1000])
def test_rms_norm_is_within_the_fp32_bound(dtype, width):
    x, w = rand((3, 5, width), dtype, 1), rand((width,), dtype, 2)
    y = nat.rms_norm(x, w, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    xs, ws = f64(x), f64(w)
    inv = 1 / np.sqrt(np.mean(xs**2, axis=-1, keepdims=True) + 1e-5)
    ref = xs * inv * ws
    assert worst(y, ref, (width + 4) * U * np.abs(ref)) <= 1.0


def test_rms_norm_without_weight_and_against_mlx():
    x = rand((4, 96), seed=3)
    ours = nat.rms_norm(x, None, 1e-6)
    assert mx.allclose(ours, mx.fast.rms_norm(x, None, 1e-6), rtol=1e-5, atol=1e-6)


# --- RoPE -------------------------------------------------------------------


def rope_ref(x: np.ndarray, dims, traditional, inv_freq, scale, offsets) -> np.ndarray:
    out = x.copy()
    B, L = x.shape[0], x.shape[-2]
    for b in range(B):
        pos = (offsets[b if len(offsets) > 1 else 0] + np.arange(L)) * scale
        theta = pos[:, None] * inv_freq[None, :]
        c, s = np.cos(theta), np.sin(theta)
        if traditional:
            a, bb = x[b, ..., 0:dims:2], x[b, ..., 1:dims:2]
            out[b, ..., 0:dims:2] = a * c - bb * s
            out[b, ..., 1:dims:2] = a * s + bb * c
        else:
            h = dims // 2
            a, bb = x[b, ..., :h], x[b, ..., h:dims]
            out[b, ..., :h] = a * c - bb * s
            out[b, ..., h:dims] = a * s + bb * c
    return out


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])
@pytest.mark.parametrize("offsets", [[0], [37], [5, 300]])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_rope_is_within_the_bound(traditional, dims, offsets, dtype):
    x = rand((2, 3, 4, 64), dtype, 4)
    inv = 1.0 / (10000.0 ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
    y = nat.rope(x, dims, traditional, inv, 0.5, mx.array(offsets, dtype=mx.int32))
    ref = rope_ref(f64(x), dims, traditional, f64(inv), 0.5, offsets)
    max_pos = (max(offsets) + 4) * 0.5
    # angle rounding (relative 2^-23 of at most max_pos rad) plus the rotation
    tol = (max_pos * 2 + 8) * U * (np.abs(f64(x)).max())
    assert worst(y, ref, tol) <= 1.0
    assert mx.array_equal(y[..., dims:], x[..., dims:])


def test_rope_matches_mlx_fast_rope():
    x = rand((2, 4, 3, 64), seed=5)
    inv = 1.0 / (10000.0 ** (mx.arange(0, 64, 2, dtype=mx.float32) / 64))
    offsets = mx.array([2, 9], dtype=mx.int32)
    ours = nat.rope(x, 64, False, inv, 1.0, offsets)
    theirs = mx.fast.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=offsets)
    assert mx.allclose(ours, theirs, atol=1e-5)


# --- attention --------------------------------------------------------------


def attention_ref(q, k, v, scale, mask) -> np.ndarray:
    B, Hq, L, _ = q.shape
    rep = Hq // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("bhld,bhsd->bhls", q, k) * scale + mask
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return np.einsum("bhls,bhsd->bhld", p / p.sum(axis=-1, keepdims=True), v)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
@pytest.mark.parametrize("L", [1, 5])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_attention_is_within_the_fp32_bound(mask_kind, L, dtype):
    B, Hq, Hkv, S, D = 2, 8, 2, 19, 64
    q = rand((B, Hq, L, D), dtype, 6)
    # keys/values as a window of a longer buffer: strided, not contiguous
    k = rand((B, Hkv, S + 11, D), dtype, 7)[:, :, :S]
    v = rand((B, Hkv, S + 11, D), dtype, 8)[:, :, :S]
    additive = np.zeros((B, Hq, L, S))
    mask = None
    if mask_kind == "causal":
        mask = "causal"
        additive = np.where(np.arange(S)[None, :] <= S - L + np.arange(L)[:, None], 0, -np.inf)
    elif mask_kind == "bool":
        keep = np.random.default_rng(0).random((B, 1, L, S)) > 0.3
        keep[..., 0] = True
        mask = mx.array(keep)
        additive = np.where(keep, 0.0, -np.inf)
    elif mask_kind == "additive":
        add = np.random.default_rng(1).normal(size=(1, Hq, L, S)).astype(np.float32)
        mask = mx.array(add)
        additive = add.astype(np.float64)
    y = ops.attention(q, k, v, scale=0.125, mask=mask)
    assert y.dtype == dtype and y.shape == (B, Hq, L, D)
    ref = attention_ref(f64(q), f64(k), f64(v), 0.125, additive)
    tol = 4 * (D + S) * U * np.abs(f64(v)).max()
    assert worst(y, ref, tol) <= 1.0


def test_attention_matches_mlx_sdpa():
    q, k, v = (
        rand((1, 4, 3, 32), seed=9),
        rand((1, 4, 10, 32), seed=10),
        rand((1, 4, 10, 32), seed=11),
    )
    for mask in (None, "causal"):
        ours = ops.attention(q, k, v, scale=0.2, mask=mask)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
        assert mx.allclose(ours, theirs, atol=1e-5)


def test_attention_rows_of_a_batch_equal_the_rows_alone():
    q, k, v = (
        rand((3, 4, 1, 32), seed=12),
        rand((3, 2, 9, 32), seed=13),
        rand((3, 2, 9, 32), seed=14),
    )
    batch = ops.attention(q, k, v, scale=0.3, mask=None)
    for i in range(3):
        alone = ops.attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], scale=0.3, mask=None)
        assert mx.array_equal(batch[i : i + 1], alone)


def test_a_fully_masked_row_comes_out_as_zeros_not_nan():
    q, k, v = rand((1, 1, 2, 8), seed=15), rand((1, 1, 4, 8), seed=16), rand((1, 1, 4, 8), seed=17)
    mask = mx.array([[[[True, True, False, False], [False, False, False, False]]]])
    y = ops.attention(q, k, v, scale=1.0, mask=mask)
    assert not mx.any(mx.isnan(y)).item()
    assert mx.array_equal(y[0, 0, 1], mx.zeros((8,)))


def test_a_nan_key_makes_the_rows_that_see_it_nan_in_decode_and_prefill_alike():
    # Key 33 of the first KV head is NaN: every query row of heads 0-1 that
    # sees it is NaN, by the one-row path (decode) and the blocked one
    # (prefill) alike; the rows before it and the other KV head's are finite.
    L, S, D = 12, 40, 16
    q = rand((1, 4, L, D), seed=40)
    k = np.array(rand((1, 2, S, D), seed=41))
    k[0, 0, 33, 3] = np.nan
    k, v = mx.array(k), rand((1, 2, S, D), seed=42)
    whole = ops.attention(q, k, v, scale=0.3, mask="causal")
    def row(i: int) -> mx.array:
        end = S - L + i + 1
        return ops.attention(q[:, :, i : i + 1], k[:, :, :end], v[:, :, :end], scale=0.3, mask=None)

    rows = mx.concatenate([row(i) for i in range(L)], axis=2)
    assert mx.array_equal(whole, rows, equal_nan=True)
    sees = np.arange(L) + S - L >= 33
    nan_rows = np.isnan(np.array(whole)).any(axis=-1)[0]
    assert (nan_rows[:2] == sees).all() and not nan_rows[2:].any()


def window_mask(L: int, S: int, window: int) -> mx.array:
    """Query l (at position S - L + l) sees the ``window`` keys up to its own."""
    qpos = mx.arange(S - L, S)[:, None]
    kpos = mx.arange(S)[None]
    return (qpos >= kpos) & (qpos < kpos + window)


@pytest.mark.parametrize("mask_kind", ["causal", "window", "additive"])
@pytest.mark.parametrize(
    "kv_dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["f32", "bf16", "f16"]
)
@pytest.mark.parametrize("L,S,D", [(37, 150, 64), (11, 2100, 8)])
def test_prefill_rows_equal_decode_rows_however_the_prompt_is_chunked(mask_kind, kv_dtype, L, S, D):
    """The tiled prefill computes each row exactly as decode does: whole, in
    chunks cut anywhere, or one row at a time, the outputs are bit-equal (what
    prefix reuse, chunked prefill and speculative verification rely on). S=2100
    with 8-row query blocks takes the path that recomputes scores."""
    q = rand((1, 4, L, D), seed=30)
    k = rand((1, 2, S + 5, D), kv_dtype, 31)[:, :, 2 : S + 2]  # a strided window
    v = rand((1, 2, S, D), kv_dtype, 32)
    add = mx.array(np.random.default_rng(2).normal(size=(1, 4, L, S)).astype(np.float32))

    def mask_for(l0: int, l1: int):
        end = S - L + l1  # keys the chunk's last query sees
        if mask_kind == "causal":
            return "causal" if l1 - l0 > 1 else None
        if mask_kind == "window":
            return window_mask(l1 - l0, end, 40)
        return add[:, :, l0:l1, :end]

    def chunk(l0: int, l1: int) -> mx.array:
        end = S - L + l1
        m = mask_for(l0, l1)
        if mask_kind == "additive":
            return ops.attention(q[:, :, l0:l1], k, v, scale=0.3, mask=add[:, :, l0:l1])
        return ops.attention(q[:, :, l0:l1], k[:, :, :end], v[:, :, :end], scale=0.3, mask=m)

    whole = chunk(0, L)
    cuts = [0, 3, L // 2, L // 2 + 1, L]
    pieces = mx.concatenate([chunk(a, b) for a, b in zip(cuts, cuts[1:])], axis=2)
    rows = mx.concatenate([chunk(i, i + 1) for i in range(L)], axis=2)
    assert mx.array_equal(whole, pieces)
    assert mx.array_equal(whole, rows)


@pytest.mark.parametrize("Hq,Hkv", [(8, 1), (12, 1), (6, 2), (16, 8), (5, 5)])
@pytest.mark.parametrize(
    "kv_dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["f32", "bf16", "f16"]
)
@pytest.mark.parametrize("masked", [False, True])
def test_decode_heads_sharing_a_kv_head_equal_each_head_alone(Hq, Hkv, kv_dtype, masked):
    """Decode runs the query heads of one key-value head together (up to
    eight: 12 heads of one KV head run as 8 and 4), each block of keys read
    once for the group. Every head's output equals that head computed alone,
    bit for bit, with or without a mask, at key counts with and without a
    last partial block of eight."""
    B, D, S = 3, 64, 83
    q = rand((B, Hq, 1, D), seed=40)
    k = rand((B, Hkv, S, D), kv_dtype, 41)
    v = rand((B, Hkv, S, D), kv_dtype, 42)
    mask = rand((B, Hq, 1, S), seed=43) if masked else None
    together = ops.attention(q, k, v, scale=0.125, mask=mask)
    rep = Hq // Hkv
    for h in range(Hq):
        hk = h // rep
        alone = ops.attention(
            q[:, h : h + 1],
            k[:, hk : hk + 1],
            v[:, hk : hk + 1],
            scale=0.125,
            mask=mask[:, h : h + 1] if masked else None,
        )
        assert mx.array_equal(together[:, h : h + 1], alone), (h, Hq, Hkv)
    assert not mx.array_equal(together[:, :1], together[:, -1:])


@pytest.mark.parametrize("kv_dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("L", [1, 9])
@pytest.mark.parametrize("D", [64, 36])  # 36: a last partial vector of 4
def test_half_precision_keys_are_read_exactly_by_float32_queries(kv_dtype, L, D):
    """A half-precision KV cache under float32 queries: the kernel widens each
    element exactly (decode in registers, prefill into its key block), so the
    output equals attending over the widened copy."""
    q = rand((2, 4, L, D), seed=33)
    k, v = rand((2, 2, 20, D), kv_dtype, 34), rand((2, 2, 20, D), kv_dtype, 35)
    got = ops.attention(q, k, v, scale=0.125, mask="causal" if L > 1 else None)
    wide = ops.attention(
        q, k.astype(mx.float32), v.astype(mx.float32), scale=0.125,
        mask="causal" if L > 1 else None,
    )
    assert got.dtype == mx.float32 and mx.array_equal(got, wide)


def test_a_mask_broadcast_over_heads_is_read_in_place_not_expanded():
    L = S = 512
    q = rand((1, 16, L, 32), seed=36)
    k, v = rand((1, 4, S, 32), seed=37), rand((1, 4, S, 32), seed=38)
    mask = mx.where(window_mask(L, S, 100), 0.0, -mx.inf).astype(mx.float32)
    mx.eval(q, k, v, mask)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = ops.attention(q, k, v, scale=0.2, mask=mask)
    mx.eval(out)
    expanded = 16 * L * S * 4  # the [B, Hq, L, S] fp32 copy a contiguous mask would need
    assert mx.get_peak_memory() - base < out.nbytes + expanded // 4


def test_the_ops_run_inside_compiled_functions():
    x, w = rand((2, 64), seed=18), rand((64,), seed=19)
    inv = mx.ones((16,))

    def step(x):
        h = nat.rms_norm(x, w, 1e-5)[None, None]
        return nat.rope(h, 32, False, inv, 1.0, mx.array([3], dtype=mx.int32))

    assert mx.array_equal(mx.compile(step)(x), step(x))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: nat.rms_norm(mx.zeros((2, 8)), mx.zeros((4,)), 1e-5), "weight"),
        (lambda: nat.rms_norm(mx.zeros((2, 8), mx.int32), None, 1e-5), "float32"),
        (
            lambda: nat.rope(
                mx.zeros((1, 2, 8)), 3, False, mx.ones((1,)), 1.0, mx.zeros((1,), mx.int32)
            ),
            "even",
        ),
        (
            lambda: nat.rope(
                mx.zeros((1, 2, 8)), 8, False, mx.ones((3,)), 1.0, mx.zeros((1,), mx.int32)
            ),
            "inverse",
        ),
        (
            lambda: nat.rope(
                mx.zeros((2, 2, 8)), 8, False, mx.ones((4,)), 1.0, mx.zeros((3,), mx.int32)
            ),
            "offsets",
        ),
        (
            lambda: nat.attention(
                mx.zeros((1, 3, 1, 8)), mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)), 1.0
            ),
            "shapes",
        ),
        (
            lambda: nat.attention(
                mx.zeros((1, 2, 5, 8)), mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)), 1.0, True
            ),
            "causal",
        ),
        (
            lambda: ops.attention(
                mx.zeros((1, 2, 1, 8)),
                mx.zeros((1, 2, 4, 8)),
                mx.zeros((1, 2, 4, 8)),
                scale=1.0,
                mask="window",
            ),
            "mask",
        ),
    ],
)
def test_bad_inputs_are_refused_with_what_was_wrong(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- how a model picks them up ----------------------------------------------


def test_norm_and_rope_modules_are_swapped_and_keep_their_parameters():
    from mlx_loom.cpu import layers

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(32)
            self.rope = nn.RoPE(16, base=500.0)
            self.wide = nn.RMSNorm(ops.MAX_NORM_WIDTH + 1)

    block = Block()
    for _, mod in block.named_modules():
        if layers.swappable(mod):
            layers.swap_in(mod, mx.float32)
    assert type(block.norm) is ops.NativeRMSNorm
    assert type(block.rope) is ops.NativeRoPE
    assert type(block.wide) is nn.RMSNorm  # beyond the kernel's width: left as built
    assert set(dict(block.norm.parameters())) == {"weight"}
    assert "_inv_freq" not in dict(block.rope.parameters())
    x = rand((1, 2, 3, 16), seed=20)
    assert mx.allclose(block.rope(x, offset=4), nn.RoPE(16, base=500.0)(x, offset=4), atol=1e-5)


def test_the_attention_kernel_is_set_only_inside_a_native_forward():
    assert current_attention() is None
    with forward_kernels("cpu-native"):
        assert current_attention() is ops.attention
        with forward_kernels("cpu-ops"):
            assert current_attention() is None
        assert current_attention() is ops.attention
    assert current_attention() is None


def graph_labels(out: mx.array, tmp_path) -> list[str]:
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), out)
    return re.findall(r'label ="([A-Za-z_]+)', path.read_text())


@pytest.fixture(scope="module", params=["llama", "qwen3_next", "gemma4_text"])
def family_checkpoint(request, tmp_path_factory):
    import mlx_loom
    from mlx_loom.testing.checkpoints import write_checkpoint

    claim = mlx_loom.default_host().registry.model_types[request.param]
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    ckpt = write_checkpoint(path, claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config))
    return request.param, ckpt


def decode_step_labels(path, cpu_kernels: str, tmp_path) -> list[str]:
    import mlx_loom

    model, _ = mlx_loom.load(path, compute_dtype="float32", cpu_kernels=cpu_kernels)
    cache = model.make_cache()
    mx.eval(model(mx.array([[1, 2, 3]]), cache))
    return graph_labels(model(mx.array([[4]]), cache), tmp_path)


def test_each_family_attends_on_the_native_kernel_only_with_cpu_native(family_checkpoint, tmp_path):
    family, path = family_checkpoint
    native_labels = decode_step_labels(path, "cpu-native", tmp_path)
    assert "LoomAttention" in native_labels
    assert "LoomAttention" not in decode_step_labels(path, "cpu-ops", tmp_path)
    if family == "llama":
        import json

        layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
        assert native_labels.count("LoomAttention") == layers
        assert native_labels.count("LoomRoPE") == 2 * layers
        assert native_labels.count("LoomRMSNorm") == 2 * layers + 1
        assert "Softmax" not in native_labels and "Matmul" not in native_labels

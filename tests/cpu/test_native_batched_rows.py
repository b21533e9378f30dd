"""Batched matrix-vector products: a row of an M-row call equals the row alone, bit for bit.

Products of more than four and at most ``SMALL_ROWS`` activation rows read
each weight row once and decode it (affine codes, bf16/fp16) into fp32 once
for every tile of rows (``core/csrc/kernels_avx2.cpp``); batched decode and
speculative verification rely on each row still being computed exactly as
when it is alone. Every M from 1 to ``SMALL_ROWS`` is checked, so every tile
remainder is met, for each weight kind the kernel reads.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom.cpu import native

nat = native.module()


def rand(shape, dtype=mx.float32, seed=0) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def assert_rows_equal_alone(run, K: int) -> None:
    x = rand((nat.SMALL_ROWS, K), seed=5)
    alone = mx.concatenate([run(x[m : m + 1]) for m in range(nat.SMALL_ROWS)])
    mx.eval(alone)
    for M in range(1, nat.SMALL_ROWS + 1):
        start = (3 * M) % (nat.SMALL_ROWS - M + 1)  # not always the first rows
        got = run(x[start : start + M])
        assert mx.array_equal(got, alone[start : start + M]), f"M={M}"


@pytest.mark.parametrize("w_dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_dense_rows_equal_the_rows_alone(w_dtype):
    N, K = 21, 203  # a column tail past the last 8, a block tail past the last 64
    w, bias = rand((N, K), w_dtype, seed=1), rand((N,), seed=2)
    assert_rows_equal_alone(lambda a: nat.dense_matmul(a, w, bias), K)


@pytest.mark.parametrize(
    "bits,group_size",
    [(2, 64), (3, 32), (4, 32), (4, 64), (4, 128), (5, 64), (6, 32), (8, 128)],
)
def test_affine_rows_equal_the_rows_alone(bits, group_size):
    # K = 384: three groups of 128, six of 64, and twelve of 32 -- and for
    # 4-bit codes with groups of 32, K = 352 ends on a lone 32-code group.
    K = 352 if (bits, group_size) == (4, 32) else 384
    wq, s, b = mx.quantize(rand((19, K), seed=3), group_size=group_size, bits=bits)
    s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    assert_rows_equal_alone(lambda a: nat.affine_matmul(a, wq, s, b, bits, group_size), K)


def test_fp32_scale_rows_equal_the_rows_alone():
    wq, s, b = mx.quantize(rand((17, 256), seed=4), group_size=64, bits=4)
    assert_rows_equal_alone(lambda a: nat.affine_matmul(a, wq, s, b, 4, 64), 256)

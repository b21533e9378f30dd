"""The head-layout helpers: the same arrays as reshape + transpose, fewer nodes for one token."""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_loom.nn import merge_heads, split_heads


def _reference_split(x: mx.array, n: int, norm=None) -> mx.array:
    B, L, _ = x.shape
    h = x.reshape(B, L, n, -1)
    if norm is not None:
        h = norm(h)
    return h.transpose(0, 2, 1, 3)


def _nodes(out: mx.array, tmp_path) -> list[str]:
    path = tmp_path / "g.dot"
    mx.export_to_dot(str(path), out)
    return re.findall(r'label\s*=\s*"([A-Za-z_]+)"', path.read_text())


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("with_norm", [False, True])
def test_split_heads_equals_reshape_then_transpose(L, with_norm):
    rng = np.random.default_rng(L)
    x = mx.array(rng.standard_normal((2, L, 4 * 8)).astype(np.float32))
    norm = nn.RMSNorm(8) if with_norm else None
    got = split_heads(x, 4, norm=norm)
    want = _reference_split(x, 4, norm=norm)
    assert got.shape == (2, 4, L, 8)
    assert mx.array_equal(got, want)
    assert mx.array_equal(merge_heads(got), want.transpose(0, 2, 1, 3).reshape(2, L, 32))


def test_one_token_takes_one_reshape_each_way(tmp_path):
    x = mx.array(np.arange(2 * 1 * 32, dtype=np.float32).reshape(2, 1, 32))
    heads = split_heads(x, 4)
    assert _nodes(heads, tmp_path).count("Transpose") == 0
    assert _nodes(merge_heads(heads * 2.0), tmp_path).count("Transpose") == 0
    # several tokens still move the axis
    y = mx.array(np.ones((1, 3, 32), dtype=np.float32))
    assert _nodes(split_heads(y, 4), tmp_path).count("Transpose") == 1


def test_merge_heads_of_a_strided_one_token_view_keeps_its_values():
    # An attention output may be a view; a reshape of it copies where MLX must.
    rng = np.random.default_rng(0)
    full = mx.array(rng.standard_normal((2, 4, 1, 16)).astype(np.float32))
    view = full[..., ::2]
    assert mx.array_equal(merge_heads(view), view.transpose(0, 2, 1, 3).reshape(2, 1, 32))

"""Fixtures of the MiniCPM5 tests; the tiny config lives in ``minicpm5_testkit``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # make minicpm5_testkit importable

from minicpm5_testkit import write_tiny  # noqa: E402

from mlx_loom.testing import parity  # noqa: E402


@pytest.fixture
def make_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """``make_checkpoint(name, dtype=mx.float32, seed=0, **config_overrides) -> dir``."""

    def make(
        name: str = "ckpt", dtype: mx.Dtype = mx.float32, seed: int = 0, **overrides: Any
    ) -> Path:
        return write_tiny(tmp_path / name, dtype=dtype, seed=seed, **overrides)

    return make


@pytest.fixture
def quantize_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Quantize a checkpoint with mlx-lm's own converter path (MLX layout)."""

    def quantize(src: Path, bits: int, group_size: int, predicate: Any = None) -> Path:
        dst = tmp_path / f"{src.name}-q{bits}g{group_size}"
        return parity.quantize_checkpoint(
            src, dst, bits=bits, group_size=group_size, predicate=predicate
        )

    return quantize

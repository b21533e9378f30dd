"""Fixtures of the MiniCPM5 tests; the helpers live in ``minicpm5_testkit``."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # make minicpm5_testkit importable

from minicpm5_testkit import TINY, hf_tensors, write_checkpoint  # noqa: E402


@pytest.fixture
def make_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """``make_checkpoint(name, dtype=mx.float32, seed=0, **config_overrides) -> dir``."""

    def make(
        name: str = "ckpt", dtype: mx.Dtype = mx.float32, seed: int = 0, **overrides: Any
    ) -> Path:
        cfg = copy.deepcopy(TINY) | overrides
        cfg["torch_dtype"] = {
            mx.float32: "float32",
            mx.bfloat16: "bfloat16",
            mx.float16: "float16",
        }[dtype]
        return write_checkpoint(tmp_path / name, cfg, hf_tensors(cfg, dtype, seed))

    return make


@pytest.fixture
def quantize_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Quantize a checkpoint with mlx-lm's own converter path (``quantize_model``)."""

    def quantize(src: Path, bits: int, group_size: int, predicate: Any = None) -> Path:
        from mlx.utils import tree_flatten
        from mlx_lm.utils import load_model, quantize_model, save_config

        model, config = load_model(src)
        model, config = quantize_model(model, config, group_size, bits, quant_predicate=predicate)
        dst = tmp_path / f"{src.name}-q{bits}g{group_size}"
        dst.mkdir()
        mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())))
        save_config(config, dst / "config.json")
        return dst

    return quantize

"""Tiny base checkpoints of every family (fp32 and mlx-lm-quantized), shared per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from . import adapterkit


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> Callable[[str, str], Path]:
    """``base(model_type, "fp32" | "q4" | "bf16" | a microscaling mode)`` -> a tiny
    checkpoint, written once."""
    root = tmp_path_factory.mktemp("adapter-bases")
    made: dict[tuple[str, str], Path] = {}

    def get(model_type: str, kind: str = "fp32") -> Path:
        key = (model_type, kind)
        if key not in made:
            where = root / model_type / kind
            if kind == "fp32":
                made[key] = adapterkit.tiny_checkpoint(where, model_type)
            elif kind == "bf16":
                made[key] = adapterkit.tiny_checkpoint(where, model_type, dtype="BF16")
            elif kind == "q4":
                made[key] = adapterkit.quantize_with_mlx_lm(get(model_type), where)
            elif kind in ("mxfp4", "nvfp4", "mxfp8"):
                made[key] = adapterkit.quantize_with_mlx_lm(get(model_type), where, mode=kind)
            else:
                raise ValueError(kind)
        return made[key]

    return get

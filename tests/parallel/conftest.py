"""Fixtures of the parallel tests: a tiny checkpoint of every family, plain and quantized."""

from __future__ import annotations

from pathlib import Path

import pytest

from .support import MODEL_TYPES, ODD_VOCAB, QUANTIZED, write_quantized, write_tiny


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """``{name: directory}``: each model type, ``<type>-q4`` for the quantized ones, and
    ``llama-odd-vocab``."""
    root = tmp_path_factory.mktemp("parallel")
    out = {t: write_tiny(root / t, t) for t in MODEL_TYPES}
    out["llama-odd-vocab"] = write_tiny(root / "llama-odd-vocab", "llama", vocab_size=ODD_VOCAB)
    for model_type, dims in QUANTIZED.items():
        plain = write_tiny(root / f"{model_type}-dims", model_type, **dims)
        out[f"{model_type}-q4"] = write_quantized(plain, root / f"{model_type}-q4")
    return out

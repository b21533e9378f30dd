"""Tiny Llama-architecture checkpoints (MiniCPM5 plugin) with a real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_loom.testing.checkpoints import write_checkpoint
from mlx_loom_minicpm5.plugin import TINY_CONFIG, checkpoint_tensors


def make_llama(path: Path, *, dtype: str = "F32", seed: int = 0, **config) -> Path:
    cfg = {**TINY_CONFIG, **config}
    tensors = {n: (shape, dtype) for n, (shape, _) in checkpoint_tensors(cfg).items()}
    return write_checkpoint(path, cfg, tensors, seed=seed)


@pytest.fixture(scope="session")
def llama_f32(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama") / "f32")


@pytest.fixture(scope="session")
def llama_bf16(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama") / "bf16", dtype="BF16")


@pytest.fixture(scope="session")
def llama_sliding(tmp_path_factory) -> Path:
    return make_llama(
        tmp_path_factory.mktemp("llama") / "sliding",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=6,
    )


@pytest.fixture(scope="session")
def llama_hd32(tmp_path_factory) -> Path:
    """head_dim 32, so KV quantization with group size 32 applies."""
    return make_llama(
        tmp_path_factory.mktemp("llama") / "hd32", num_attention_heads=2, num_key_value_heads=1
    )

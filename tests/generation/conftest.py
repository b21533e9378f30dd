"""Tiny Llama-architecture checkpoints (MiniCPM5 plugin) with a real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

import mlx_loom
from mlx_loom.testing.checkpoints import write_checkpoint
from mlx_loom_gemma4.plugin import TINY_TEXT_CONFIG
from mlx_loom_gemma4.loader import checkpoint_tensors as gemma_tensors
from mlx_loom_minicpm5.plugin import TINY_CONFIG, checkpoint_tensors
from mlx_loom_qwen3_next.plugin import TINY_QWEN3_NEXT
from mlx_loom_qwen3_next.loader import checkpoint_tensors as qwen_tensors

#: Speculation tests: 27 tokens, longer than every window of the tiny checkpoints
#: (the sliding Llama's is 6, Gemma 4's 8), for the three families.
SPEC_PROMPT = [5, 17, 42, 9, 100, 3, 77, 12, 31] * 3
SPEC_FAMILIES = ["llama-sliding", "qwen3_next", "gemma4"]


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


@pytest.fixture(scope="session")
def spec_models(tmp_path_factory):
    """(target, other draft) per family, loaded once."""
    root = tmp_path_factory.mktemp("spec")
    out = {}
    for name in SPEC_FAMILIES:
        if name == "llama-sliding":
            sliding = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
            paths = [make_llama(root / f"l{s}", seed=s, **sliding) for s in (0, 3)]
        else:
            cfg, tensors = {
                "qwen3_next": (TINY_QWEN3_NEXT, qwen_tensors),
                "gemma4": (TINY_TEXT_CONFIG, gemma_tensors),
            }[name]
            paths = [
                write_checkpoint(root / f"{name}{s}", cfg, tensors(cfg), seed=s) for s in (0, 5)
            ]
        out[name] = tuple(mlx_loom.load(p)[0] for p in paths)
    return out

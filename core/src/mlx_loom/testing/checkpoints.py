"""Tiny random-weight checkpoints in Hugging Face layout, written for tests.

A plugin declares, per model type, a small complete ``config.json``
(``ModelType.tiny_config``) and the tensors such a checkpoint holds
(``ModelType.checkpoint_tensors``, HF names, shapes and dtypes). From those
this module writes a directory the engine loads like any published model:
``config.json``, ``model.safetensors`` and (optionally) a real tokenizer.

Values: normal * 0.02 for matrices and biases (the usual HF initialiser
scale), and 1 + normal * 0.02 for one-dimensional norm gains, so
normalisations neither vanish nor explode whichever convention (plain or
zero-centred gain) the family uses. Integer tensors get small random
integers. The generator is seeded, so the same call writes the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..artifacts import SAFETENSORS_DTYPES
from .tokenizer import write_tokenizer

__all__ = ["TensorSpec", "dtype_of", "random_tensors", "write_checkpoint"]

#: ``name -> (shape, dtype name)``; the dtype is an MLX name (``"float32"``,
#: ``"bfloat16"``) or a safetensors code (``"F32"``, ``"BF16"``).
TensorSpec = Mapping[str, tuple[tuple[int, ...], str]]

_MLX_NAMES = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "int8": mx.int8,
    "int16": mx.int16,
    "int32": mx.int32,
    "int64": mx.int64,
    "uint8": mx.uint8,
    "uint16": mx.uint16,
    "uint32": mx.uint32,
    "uint64": mx.uint64,
    "bool": mx.bool_,
}


def dtype_of(name: str | mx.Dtype) -> mx.Dtype:
    """The MLX dtype for an MLX dtype name or a safetensors dtype code."""
    if isinstance(name, mx.Dtype):
        return name
    text = str(name).removeprefix("mlx.core.")
    if text in _MLX_NAMES:
        return _MLX_NAMES[text]
    if text in SAFETENSORS_DTYPES:
        return SAFETENSORS_DTYPES[text].mlx
    raise ValueError(
        f"unknown dtype name {name!r}; use an MLX name ({', '.join(sorted(_MLX_NAMES))}) "
        f"or a safetensors code ({', '.join(sorted(SAFETENSORS_DTYPES))})"
    )


def _is_norm(name: str, shape: tuple[int, ...]) -> bool:
    leaf = name.rsplit(".", 2)
    return len(shape) == 1 and name.endswith(".weight") and "norm" in ".".join(leaf[-2:]).lower()


def random_tensors(tensors: TensorSpec, *, seed: int = 0) -> dict[str, mx.array]:
    """Seeded random values for every tensor in ``tensors`` (sorted by name)."""
    key = mx.random.key(seed)
    out: dict[str, mx.array] = {}
    for name in sorted(tensors):
        shape, dtype_name = tensors[name]
        shape = tuple(int(d) for d in shape)
        dtype = dtype_of(dtype_name)
        key, sub = mx.random.split(key)
        if mx.issubdtype(dtype, mx.floating):
            value = mx.random.normal(shape, key=sub) * 0.02
            if _is_norm(name, shape):
                value = value + 1.0
            value = value.astype(dtype)
        elif dtype == mx.bool_:
            value = mx.random.bernoulli(0.5, shape, key=sub)
        else:
            value = mx.random.randint(0, 16, shape, key=sub).astype(dtype)
        out[name] = value
    mx.eval(out)
    return out


def write_checkpoint(
    path: str | Path,
    config: Mapping[str, Any],
    tensors: TensorSpec,
    *,
    seed: int = 0,
    tokenizer: bool = True,
) -> Path:
    """Write a tiny checkpoint (config, weights, optional tokenizer) into ``path``.

    The tokenizer's vocabulary fits ``config["vocab_size"]`` (or the text
    config's, for nested multimodal configs). Returns ``path``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    weights = random_tensors(tensors, seed=seed)
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    if tokenizer:
        vocab = vocab_size_of(config)
        if vocab is None:
            raise ValueError(
                f"config for {path} has no integer vocab_size (nor text_config.vocab_size); "
                "the test tokenizer must fit it"
            )
        write_tokenizer(path, vocab)
    return path


def vocab_size_of(config: Mapping[str, Any]) -> int | None:
    """``vocab_size`` of a flat config, or of its ``text_config`` (multimodal wrappers)."""
    for source in (config, config.get("text_config") or {}):
        value = source.get("vocab_size") if isinstance(source, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None

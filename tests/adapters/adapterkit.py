"""Tiny random adapters written by mlx-lm's own tuner, and both engines loaded with them.

``write_adapter`` converts mlx-lm's model of a base checkpoint with
``linear_to_lora_layers`` (the trainer's call), gives every factor (and DoRA
magnitude) random values — mlx-lm initialises ``lora_b`` to zero, which would
make any adapter a no-op — and saves ``trainable_parameters()`` plus the
config exactly as the trainer does. The oracle then loads it with
``mlx_lm.load(..., adapter_path=...)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

import mlx_loom
from mlx_loom.testing.checkpoints import write_checkpoint

#: Keys mlx-lm's trainer writes besides the ones inference reads.
TRAINER_NOISE = {"model": "base", "data": "data", "learning_rate": 1e-5, "iters": 10, "seed": 0}


#: Every model type mlx-lm can also load (it has no ``qwen3_5_text`` model).
FAMILIES = ["llama", "qwen3_next", "qwen3_5", "gemma4_text", "gemma4", "gpt_oss"]


def tiny_checkpoint(path: Path, model_type: str, *, dtype: str = "F32", **overrides: Any) -> Path:
    """The family's tiny checkpoint (registry's tiny config, HF layout, a tokenizer)."""
    claim = mlx_loom.default_host().registry.model_types[model_type]
    config = {**claim.tiny_config, **overrides}
    if "text_config" in config and "vocab_size" not in config:
        config["vocab_size"] = config["text_config"]["vocab_size"]  # mlx-lm reads it there
    tensors = {n: (s, dtype) for n, (s, _) in claim.checkpoint_tensors(config).items()}
    return write_checkpoint(path, config, tensors)


def quantize_with_mlx_lm(
    src: Path, dst: Path, *, bits: int = 4, group_size: int = 32, mode: str = "affine"
) -> Path:
    """mlx-lm's own conversion of ``src`` to a quantized MLX checkpoint (a microscaling
    ``mode`` packs at its own group size and bits)."""
    from mlx_lm.convert import convert

    packing = {"q_bits": bits, "q_group_size": group_size} if mode == "affine" else {}
    convert(str(src), str(dst), quantize=True, q_mode=mode, **packing)
    return dst


def write_adapter(
    base: Path,
    out: Path,
    *,
    fine_tune_type: str = "lora",
    num_layers: int = 2,
    rank: int = 4,
    scale: float = 2.0,
    keys: list[str] | None = None,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
) -> Path:
    """Write an mlx-lm adapter for ``base`` into ``out`` with random factors."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(base)
    model.freeze()
    params: dict[str, Any] = {"rank": rank, "scale": scale, "dropout": 0.05}
    if keys is not None:
        params["keys"] = keys
    linear_to_lora_layers(model, num_layers, params, use_dora=fine_tune_type == "dora")
    key = mx.random.key(seed)
    weights = {}
    for name, value in sorted(tree_flatten(model.trainable_parameters())):
        key, sub = mx.random.split(key)
        noise = mx.random.normal(value.shape, key=sub)
        if name.endswith(".m"):
            value = value * (1.0 + 0.1 * noise)
        elif name.endswith(".lora_b"):
            value = 0.05 * noise
        else:
            value = value + 0.05 * noise
        weights[name] = value.astype(dtype)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {
        **TRAINER_NOISE,
        "fine_tune_type": fine_tune_type,
        "num_layers": num_layers,
        "lora_parameters": params,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=4))
    return out


#: mlx-loom's oracle path: the checkpoint's dtype and MLX's own operations, the
#: arithmetic mlx-lm runs (the CPU's default path computes in fp32 on native kernels).
ORACLE_PATH = {"compute_dtype": "checkpoint", "cpu_kernels": "cpu-ops"}


def load_ours(base: Path, adapter: Path | None = None):
    """mlx-loom's model on the oracle path, with ``adapter`` applied if given."""
    return mlx_loom.load(base, adapter_path=adapter, **ORACLE_PATH)[0]


def load_theirs(base: Path, adapter: Path | None):
    from mlx_lm import load

    return load(str(base), adapter_path=None if adapter is None else str(adapter))[0]


def prompt(length: int = 12, seed: int = 1, vocab: int = 256) -> mx.array:
    return mx.random.randint(0, vocab, (1, length), key=mx.random.key(seed)).astype(mx.int32)


def greedy_logits(model, tokens: mx.array, cache: list, steps: int) -> list[mx.array]:
    """Prefill then ``steps`` greedy decode steps; every step's logits."""
    logits = [model(tokens, cache=cache)]
    for _ in range(steps):
        nxt = mx.argmax(logits[-1][:, -1, :], axis=-1)[:, None]
        logits.append(model(nxt, cache=cache))
    mx.eval(logits)
    return logits


def assert_same_run(ours, theirs, *, steps: int = 6, length: int = 12) -> list[int]:
    """Bit-equal logits at prefill and every greedy step; returns the greedy tokens."""
    x = prompt(length)
    a = greedy_logits(ours, x, ours.make_cache(), steps)
    b = greedy_logits(theirs, x, theirs.make_cache(), steps)
    for i, (la, lb) in enumerate(zip(a, b, strict=True)):
        assert mx.array_equal(la, lb), f"logits differ at step {i}: {mx.abs(la - lb).max()}"
    return [int(mx.argmax(la[0, -1])) for la in a]


def write_full_finetune(base: Path, out: Path, *, num_layers: int = 2, seed: int = 0) -> Path:
    """A ``fine_tune_type: full`` adapter: the last layers' weights, perturbed, as the
    trainer saves them (every parameter of the unfrozen layers, mlx-lm's names)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(base)
    model.freeze()
    for layer in model.layers[-num_layers:]:
        layer.unfreeze()
    key = mx.random.key(seed)
    weights = {}
    for name, value in sorted(tree_flatten(model.trainable_parameters())):
        key, sub = mx.random.split(key)
        weights[name] = value + 0.01 * mx.random.normal(value.shape, key=sub).astype(value.dtype)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {**TRAINER_NOISE, "fine_tune_type": "full", "num_layers": num_layers}
    config["lora_parameters"] = None
    (out / "adapter_config.json").write_text(json.dumps(config, indent=4))
    return out

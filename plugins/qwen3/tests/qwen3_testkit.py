"""Shared helpers of the Qwen3 tests: tiny checkpoints from mlx-lm's own classes, in every layout.

The checkpoints come from the core's parity harness (:mod:`mlx_loom.testing.parity`:
mlx-lm's ``qwen3``/``qwen3_moe`` model with seeded random weights), in one of
three layouts:

* ``hf`` — Hugging Face names, every expert its own tensors (what mlx-lm's
  ``sanitize`` stacks);
* ``mlx`` — as ``mlx_lm.convert`` writes it (stacked ``switch_mlp`` experts);
* ``mlx-q4`` — the same, 4-bit affine in groups of 32 (mlx-lm's quantizer).

Each gets a small real tokenizer, so ``mlx_loom.load`` and ``mlx_lm.load``
both open it. Imported by name (conftest puts this folder on ``sys.path``);
the name is unique so it cannot clash with another plugin's helpers.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_loom.testing import parity
from mlx_loom.testing.tokenizer import write_tokenizer
from mlx_loom_qwen3.plugin import TINY_QWEN3, TINY_QWEN3_MOE

STEPS = 24
# 40 tokens: with top-2 routing a prefill holds 80 (token, expert) pairs, past
# the 64 at which the expert GLU sorts tokens by expert, so both paths run.
PROMPT = [(7 * i + 3) % 256 for i in range(40)]

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {**TINY_QWEN3, "num_attention_heads": 4, "num_key_value_heads": 2},
    "qwen3_moe": {**TINY_QWEN3_MOE, "num_attention_heads": 4, "num_key_value_heads": 2},
}
LAYOUTS = ("hf", "mlx", "mlx-q4")
_STACKED = re.compile(r"^(.*\.mlp)\.switch_mlp\.(\w+)\.weight$")


def per_expert(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's stacked experts as Hugging Face stores them (the inverse of its ``sanitize``)."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        m = _STACKED.match(name)
        if m is None:
            out[name] = value
            continue
        for e in range(value.shape[0]):
            out[f"{m.group(1)}.experts.{e}.{m.group(2)}.weight"] = value[e]
    return out


def write_checkpoint(
    directory: Path,
    model_type: str,
    layout: str = "hf",
    *,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """A tiny checkpoint of ``model_type`` in ``layout`` (see the module docstring)."""
    cfg = copy.deepcopy(CONFIGS[model_type]) | overrides
    if layout == "hf":
        parity.write_hf_checkpoint(directory, cfg, dtype=dtype, seed=seed, to_hf=per_expert)
    elif layout in ("mlx", "mlx-q4"):
        bits = 4 if layout == "mlx-q4" else None
        parity.write_mlx_checkpoint(
            directory, cfg, dtype=dtype, seed=seed, bits=bits, group_size=32
        )
    else:
        raise ValueError(layout)
    write_tokenizer(directory, cfg["vocab_size"])  # both engines' load() need one
    return directory


def write_lora(base: Path, out: Path, *, seed: int = 0) -> Path:
    """An mlx-lm LoRA adapter on every layer of ``base`` (routed experts included),
    made with the trainer's own ``linear_to_lora_layers`` and random factors
    (mlx-lm starts ``lora_b`` at zero, which would make the adapter a no-op)."""
    import json

    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(base)
    model.freeze()
    params = {"rank": 4, "scale": 2.0, "dropout": 0.0}
    linear_to_lora_layers(model, -1, params)
    key = mx.random.key(seed)
    weights = {}
    for name, value in sorted(tree_flatten(model.trainable_parameters())):
        key, sub = mx.random.split(key)
        weights[name] = value + 0.05 * mx.random.normal(value.shape, key=sub)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": -1, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out

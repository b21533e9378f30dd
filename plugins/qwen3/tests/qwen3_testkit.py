"""Shared helpers of the Qwen3 tests: tiny checkpoints written by mlx-lm's classes, both loaders.

A checkpoint is mlx-lm's ``qwen3``/``qwen3_moe`` model with seeded random
weights, saved in one of three layouts:

* ``hf`` — Hugging Face names, every expert its own tensors (what mlx-lm's
  ``sanitize`` stacks);
* ``mlx`` — as ``mlx_lm.utils.save_model`` writes it (stacked
  ``switch_mlp`` experts);
* ``mlx-q4`` — mlx-lm's ``quantize_model`` (4-bit affine, group 32; the MoE
  router at 8 bits, mlx-lm's recipe) then ``save_model``.

Both sides load the same files: mlx-lm through ``load_model``, this plugin
through the core's resolution and build, i.e. the path ``mlx_loom.load``
takes minus the tokenizer. Imported by name (conftest puts this folder on
``sys.path``); the name is unique so it cannot clash with another plugin's.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path

from mlx_loom.host import resolve_model
from mlx_loom.loader import build_model
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


def oracle_model(cfg: dict[str, Any], seed: int, dtype: mx.Dtype) -> Any:
    """mlx-lm's own model for ``cfg`` with seeded random weights in ``dtype``."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(cfg))
    key = mx.random.key(seed)

    def draw(path: str, p: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        noise = mx.random.normal(p.shape, key=sub)
        # Norm gains near 1, everything else large enough that greedy picks differ.
        return (1.0 + 0.1 * noise if "norm" in path else 0.2 * noise).astype(dtype)

    model.update(tree_map_with_path(draw, model.parameters()))
    mx.eval(model.parameters())
    return model


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
    cfg["torch_dtype"] = str(dtype).removeprefix("mlx.core.")
    model = oracle_model(cfg, seed, dtype)
    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory, cfg["vocab_size"])  # both engines' load() need one
    if layout == "hf":
        tensors: dict[str, mx.array] = {}
        for name, value in tree_flatten(model.parameters()):
            m = _STACKED.match(name)
            if m is None:
                tensors[name] = value
                continue
            for e in range(value.shape[0]):
                tensors[f"{m.group(1)}.experts.{e}.{m.group(2)}.weight"] = value[e]
        mx.save_safetensors(str(directory / "model.safetensors"), tensors, {"format": "pt"})
        (directory / "config.json").write_text(json.dumps(cfg, indent=1))
        return directory
    from mlx_lm.utils import quantize_model, save_config, save_model

    if layout == "mlx-q4":
        predicate = getattr(model, "quant_predicate", None)
        model, cfg = quantize_model(model, cfg, 32, 4, quant_predicate=predicate)
    elif layout != "mlx":
        raise ValueError(layout)
    save_model(directory, model)
    save_config(cfg, config_path=directory / "config.json")
    return directory


def load_ours(path: Path, **options: Any) -> Any:
    """The plugin's model as ``mlx_loom.load`` builds it; by default on the oracle's
    arithmetic (the checkpoint's dtype, MLX ops) so parity is bit-equal."""
    options = {"compute_dtype": "checkpoint", "cpu_kernels": "cpu-ops"} | options
    return build_model(resolve_model(path, **options))


def load_oracle(path: Path) -> Any:
    from mlx_lm.utils import load_model

    return load_model(path)[0]


def greedy(
    model: Any, prompts: mx.array, cache: list[Any], steps: int = STEPS, after: Any = None
) -> tuple[list[mx.array], mx.array]:
    """Prefill then ``steps`` greedy decode steps; the last-position logits of each forward."""
    logits, tokens = [], []
    y = prompts
    for _ in range(steps + 1):
        out = model(y, cache=cache)[:, -1, :]
        if after is not None:
            after(cache)
        y = mx.argmax(out, axis=-1)[:, None]
        mx.eval(out, y)
        logits.append(out)
        tokens.append(y)
    return logits, mx.concatenate(tokens, axis=1)


def assert_same_run(
    ours: tuple[list[mx.array], mx.array], oracle: tuple[list[mx.array], mx.array]
) -> None:
    """Identical greedy tokens and bit-equal logits at every step."""
    (our_logits, our_tokens), (ref_logits, ref_tokens) = ours, oracle
    assert our_tokens.tolist() == ref_tokens.tolist()
    for step, (a, b) in enumerate(zip(our_logits, ref_logits, strict=True)):
        assert a.dtype == b.dtype, f"step {step}: dtype {a.dtype} vs {b.dtype}"
        assert mx.array_equal(a, b).item(), (
            f"step {step}: logits differ, max |diff| {mx.abs(a - b).max().item()}"
        )
    # Guard against a vacuous pass: the run must not be one token repeated.
    assert len(set(our_tokens.reshape(-1).tolist())) > 1


def write_lora(base: Path, out: Path, *, seed: int = 0) -> Path:
    """An mlx-lm LoRA adapter on every layer of ``base`` (routed experts included),
    made with the trainer's own ``linear_to_lora_layers`` and random factors
    (mlx-lm starts ``lora_b`` at zero, which would make the adapter a no-op)."""
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

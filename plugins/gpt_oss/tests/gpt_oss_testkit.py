"""Shared helpers of the gpt-oss tests: tiny checkpoints written by mlx-lm's own model class.

The oracle's ``mlx_lm.models.gpt_oss.Model`` is built with random weights and
saved in either layout: **MLX** (its parameters as they are, what
``mlx_lm.convert`` writes; quantized through mlx-lm's ``quantize_model`` with
the model's own recipe: 8-bit router) and **Hugging Face** (the fused,
row-interleaved ``gate_up_proj`` with ``*_bias`` tensors that mlx-lm's
``sanitize`` undoes). Both engines then load the same files.

Imported by name (conftest puts this folder on ``sys.path``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_loom.host import resolve_model
from mlx_loom.loader import build_model

STEPS = 24
# 12 tokens: longer than the tiny window (8), so the sliding layers' caches wrap.
PROMPT = [3, 17, 42, 99, 7, 250, 128, 64, 5, 11, 200, 31]

TINY: dict[str, Any] = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "sliding_window": 8,
    "rope_theta": 150000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 128,
        "truncate": False,
    },
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "torch_dtype": "float32",
}


def oracle_model(cfg: dict[str, Any], seed: int = 0, dtype: mx.Dtype = mx.float32) -> Any:
    """mlx-lm's gpt-oss with random weights (gains near 1, sinks and the rest ~N(0, s))."""
    from mlx_lm.models import gpt_oss

    model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(cfg))
    names = sorted(tree_flatten(model.parameters()))
    keys = mx.random.split(mx.random.key(seed), len(names))
    weights = []
    for key, (name, value) in zip(keys, names, strict=True):
        noise = mx.random.normal(value.shape, key=key)
        if name.endswith("norm.weight"):
            noise = 1.0 + 0.1 * noise
        elif name.endswith(("embed_tokens.weight", "lm_head.weight", "sinks")):
            noise = noise  # unit scale: greedy picks that vary from step to step
        else:
            noise = 0.3 * noise
        weights.append((name, noise.astype(dtype)))
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model


def _interleave(a: mx.array, b: mx.array, axis: int) -> mx.array:
    """Rows (or columns) ``a0, b0, a1, b1, ...`` along ``axis``: Hugging Face's gate_up order."""
    stacked = mx.stack([a, b], axis=axis + 1 if axis >= 0 else axis)
    shape = list(a.shape)
    shape[axis] *= 2
    return stacked.reshape(shape)


def hf_layout(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's parameters in the fused Hugging Face layout (its ``sanitize`` is the inverse)."""
    out = {}
    for name, value in params.items():
        if ".experts.up_proj." in name:
            continue
        if ".experts.gate_proj." in name:
            up = params[name.replace("gate_proj", "up_proj")]
            if name.endswith(".weight"):
                out[name.replace("gate_proj", "gate_up_proj")] = _interleave(value, up, -2)
            else:
                out[name.replace("gate_proj.bias", "gate_up_proj_bias")] = _interleave(
                    value, up, -1
                )
        elif ".experts.down_proj." in name:
            out[name.replace("down_proj.bias", "down_proj_bias")] = value
        else:
            out[name] = value
    return out


def mxfp4_layout(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """The Hugging Face layout with MXFP4 experts, as OpenAI publishes gpt-oss:
    ``*_blocks`` (uint8 ``[..., in / 32, 16]``) and ``*_scales`` beside the biases."""
    out = {}
    for name, value in hf_layout(params).items():
        if name.endswith(("experts.gate_up_proj.weight", "experts.down_proj.weight")):
            packed, scales = mx.quantize(value, group_size=32, bits=4, mode="mxfp4")
            base = name[: -len(".weight")]
            out[base + "_blocks"] = packed.view(mx.uint8).reshape(*packed.shape[:-1], -1, 16)
            out[base + "_scales"] = scales
        else:
            out[name] = value
    return out


def write(directory: Path, cfg: dict[str, Any], tensors: dict[str, mx.array]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    mx.save_safetensors(str(directory / "model.safetensors"), tensors, metadata={"format": "mlx"})
    return directory


def write_checkpoint(
    directory: Path,
    layout: str,
    *,
    cfg: dict[str, Any] | None = None,
    dtype: mx.Dtype = mx.float32,
    bits: int | None = None,
    seed: int = 0,
) -> Path:
    """A tiny checkpoint in ``layout`` ("hf" or "mlx"); ``bits``: mlx-lm-quantized (MLX layout)."""
    cfg = dict(TINY if cfg is None else cfg)
    cfg["torch_dtype"] = {mx.float32: "float32", mx.bfloat16: "bfloat16"}[dtype]
    model = oracle_model(cfg, seed, dtype)
    if bits is not None:
        from mlx_lm.utils import quantize_model

        model, cfg = quantize_model(model, cfg, 32, bits)
    params = dict(tree_flatten(model.parameters()))
    return write(directory, cfg, hf_layout(params) if layout == "hf" else params)


def load_ours(path: Path, **options: Any) -> Any:
    # The checkpoint's dtype on MLX operations: the oracle's own arithmetic.
    options = {"compute_dtype": "checkpoint", "cpu_kernels": "cpu-ops", **options}
    return build_model(resolve_model(path, **options))


def load_oracle(path: Path) -> Any:
    from mlx_lm.utils import load_model

    return load_model(path)[0]


def greedy(
    model: Any,
    prompts: mx.array,
    cache: list[Any],
    steps: int = STEPS,
    after_forward: Callable[[list[Any]], None] | None = None,
) -> tuple[list[mx.array], mx.array]:
    """Prefill then ``steps`` greedy decode steps; the last-position logits of each forward."""
    logits, tokens = [], []
    y = prompts
    for _ in range(steps + 1):
        out = model(y, cache=cache)[:, -1, :]
        if after_forward is not None:
            after_forward(cache)
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

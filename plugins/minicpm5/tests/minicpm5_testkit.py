"""Shared helpers of the MiniCPM5 tests: tiny HF checkpoints, both loaders, greedy runs.

Checkpoints are written in Hugging Face layout (config.json + model.safetensors
with Hugging Face tensor names) and loaded by both sides from the same files:
mlx-lm through ``mlx_lm.utils.load_model``, this plugin through the core's
resolution and build (``resolve_model`` + ``build_model``), i.e. exactly the
path ``mlx_loom.load`` takes minus the tokenizer.

Imported by name (conftest puts this folder on ``sys.path``); the name is
unique so it cannot clash with another plugin's helpers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_loom.host import resolve_model
from mlx_loom.loader import build_model
from mlx_loom.testing.oracle import oracle_options

STEPS = 64
PROMPT = [3, 17, 42, 99, 7, 250, 128, 64, 5, 11, 200, 31]

# head_dim 32 is deliberately not hidden/heads (16): q_proj is 64 -> 128.
TINY: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def hf_tensors(cfg: dict[str, Any], dtype: mx.Dtype, seed: int) -> dict[str, mx.array]:
    """Random weights named and shaped as a transformers LlamaForCausalLM saves them."""
    D, inter, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or D // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * hd
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, D),
        "model.norm.weight": (D,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, shape, bias in [
            ("self_attn.q_proj", (q, D), cfg["attention_bias"]),
            ("self_attn.k_proj", (kv, D), cfg["attention_bias"]),
            ("self_attn.v_proj", (kv, D), cfg["attention_bias"]),
            ("self_attn.o_proj", (D, q), cfg["attention_bias"]),
            ("mlp.gate_proj", (inter, D), cfg["mlp_bias"]),
            ("mlp.up_proj", (inter, D), cfg["mlp_bias"]),
            ("mlp.down_proj", (D, inter), cfg["mlp_bias"]),
        ]:
            shapes[f"{p}.{name}.weight"] = shape
            if bias:
                shapes[f"{p}.{name}.bias"] = shape[:1]
        shapes[f"{p}.input_layernorm.weight"] = (D,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (D,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, D)
    out = {}
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    for k, (name, shape) in zip(keys, sorted(shapes.items()), strict=True):
        noise = mx.random.normal(shape, key=k)
        # Norm gains near 1, everything else large enough that greedy picks differ.
        out[name] = (1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise).astype(
            dtype
        )
    mx.eval(out)
    return out


def write_checkpoint(directory: Path, cfg: dict[str, Any], tensors: dict[str, mx.array]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    mx.save_safetensors(str(directory / "model.safetensors"), tensors, metadata={"format": "pt"})
    return directory


def load_ours(path: Path) -> Any:
    # The checkpoint's dtype on MLX operations: the oracle's own arithmetic,
    # so parity is bit-equal (the CPU paths have their own parity tests).
    return build_model(resolve_model(path, **oracle_options()))


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

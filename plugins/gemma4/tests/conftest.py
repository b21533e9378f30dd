"""Tiny random Gemma 4 checkpoints in Hugging Face layout, and both engines' loaders.

Checkpoints are written the way transformers saves them: ``model.*`` names
(``model.language_model.*`` for the ``gemma4`` wrapper), fused
``experts.gate_up_proj``/``experts.down_proj`` tensors, no key/value weights on
KV-shared layers, norm gains stored as-is (Gemma 4 norms are not zero-centred).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_loom.host import resolve_model
from mlx_loom.loader import build_model
from mlx_loom_gemma4.plugin import TINY_TEXT_CONFIG
from mlx_loom.testing.oracle import oracle_options

S, F = "sliding_attention", "full_attention"

#: The plugin's tiny config with every optional feature off (tests switch them on):
#: hidden 64, 5 layers (sliding, sliding, full, sliding, full), window 8, vocab 256.
BASE: dict[str, Any] = {
    k: v
    for k, v in TINY_TEXT_CONFIG.items()
    if k not in ("num_experts", "top_k_experts", "moe_intermediate_size")
} | {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "enable_moe_block": False}

MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
PER_LAYER = {"hidden_size_per_layer_input": 16}
SHARED = {"num_kv_shared_layers": 2}  # layers 3 (sliding) and 4 (full) read layers 1 and 2
K_EQ_V = {"attention_k_eq_v": True, "num_global_key_value_heads": 2}


def tiny_config(**overrides: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(BASE)
    cfg.update(copy.deepcopy(overrides))
    return cfg


def _mlx_lm_model(text_cfg: dict[str, Any]):
    from mlx_lm.models import gemma4_text

    return gemma4_text.Model(gemma4_text.ModelArgs.from_dict(text_cfg))


def random_hf_weights(text_cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random fp32 weights for ``text_cfg`` under HF ``model.*`` names."""
    rng = np.random.default_rng(seed)
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(_mlx_lm_model(text_cfg).parameters())}
    out: dict[str, np.ndarray] = {}
    for name, shape in sorted(shapes.items()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("layer_scalar", "per_expert_scale", "scale") or "norm" in name:
            arr = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            arr = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = arr.astype(np.float32)
    hf: dict[str, np.ndarray] = {}
    for name, arr in out.items():
        if ".switch_glu." in name:
            base = name.split(".switch_glu.")[0]
            if name.endswith("gate_proj.weight"):
                up = out[f"{base}.switch_glu.up_proj.weight"]
                hf[f"{base}.gate_up_proj"] = np.concatenate([arr, up], axis=-2)
            elif name.endswith("down_proj.weight"):
                hf[f"{base}.down_proj"] = arr
            continue
        hf[name] = arr
    return hf


def write_checkpoint(
    path: Path,
    text_cfg: dict[str, Any],
    *,
    wrapper: bool = False,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
    extra_tensors: dict[str, np.ndarray] | None = None,
    drop: tuple[str, ...] = (),
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in HF layout; return ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    weights = random_hf_weights(text_cfg, seed)
    if wrapper:
        weights = {
            "model.language_model." + k.removeprefix("model."): v for k, v in weights.items()
        }
        config = {
            "model_type": "gemma4",
            "vocab_size": text_cfg["vocab_size"],
            "text_config": text_cfg,
            "vision_config": {"model_type": "gemma4_vision"},
        }
    else:
        config = text_cfg
    weights.update(extra_tensors or {})
    arrays = {k: mx.array(v).astype(dtype) for k, v in weights.items() if k not in drop}
    mx.save_safetensors(str(path / "model.safetensors"), arrays)
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_quantized(src: Path, dst: Path, *, group_size: int = 32, bits: int = 4) -> Path:
    """mlx-lm's own conversion: load ``src``, quantize (its predicate), save MLX layout."""
    from mlx_lm.utils import load_model, quantize_model

    model, config = load_model(src)
    model, qconfig = quantize_model(model, config, group_size, bits)
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dst / "config.json").write_text(json.dumps(qconfig))
    return dst


def load_ours(path: Path):
    """Our plugin's graph as ``mlx_loom.load`` builds it (core resolution, kernels, loader)."""
    # The checkpoint's dtype on MLX operations: the oracle's own arithmetic, so
    # parity is bit-equal (the CPU compute paths have their own parity tests).
    return build_model(resolve_model(path, **oracle_options())).module


def load_theirs(path: Path):
    from mlx_lm.utils import load_model

    return load_model(path)[0]


def greedy_compare(
    ours,
    theirs,
    prompt: mx.array,
    our_cache: list,
    their_cache: list,
    *,
    steps: int = 64,
    chunks: tuple[int, ...] | None = None,
) -> list[list[int]]:
    """Prefill (optionally in chunks) then decode greedily; assert bit-equal logits each step.

    Returns the greedy tokens (one list per row).
    """
    bounds = [0]
    for c in chunks or (prompt.shape[1],):
        bounds.append(bounds[-1] + c)
    assert bounds[-1] == prompt.shape[1]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        lo = ours(prompt[:, a:b], cache=our_cache)
        lt = theirs(prompt[:, a:b], cache=their_cache)
        assert mx.array_equal(lo, lt), f"prefill logits differ (chunk {a}:{b})"
    tokens: list[mx.array] = []
    tok = mx.argmax(lo[:, -1, :], axis=-1)
    for step in range(steps):
        tokens.append(tok)
        lo = ours(tok[:, None], cache=our_cache)
        lt = theirs(tok[:, None], cache=their_cache)
        assert mx.array_equal(lo, lt), f"decode logits differ at step {step}"
        tok = mx.argmax(lo[:, -1, :], axis=-1)
        tok_t = mx.argmax(lt[:, -1, :], axis=-1)
        assert mx.array_equal(tok, tok_t)
    return mx.stack(tokens, axis=1).tolist()


def prompt_of(length: int, seed: int = 1, rows: int = 1) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(0, 256, size=(rows, length)).astype(np.int32))


@pytest.fixture
def checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """``checkpoint(name, **config_overrides, wrapper=False, dtype=mx.float32)`` -> directory."""

    def make(name: str = "ckpt", *, wrapper: bool = False, dtype=mx.float32, **overrides) -> Path:
        return write_checkpoint(
            tmp_path / name, tiny_config(**overrides), wrapper=wrapper, dtype=dtype
        )

    return make


@pytest.fixture
def kit():
    """The helpers above, for tests (conftest modules are not importable under importlib mode)."""
    import types

    return types.SimpleNamespace(
        S=S,
        F=F,
        MOE=MOE,
        PER_LAYER=PER_LAYER,
        SHARED=SHARED,
        K_EQ_V=K_EQ_V,
        tiny_config=tiny_config,
        write_checkpoint=write_checkpoint,
        write_quantized=write_quantized,
        load_ours=load_ours,
        load_theirs=load_theirs,
        greedy_compare=greedy_compare,
        prompt_of=prompt_of,
    )

"""Gemma 3 text (``gemma3_text``, and the ``gemma3`` wrapper's text tower) against mlx-lm.

Tiny random checkpoints in the layouts people run — the published one (flat,
or the wrapper's ``language_model.*``), the MLX layout mlx-lm saves, and its
4-bit conversion — give mlx-lm's logits bit for bit over a prompt longer than
the sliding window (so the rotating caches wrap) and 12 greedy steps.
"""

from __future__ import annotations

import copy
import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlx_loom
from mlx_loom.errors import ConfigError
from mlx_loom.host import resolve_model
from mlx_loom.loader import build_model
from mlx_loom.testing.checkpoints import write_checkpoint
from mlx_loom.testing.oracle import oracle_options
from mlx_loom_gemma4.loader import gemma3_checkpoint_tensors
from mlx_loom_gemma4.plugin import TINY_GEMMA3_CONFIG, TINY_GEMMA3_TEXT_CONFIG

PROMPT = list(range(3, 40))  # 37 tokens: past the tiny window of 8


def _reference(path):
    from mlx_lm.utils import load_model

    return load_model(path)[0]


def _ours(path):
    return build_model(resolve_model(path, **oracle_options())).module


def _assert_parity(ours, ref, steps: int = 12) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    ca, cb = ours.make_cache(), make_prompt_cache(ref)
    la, lb = ours(mx.array([PROMPT]), cache=ca), ref(mx.array([PROMPT]), cache=cb)
    assert mx.array_equal(la, lb)
    for _ in range(steps):
        t = mx.argmax(la[:, -1], -1)[:, None]
        assert mx.array_equal(t, mx.argmax(lb[:, -1], -1)[:, None])
        la, lb = ours(t, cache=ca), ref(t, cache=cb)
        assert mx.array_equal(la, lb)


def _quantize(src, dst):
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(src)
    model, config = quantize_model(model, copy.deepcopy(config), 32, 4)
    dst.mkdir(parents=True)
    save_model(dst, model)
    save_config(config, config_path=dst / "config.json")
    return dst


@pytest.mark.parametrize(
    "layout", ["text", "wrapper", "text-untied", "mlx", "mlx-4bit"]
)
def test_gemma3_matches_mlx_lm(tmp_path, layout):
    cfg = TINY_GEMMA3_CONFIG if layout == "wrapper" else dict(TINY_GEMMA3_TEXT_CONFIG)
    if layout == "text-untied":
        cfg["tie_word_embeddings"] = False
    path = write_checkpoint(tmp_path / "hf", cfg, gemma3_checkpoint_tensors(cfg))
    if layout.startswith("mlx"):
        mlx = tmp_path / "mlx"
        mlx.mkdir()
        mx.save_safetensors(
            str(mlx / "model.safetensors"), dict(tree_flatten(_reference(path).parameters()))
        )
        (mlx / "config.json").write_text((path / "config.json").read_text())
        path = mlx if layout == "mlx" else _quantize(mlx, tmp_path / "q4")
    _assert_parity(_ours(path), _reference(path))


def test_the_graph_and_caches_follow_the_pattern(tmp_path):
    path = write_checkpoint(
        tmp_path / "m", TINY_GEMMA3_TEXT_CONFIG, gemma3_checkpoint_tensors(TINY_GEMMA3_TEXT_CONFIG)
    )
    model, tokenizer = mlx_loom.load(path)
    assert model.implementation.id == "gemma4.gemma3-text"
    kinds = [type(c).__name__ for c in model.module.make_cache()]
    assert kinds[2] == "KVCache" and kinds[0] != "KVCache" and kinds[1] != "KVCache"
    assert mlx_loom.generate(model, tokenizer, "hello", max_tokens=4)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_fields_that_would_change_the_arithmetic_are_refused(tmp_path, edit, field):
    cfg = TINY_GEMMA3_TEXT_CONFIG | edit
    path = write_checkpoint(
        tmp_path / "m", TINY_GEMMA3_TEXT_CONFIG, gemma3_checkpoint_tensors(TINY_GEMMA3_TEXT_CONFIG)
    )
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=field):
        mlx_loom.load(path)

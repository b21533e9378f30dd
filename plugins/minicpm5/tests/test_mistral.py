"""Mistral, Ministral 3 and the Mistral 3 wrapper on the Llama graph: parity with mlx-lm.

Checkpoints are written by mlx-lm's own classes (``llama`` for ``mistral``,
``ministral3``, ``mistral3``) through the core's parity harness, in Hugging
Face layout and in mlx-lm's converted (4-bit) layout; every comparison is
bit-equal logits and identical greedy tokens over 64 steps.
"""

from __future__ import annotations

import copy
import json

import mlx.core as mx
import pytest
from mlx_lm.models import cache as lm_cache

from mlx_loom.cache import RotatingKVCache
from mlx_loom.errors import ConfigError, WeightsError
from mlx_loom.testing import parity
from mlx_loom_minicpm5.plugin import (
    TINY_MINISTRAL3_CONFIG,
    TINY_MISTRAL3_CONFIG,
    TINY_MISTRAL_CONFIG,
)


def mistral(**overrides):
    return copy.deepcopy(TINY_MISTRAL_CONFIG) | overrides


def wrapper_to_hf(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's ``language_model.model.*`` / ``language_model.lm_head`` -> Hugging Face's."""
    out = {}
    for name, value in weights.items():
        name = name.removeprefix("language_model.")
        out[
            "model.language_model." + name.removeprefix("model.")
            if name.startswith("model.")
            else name
        ] = value
    out["model.vision_tower.patch_conv.weight"] = mx.zeros((4, 4))  # dropped with a notice
    return out


def test_mistral_without_a_window_matches_mlx_lm_in_bf16(tmp_path):
    path = parity.write_hf_checkpoint(
        tmp_path / "m", mistral(sliding_window=None), dtype=mx.bfloat16
    )
    parity.compare_with_mlx_lm(path)


def test_mistral_window_longer_than_the_run_matches_mlx_lm_on_rotating_caches(tmp_path):
    # 12 + 64 positions < 128: the window never bites, so mlx-lm's llama (which
    # ignores sliding_window) computes the same thing.
    path = parity.write_hf_checkpoint(tmp_path / "m", mistral(sliding_window=128))
    assert all(isinstance(c, RotatingKVCache) for c in parity.load_ours(path).make_cache())
    parity.compare_with_mlx_lm(path)


def all_sliding(model):
    """mlx-lm's llama with every layer marked sliding: its own masks and rotating caches.

    mlx-lm reads ``mistral`` as ``llama`` and ignores ``sliding_window``
    without ``layer_types``; Hugging Face's Mistral slides every layer. Marking
    the layers is that reading on mlx-lm's arithmetic (its llama cannot be
    configured with no full-attention layer).
    """
    for layer in model.model.layers:
        layer.use_sliding = True
    model.model.swa_idx = 0
    return model.make_cache()


def test_mistral_window_that_bites_slides_on_every_layer_as_transformers_does(tmp_path):
    path = parity.write_hf_checkpoint(tmp_path / "m", mistral(sliding_window=5))
    ours, _ = parity.compare_with_mlx_lm(path, oracle_cache=all_sliding)
    full = parity.load_oracle(path)
    unwindowed = parity.greedy(full, mx.array([list(parity.PROMPT)]), full.make_cache())
    assert unwindowed.tokens != ours.tokens  # the window changes the run


def test_mistral_4bit_mlx_layout_with_a_window_matches_mlx_lm(tmp_path):
    path = parity.write_mlx_checkpoint(tmp_path / "q4", mistral(), bits=4, group_size=32)
    assert "quantization" in json.loads((path / "config.json").read_text())
    parity.compare_with_mlx_lm(path, oracle_cache=all_sliding)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=str)
def test_ministral3_matches_mlx_lm(tmp_path, dtype):
    # original_max_position_embeddings 8: the query scaling steps up at 8, 16, ...
    path = parity.write_hf_checkpoint(tmp_path / "m3", TINY_MINISTRAL3_CONFIG, dtype=dtype)
    parity.compare_with_mlx_lm(path)


def test_ministral3_4bit_mlx_layout_matches_mlx_lm(tmp_path):
    path = parity.write_mlx_checkpoint(
        tmp_path / "q4", TINY_MINISTRAL3_CONFIG, bits=4, group_size=32
    )
    parity.compare_with_mlx_lm(path)


def test_ministral3_left_padded_batch_matches_mlx_lm_batch_caches(tmp_path):
    # Per-row offsets reach the query scaling as an array (one position per row).
    path = parity.write_hf_checkpoint(tmp_path / "m3", TINY_MINISTRAL3_CONFIG, dtype=mx.bfloat16)
    prompt = list(parity.PROMPT)
    rows = [prompt, prompt[:7], prompt[4:7]]
    padding = [len(prompt) - len(r) for r in rows]
    x = mx.array([[0] * pad + r for pad, r in zip(padding, rows, strict=True)])
    parity.compare_with_mlx_lm(
        path,
        prompt=x,
        our_cache=lambda m: [c.empty_batch(padding) for c in m.make_cache()],
        oracle_cache=lambda m: [lm_cache.BatchKVCache(padding) for _ in m.layers],
    )


@pytest.mark.parametrize("layout", ["hf", "mlx-4bit"])
def test_mistral3_wrapper_text_model_matches_mlx_lm(tmp_path, layout):
    if layout == "hf":
        path = parity.write_hf_checkpoint(tmp_path / "w", TINY_MISTRAL3_CONFIG, to_hf=wrapper_to_hf)
    else:
        path = parity.write_mlx_checkpoint(
            tmp_path / "w", TINY_MISTRAL3_CONFIG, bits=4, group_size=32
        )
    model = parity.load_ours(path)
    assert model.module.model.llama4_beta == 0.1  # text_config's ministral3 reading
    parity.compare_with_mlx_lm(path)


def test_mistral3_with_a_mistral_text_model_reads_it_as_mistral(tmp_path):
    text = mistral(sliding_window=None)
    config = {"model_type": "mistral3", "text_config": text}
    path = parity.write_hf_checkpoint(tmp_path / "w", config, to_hf=wrapper_to_hf)
    assert parity.load_ours(path).module.model.llama4_beta is None
    parity.compare_with_mlx_lm(path)


def _config_error(tmp_path, config) -> str:
    path = tmp_path / "bad"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), {"x": mx.zeros((1,))})
    with pytest.raises(ConfigError) as err:
        parity.load_ours(path)
    return str(err.value)


def test_a_mistral4_text_model_is_refused_naming_the_field(tmp_path):
    text = dict(TINY_MINISTRAL3_CONFIG, model_type="mistral4")
    message = _config_error(tmp_path, {"model_type": "mistral3", "text_config": text})
    assert "text_config.model_type: found 'mistral4'" in message


def test_ministral3_rope_parameters_without_the_query_scaling_are_refused(tmp_path):
    rope = {
        k: v
        for k, v in TINY_MINISTRAL3_CONFIG["rope_parameters"].items()
        if k != "llama_4_scaling_beta"
    }
    message = _config_error(tmp_path, dict(TINY_MINISTRAL3_CONFIG, rope_parameters=rope))
    assert "rope_parameters.llama_4_scaling_beta" in message


def test_fp8_checkpoints_are_refused_with_the_fix(tmp_path):
    def fp8(weights):
        weights["model.layers.0.mlp.up_proj.weight_scale_inv"] = mx.ones((1, 1))
        return weights

    path = parity.write_hf_checkpoint(tmp_path / "fp8", TINY_MINISTRAL3_CONFIG, to_hf=fp8)
    with pytest.raises(WeightsError, match="FP8") as err:
        parity.load_ours(path)
    assert "mlx_lm.convert" in (err.value.fix or "")

"""Loading: strict tensor checks, stored dtypes, cache layout, and ``mlx_loom.load`` end to end."""

from __future__ import annotations

import json
from functools import partial

import mlx.core as mx
import pytest
from minicpm5_testkit import TINY, write_tiny
from tokenizers import Tokenizer, models, pre_tokenizers

import mlx_loom
from mlx_loom.cache import (
    KVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    maybe_quantize_kv_cache,
)
from mlx_loom.errors import WeightsError
from mlx_loom.testing.parity import PROMPT, greedy, load_ours
from mlx_loom_minicpm5 import checkpoint_tensors

PROMPT_IDS = list(PROMPT)


def checkpoint(tmp_path, edit=None, **overrides):
    """A tiny checkpoint whose tensors ``edit`` may change before writing."""
    return write_tiny(tmp_path / "ckpt", edit=edit, **overrides)


def weights_error(path) -> str:
    with pytest.raises(WeightsError) as err:
        load_ours(path)
    return str(err.value)


def test_expected_manifest_lists_every_tensor_of_the_config():
    manifest = checkpoint_tensors(TINY, "F32")
    assert len(manifest) == 2 * 9 + 3  # 7 matrices + 2 norms per layer; embed, norm, lm_head
    assert manifest["model.layers.1.self_attn.q_proj.weight"] == ((128, 64), "F32")
    assert manifest["model.layers.0.self_attn.k_proj.weight"] == ((64, 64), "F32")


def test_q_proj_contradicting_heads_times_head_dim_is_named(tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.q_proj.weight"] = mx.zeros((96, 64))

    message = weights_error(checkpoint(tmp_path, shrink))
    assert "model.layers.0.self_attn.q_proj.weight (96, 64) (expected (128, 64))" in message


def test_missing_and_unexpected_tensors_are_reported_together(tmp_path):
    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.1.mlp.extra.weight"] = mx.zeros((4,))

    message = weights_error(checkpoint(tmp_path, edit))
    assert "missing (1): model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected (1): model.layers.1.mlp.extra.weight" in message


def test_untied_config_without_lm_head_reports_it_missing(tmp_path):
    path = checkpoint(tmp_path, lambda t: t.pop("lm_head.weight"))
    assert "missing (1): lm_head.weight" in weights_error(path)


def test_mixed_float_dtypes_are_refused(tmp_path):
    def edit(t):
        t["model.layers.0.mlp.gate_proj.weight"] = t["model.layers.0.mlp.gate_proj.weight"].astype(
            mx.bfloat16
        )

    assert "model.layers.0.mlp.gate_proj.weight BF16 (expected F32)" in weights_error(
        checkpoint(tmp_path, edit)
    )


def test_stored_rotary_inv_freq_is_dropped(tmp_path):
    path = checkpoint(
        tmp_path,
        lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": mx.ones((16,))}),
    )
    assert load_ours(path)(mx.array([PROMPT_IDS])).shape == (1, len(PROMPT), 256)


def test_tied_checkpoint_ignores_a_stored_lm_head_copy(tmp_path):
    def add_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] * 0

    model = load_ours(checkpoint(tmp_path, add_head, tie_word_embeddings=True))
    assert "lm_head" not in model.module
    assert mx.abs(model(mx.array([PROMPT_IDS]))).max().item() > 0


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=str)
def test_weights_load_in_the_dtype_they_are_stored_in(make_checkpoint, dtype):
    model = load_ours(make_checkpoint(dtype=dtype))
    assert model.module.model.layers[0].self_attn.q_proj.weight.dtype == dtype
    assert model(mx.array([PROMPT_IDS])).dtype == dtype


def test_quantized_checkpoint_keeps_its_scale_dtype(make_checkpoint, quantize_checkpoint):
    model = load_ours(quantize_checkpoint(make_checkpoint(dtype=mx.bfloat16), 4, 32)).module
    q_proj = model.model.layers[0].self_attn.q_proj
    assert (q_proj.weight.dtype, q_proj.scales.dtype) == (mx.uint32, mx.bfloat16)
    assert (q_proj.bits, q_proj.group_size) == (4, 32)


def test_sliding_layers_get_a_rotating_cache_of_the_window(make_checkpoint):
    path = make_checkpoint(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    caches = load_ours(path).make_cache()
    assert isinstance(caches[0], RotatingKVCache) and caches[0].max_size == 5
    assert type(caches[1]) is KVCache


def test_kv_quantization_reaches_sliding_window_layers(make_checkpoint):
    # mlx-lm cannot quantize a rotating cache, so there is no oracle: 8-bit KV
    # must leave these (deterministic) 16 greedy tokens unchanged.
    # mlx-lm's llama cannot build an all-sliding config, so its class writes
    # one full layer and the config is then edited (the tensors are the same).
    path = make_checkpoint(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = ["sliding_attention"] * 2
    (path / "config.json").write_text(json.dumps(config))
    model, prompt = load_ours(path), mx.array([PROMPT_IDS])
    plain = greedy(model, prompt, model.make_cache(), steps=16).tokens
    caches = model.make_cache()
    quantize = partial(maybe_quantize_kv_cache, kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    quantized = greedy(model, prompt, caches, steps=16, after_forward=quantize).tokens
    assert all(isinstance(c, QuantizedRotatingKVCache) for c in caches)
    assert quantized == plain


def test_dynamic_rope_refuses_batched_offsets(make_checkpoint):
    path = make_checkpoint(rope_scaling={"type": "dynamic", "factor": 2.0})
    model = load_ours(path)
    caches = [c.empty_batch([0, 2]) for c in model.make_cache()]
    with pytest.raises(mlx_loom.errors.CapabilityRefused, match="dynamic"):
        model(mx.array([PROMPT_IDS[:4], [0, 0, *PROMPT_IDS[:2]]]), cache=caches)


def _write_word_tokenizer(directory, vocab_size=256):
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))


def test_mlx_loom_load_builds_the_model_and_runs_a_forward(make_checkpoint):
    path = make_checkpoint()
    _write_word_tokenizer(path)
    model, tokenizer = mlx_loom.load(path)
    assert model.profile.id == "minicpm5/llama"
    assert model.implementation.id == "minicpm5.llama"
    ids = tokenizer.encode("w3 w17 w42", add_special_tokens=False)
    logits = model(mx.array([ids]), cache=model.make_cache())
    assert logits.shape == (1, 3, 256)

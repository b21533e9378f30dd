"""Parity with mlx-lm's qwen3_next and qwen3_5 on tiny HF-layout checkpoints (fp32 and 4-bit).

The op graph is the same as mlx-lm's (mx.fast.gated_delta_update is bit-identical
to its ops recurrence on the CPU for fp32 inputs), so every comparison is exact.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mlx_lm.models.cache import BatchKVCache as LmBatchKVCache

from mlx_loom.cache import BatchKVCache
from mlx_loom.cache.recurrent import RecurrentCache

PROMPT = [1, 5, 7, 9, 11, 200, 3, 4, 8, 100, 42, 17]
KINDS = ["qwen3_next-fp32", "qwen3_next-q4", "qwen3_5-fp32", "qwen3_5-q4"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decode_matches_mlx_lm_token_for_token_and_logit_for_logit(kind, loaders):
    ours, ref = loaders(kind)
    ca, cb = ours.make_cache(), make_prompt_cache(ref)
    prompt = mx.array([PROMPT])
    la, lb = ours(prompt, cache=ca), ref(prompt, cache=cb)
    assert mx.array_equal(la, lb)
    for _ in range(64):
        ta, tb = mx.argmax(la[:, -1], -1)[:, None], mx.argmax(lb[:, -1], -1)[:, None]
        assert ta.item() == tb.item()
        la, lb = ours(ta, cache=ca), ref(tb, cache=cb)
        assert mx.array_equal(la, lb)


@pytest.mark.parametrize("kind", ["qwen3_next-fp32", "qwen3_5-q4"])
def test_cacheless_forward_matches_mlx_lm(kind, loaders):
    ours, ref = loaders(kind)
    x = mx.array([PROMPT, PROMPT[::-1]])
    assert mx.array_equal(ours(x), ref(x))


def _our_batch_cache(model, pad):
    return [
        RecurrentCache(left_padding=pad) if layer.is_linear else BatchKVCache(pad)
        for layer in model.layers
    ]


def _left_pad(rows):
    width = max(map(len, rows))
    return mx.array([[0] * (width - len(r)) + r for r in rows]), [width - len(r) for r in rows]


@pytest.mark.parametrize("kind", ["qwen3_next-fp32", "qwen3_next-q4"])
def test_left_padded_batch_matches_mlx_lm_batch_path(kind, loaders):
    ours, ref = loaders(kind)
    rows = [PROMPT, PROMPT[3:8], PROMPT[:9]]
    x, pad = _left_pad(rows)
    ca = _our_batch_cache(ours, pad)
    cb = [
        ArraysCache(2, left_padding=pad) if layer.is_linear else LmBatchKVCache(pad)
        for layer in ref.layers
    ]
    la, lb = ours(x, cache=ca), ref(x, cache=cb)
    for r, p in enumerate(pad):
        assert mx.array_equal(la[r, p:], lb[r, p:])
    for _ in range(8):
        t = mx.argmax(la[:, -1], -1)[:, None]
        assert mx.array_equal(t, mx.argmax(lb[:, -1], -1)[:, None])
        la, lb = ours(t, cache=ca), ref(t, cache=cb)
        assert mx.array_equal(la, lb)


def test_each_left_padded_row_equals_the_row_alone(loaders):
    ours, _ = loaders("qwen3_next-fp32")
    rows = [PROMPT, PROMPT[2:6]]
    x, pad = _left_pad(rows)
    ca = _our_batch_cache(ours, pad)
    batch = ours(x, cache=ca)
    for r, (row, p) in enumerate(zip(rows, pad, strict=True)):
        alone = ours(mx.array([row]), cache=ours.make_cache())
        assert mx.array_equal(batch[r, p:], alone[0])


def test_right_padded_prefill_leaves_each_row_as_if_alone(loaders):
    ours, _ = loaders("qwen3_5-fp32")
    rows = [PROMPT, PROMPT[:5]]
    lengths = [len(r) for r in rows]
    width = max(lengths)
    x = mx.array([r + [0] * (width - len(r)) for r in rows])
    ca = _our_batch_cache(ours, [0, 0])
    for c in ca:
        c.prepare(lengths=lengths, right_padding=[width - n for n in lengths])
    ours(x, cache=ca)
    for c in ca:
        c.finalize()
    step = mx.array([[3], [3]])
    batch = ours(step, cache=ca)
    for r, row in enumerate(rows):
        cache = ours.make_cache()
        ours(mx.array([row]), cache=cache)
        assert mx.array_equal(batch[r], ours(mx.array([[3]]), cache=cache)[0])


def _greedy_parity(ours, ref, steps=16):
    ca, cb = ours.make_cache(), make_prompt_cache(ref)
    la, lb = ours(mx.array([PROMPT]), cache=ca), ref(mx.array([PROMPT]), cache=cb)
    assert mx.array_equal(la, lb)
    for _ in range(steps):
        t = mx.argmax(la[:, -1], -1)[:, None]
        assert mx.array_equal(t, mx.argmax(lb[:, -1], -1)[:, None])
        la, lb = ours(t, cache=ca), ref(t, cache=cb)
        assert mx.array_equal(la, lb)


def test_qwen3_5_with_experts_matches_mlx_lm(tmp_path, qn):
    """MoE on every layer (mlx-lm's qwen3_5). mlx-lm reads only the stacked MLX layout,
    so both engines load the stacked checkpoint our loader makes from the kit's HF one."""
    from mlx_loom.artifacts import load_weights
    from mlx_loom.testing.checkpoints import write_checkpoint
    from mlx_loom_qwen3_next.config import Qwen3_5Config
    from mlx_loom_qwen3_next.loader import checkpoint_tensors, sanitize
    from mlx_loom_qwen3_next.plugin import TINY_QWEN3_5

    text = {
        **TINY_QWEN3_5["text_config"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    }
    cfg = {**TINY_QWEN3_5, "text_config": text}
    hf = write_checkpoint(tmp_path / "hf", cfg, checkpoint_tensors(cfg))
    weights = {k.replace("model.language_model.", "model."): v for k, v in load_weights(hf).items()}
    stacked = sanitize(weights, Qwen3_5Config.model_validate(text))
    mlx = tmp_path / "mlx"
    mlx.mkdir()
    mx.save_safetensors(
        str(mlx / "model.safetensors"),
        {k.replace("model.", "model.language_model.", 1): v for k, v in stacked.items()},
    )
    (mlx / "config.json").write_text((hf / "config.json").read_text())
    ours = qn.load_ours(mlx)
    assert type(ours.layers[0].mlp).__name__ == "SparseMoe"
    _greedy_parity(ours, qn.load_reference(mlx))


@pytest.mark.parametrize("layout", ["hf", "mlx", "mlx-4bit"])
def test_qwen3_5_moe_matches_mlx_lm_in_every_layout(tmp_path, qn, layout):
    """Qwen3.5-MoE: the published layout (fused ``experts.gate_up_proj``, torch conv,
    zero-centred gains), the MLX layout mlx-lm saves, and its 4-bit conversion."""
    from mlx.utils import tree_flatten

    from mlx_loom.testing.checkpoints import write_checkpoint
    from mlx_loom_qwen3_next.loader import checkpoint_tensors
    from mlx_loom_qwen3_next.plugin import TINY_QWEN3_5_MOE

    path = write_checkpoint(tmp_path / "hf", TINY_QWEN3_5_MOE, checkpoint_tensors(TINY_QWEN3_5_MOE))
    assert any(k.endswith("experts.gate_up_proj") for k in mx.load(str(path / "model.safetensors")))
    if layout != "hf":
        mlx = tmp_path / "mlx"
        mlx.mkdir()
        weights = dict(tree_flatten(qn.load_reference(path).parameters()))
        mx.save_safetensors(str(mlx / "model.safetensors"), weights)
        (mlx / "config.json").write_text((path / "config.json").read_text())
        path = mlx if layout == "mlx" else qn.quantize_checkpoint(mlx, tmp_path / "q4")
    ours = qn.load_ours(path)
    assert type(ours.layers[0].mlp).__name__ == "SparseMoe"
    _greedy_parity(ours, qn.load_reference(path))


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    ],
    ids=["linear", "yarn"],
)
def test_scaled_rope_matches_mlx_lm(tmp_path, qn, scaling):
    path = qn.write_checkpoint(tmp_path / "m", {**qn.QWEN3_NEXT_CONFIG, "rope_scaling": scaling})
    _greedy_parity(qn.load_ours(path), qn.load_reference(path))

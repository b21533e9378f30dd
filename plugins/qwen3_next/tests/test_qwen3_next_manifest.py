"""The graph's tensors written in the Hugging Face layout are exactly what a real-layout checkpoint holds."""

import pytest

from mlx_loom_qwen3_next.plugin import TINY_QWEN3_5, TINY_QWEN3_NEXT
from mlx_loom_qwen3_next.loader import checkpoint_tensors


@pytest.mark.parametrize("name", ["QWEN3_NEXT_CONFIG", "QWEN3_5_CONFIG"])
def test_manifest_matches_the_hf_layout_writer(qn, tmp_path, name):
    import mlx.core as mx

    cfg = getattr(qn, name)
    path = qn.write_checkpoint(tmp_path / name, cfg)
    written = {
        k: tuple(v.shape)
        for k, v in mx.load(str(path / "model.safetensors")).items()
        if not k.startswith(("mtp.", "model.visual."))
    }
    declared = {k: shape for k, (shape, _) in checkpoint_tensors(cfg).items()}
    assert declared == written


@pytest.mark.parametrize("cfg", [TINY_QWEN3_NEXT, TINY_QWEN3_5])
def test_tiny_configs_load_and_run(tmp_path, cfg):
    import mlx_loom
    from mlx_loom.testing.checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / "ckpt", cfg, checkpoint_tensors(cfg))
    model, tok = mlx_loom.load(path)
    assert len(tok.encode(mlx_loom.generate(model, tok, "hello", max_tokens=4))) > 0


_MOE_5 = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}
VARIANTS = {
    "qwen3_next": TINY_QWEN3_NEXT,
    "qwen3_next-tied": {**TINY_QWEN3_NEXT, "tie_word_embeddings": True, "attention_bias": True},
    "qwen3_5": TINY_QWEN3_5,
    "qwen3_5-moe": {**TINY_QWEN3_5, "text_config": {**TINY_QWEN3_5["text_config"], **_MOE_5}},
    "qwen3_5_text-moe": {**TINY_QWEN3_5["text_config"], **_MOE_5},
}


def test_a_qwen3_5_config_with_experts_lists_expert_tensors_not_dense_ones():
    names = checkpoint_tensors(VARIANTS["qwen3_5-moe"])
    layer = "model.language_model.layers.0.mlp."
    assert f"{layer}experts.3.up_proj.weight" in names
    assert f"{layer}gate.weight" in names and f"{layer}shared_expert_gate.weight" in names
    assert f"{layer}up_proj.weight" not in names


def test_a_kit_checkpoint_of_qwen3_5_with_experts_loads_and_generates(tmp_path):
    import mlx_loom
    from mlx_loom.testing.checkpoints import write_checkpoint

    cfg = VARIANTS["qwen3_5-moe"]
    path = write_checkpoint(tmp_path / "ckpt", cfg, checkpoint_tensors(cfg))
    model, tok = mlx_loom.load(path)
    assert type(model.module.layers[0].mlp).__name__ == "SparseMoe"
    assert mlx_loom.generate(model, tok, "hello", max_tokens=3)

"""The declared HF tensor manifest is exactly what a real-layout checkpoint holds."""

import pytest

from mlx_loom_gemma4.plugin import TINY_TEXT_CONFIG, TINY_WRAPPER_CONFIG
from mlx_loom_gemma4.loader import checkpoint_tensors


@pytest.mark.parametrize("wrapper", [False, True])
def test_manifest_matches_the_hf_layout_writer(kit, tmp_path, wrapper):
    import mlx.core as mx

    cfg = kit.tiny_config(**kit.MOE, **kit.PER_LAYER, **kit.SHARED)
    path = kit.write_checkpoint(tmp_path / "ckpt", cfg, wrapper=wrapper)
    written = {
        k: tuple(v.shape)
        for k, v in mx.load(str(path / "model.safetensors")).items()
        if not any(t in k for t in ("vision", "audio"))
    }
    full = {"model_type": "gemma4", "text_config": cfg} if wrapper else cfg
    declared = {k: shape for k, (shape, _) in checkpoint_tensors(full).items()}
    assert declared == written


@pytest.mark.parametrize("cfg", [TINY_TEXT_CONFIG, TINY_WRAPPER_CONFIG])
def test_tiny_configs_load_and_run(tmp_path, cfg):
    import mlx_loom
    from mlx_loom.testing.checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / "ckpt", cfg, checkpoint_tensors(cfg))
    model, tok = mlx_loom.load(path)
    assert mlx_loom.generate(model, tok, "hello", max_tokens=4)

"""The declared HF tensor manifest is exactly what a real-layout checkpoint holds."""

import pytest

from mlx_loom_qwen3_next.manifest import TINY_QWEN3_5, TINY_QWEN3_NEXT, checkpoint_tensors


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

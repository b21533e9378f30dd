"""``loom fuse`` against ``mlx_lm.fuse``, for every family.

Both tools fold the same random adapter into the same base: the written
tensors are identical, the fused checkpoint loads in both engines with
bit-equal logits, and it reproduces the adapted model (to fp32 rounding:
``(W + s B^T A^T) x`` and ``W x + s (x A) B`` round differently, by about 1e-6
here; re-quantizing a fused layer moves it much further, so that case is
compared with mlx-lm's own output only).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.cli.main import build_parser, main
from mlx_loom.convert import fuse
from mlx_loom.errors import ConvertError

from ..adapters import adapterkit as kit
from .test_convert import logits_everywhere, tensors_of

FP32_TOLERANCE = 1e-4

CASES = {
    "fp32-lora": ("fp32", "lora", False),
    "fp32-dora": ("fp32", "dora", False),
    "q4-lora": ("q4", "lora", False),
    "q4-dora-dequantized": ("q4", "dora", True),
    "mxfp4-lora": ("mxfp4", "lora", False),
}


def mlx_lm_fuse(base: Path, adapter: Path, dst: Path, *, dequantize: bool, monkeypatch) -> Path:
    from mlx_lm import fuse as lm_fuse

    argv = ["fuse", "--model", str(base), "--adapter-path", str(adapter), "--save-path", str(dst)]
    monkeypatch.setattr(sys, "argv", argv + (["--dequantize"] if dequantize else []))
    with contextlib.redirect_stdout(io.StringIO()):
        lm_fuse.main()
    return dst


def _adapter(base_path: Path, where: Path, fine_tune_type: str) -> Path:
    keys = ["self_attn.q_proj", "self_attn.o_proj"] if fine_tune_type == "dora" else None
    return kit.write_adapter(base_path, where, fine_tune_type=fine_tune_type, keys=keys)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model_type", kit.FAMILIES)
def test_the_fused_model_equals_mlx_lm_fuses_and_loads_in_both_engines(
    base, tmp_path, monkeypatch, model_type, case
):
    kind, fine_tune_type, dequantize = CASES[case]
    path = base(model_type, kind)
    adapter = _adapter(path, tmp_path / "adapter", fine_tune_type)
    a = fuse(path, adapter, tmp_path / "ours", dequantize=dequantize, progress=False)
    b = mlx_lm_fuse(
        path, adapter, tmp_path / "theirs", dequantize=dequantize, monkeypatch=monkeypatch
    )
    ta, tb = tensors_of(a), tensors_of(b)
    assert set(ta) == set(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and mx.array_equal(ta[name], tb[name]), name
    assert not any(".lora_" in name for name in ta)
    first, *rest = logits_everywhere([a, b])
    assert all(mx.array_equal(first, other) for other in rest)
    if kind == "fp32" or dequantize:
        adapted = kit.load_ours(path, adapter)
        assert mx.abs(first - adapted(kit.prompt(16))).max() < FP32_TOLERANCE


def test_a_quantized_base_stays_quantized_with_its_packing(base, tmp_path):
    path = base("llama", "q4")
    out = fuse(path, _adapter(path, tmp_path / "a", "lora"), tmp_path / "o", progress=False)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    assert tensors_of(out)["model.layers.1.self_attn.q_proj.weight"].dtype == mx.uint32


def test_dequantize_writes_every_layer_dense_and_drops_the_quantization(base, tmp_path):
    path = base("qwen3_next", "q4")
    adapter = _adapter(path, tmp_path / "a", "lora")
    out = fuse(path, adapter, tmp_path / "o", dequantize=True, progress=False)
    assert not any(n.endswith((".scales", ".biases")) for n in tensors_of(out))
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config


def test_a_bf16_dora_fuse_keeps_the_base_dtype(base, tmp_path):
    path = base("llama", "bf16")
    adapter = kit.write_adapter(path, tmp_path / "a", fine_tune_type="dora")
    tensors = tensors_of(fuse(path, adapter, tmp_path / "o", progress=False))
    assert {t.dtype for t in tensors.values()} == {mx.bfloat16}
    assert mlx_loom.load(tmp_path / "o")


def test_a_full_fine_tune_is_written_as_applied(base, tmp_path):
    path = base("llama")
    adapter = kit.write_full_finetune(path, tmp_path / "full")
    out = fuse(path, adapter, tmp_path / "o", progress=False)
    adapted, _ = mlx_loom.load(path, adapter_path=adapter)
    fused, _ = mlx_loom.load(out)
    x = kit.prompt(16)
    assert mx.array_equal(adapted(x), fused(x))


def test_an_adapter_that_does_not_fit_writes_nothing(base, tmp_path):
    adapter = _adapter(base("llama"), tmp_path / "a", "lora")
    with pytest.raises(mlx_loom.LoomError, match="does not fit"):
        fuse(base("qwen3_next"), adapter, tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()


def test_an_existing_save_path_is_refused(base, tmp_path):
    (tmp_path / "o").mkdir()
    with pytest.raises(ConvertError, match="already exists"):
        fuse(base("llama"), tmp_path / "a", tmp_path / "o", progress=False)


def test_upload_is_refused_offline_before_fusing(base, tmp_path, monkeypatch):
    from mlx_loom.errors import HubRefused

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = base("llama")
    adapter = _adapter(path, tmp_path / "a", "lora")
    with pytest.raises(HubRefused, match="HF_HUB_OFFLINE"):
        fuse(path, adapter, tmp_path / "o", upload_repo="me/fused", progress=False)
    assert not (tmp_path / "o").exists()


def test_loom_fuse_has_mlx_lm_fuses_flags_and_defaults():
    args = build_parser().parse_args(["fuse"])
    assert (args.model, args.save_path, args.adapter_path) == (
        "mlx_model",
        "fused_model",
        "adapters",
    )
    assert build_parser().parse_args(["fuse", "--de-quantize"]).dequantize
    assert build_parser().parse_args(["fuse", "--dequantize"]).dequantize


def test_loom_fuse_writes_the_fused_model(base, tmp_path, capsys):
    path = base("gemma4")
    adapter = _adapter(path, tmp_path / "a", "lora")
    argv = ["fuse", "--model", str(path), "--adapter-path", str(adapter)]
    code = main([*argv, "--save-path", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"loom: wrote {tmp_path / 'o'}" in err
    assert mlx_loom.load(tmp_path / "o")


def test_loom_fuse_refuses_gguf_export_with_the_way_to_get_one(base, tmp_path, capsys):
    argv = ["fuse", "--model", str(base("llama")), "--save-path", str(tmp_path / "o")]
    assert main([*argv, "--export-gguf"]) == 3
    err = capsys.readouterr().err
    assert "convert_hf_to_gguf.py" in err
    assert not (tmp_path / "o").exists()

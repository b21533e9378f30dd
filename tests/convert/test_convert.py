"""``loom convert`` against ``mlx_lm.convert``, for every family.

A tiny Hugging Face-layout checkpoint is converted by both tools with the same
flags. The tensors written are identical (same names — mlx-lm nests Qwen3.5
under ``language_model.``, which both loaders accept — same dtypes, same
bits), so is the configs' quantization, and each output loads in both engines with
bit-equal logits and the same greedy tokens as the other output.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.convert import convert
from mlx_loom.errors import ConvertError, HubRefused

from ..adapters import adapterkit as kit

VARIANTS = {
    "plain": {},
    "q4": {"quantize": True},
    "q8g32": {"quantize": True, "q_bits": 8, "q_group_size": 32},
    "mixed_3_6": {"quantize": True, "quant_predicate": "mixed_3_6", "q_group_size": 32},
    # MLX's microscaling modes (Gemma 4's router stays 8-bit affine: mixed modes).
    "mxfp4": {"quantize": True, "q_mode": "mxfp4"},
    "nvfp4": {"quantize": True, "q_mode": "nvfp4"},
    "mxfp8": {"quantize": True, "q_mode": "mxfp8"},
}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in made:
            where = tmp_path_factory.mktemp("hf") / model_type
            made[model_type] = kit.tiny_checkpoint(where, model_type)
        return made[model_type]

    return get


def mlx_lm_convert(src: Path, dst: Path, **options) -> Path:
    from mlx_lm.convert import convert as lm_convert

    with contextlib.redirect_stdout(io.StringIO()):
        lm_convert(str(src), str(dst), **options)
    return dst


def ours(src: Path, dst: Path, **options) -> Path:
    renamed = {("quantize_" if k == "quantize" else k): v for k, v in options.items()}
    return convert(src, dst, progress=False, **renamed)


def tensors_of(path: Path) -> dict[str, mx.array]:
    """Every tensor of a checkpoint, named without a leading ``language_model.``: mlx-lm
    keeps Qwen3.5 under that wrapper and mlx-loom does not (both loaders accept both)."""
    out: dict[str, mx.array] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(file)))
    return {k.removeprefix("language_model."): v for k, v in out.items()}


def unprefixed(quantization: dict | None) -> dict | None:
    """Per-module entries named without mlx-lm's Qwen3.5 ``language_model.`` prefix."""
    if quantization is None:
        return None
    return {k.removeprefix("language_model."): v for k, v in quantization.items()}


def logits_everywhere(paths: list[Path]) -> list[mx.array]:
    from mlx_lm.utils import load_model

    x = kit.prompt(16)
    out = []
    for path in paths:
        out.append(kit.load_ours(path)(x))  # mlx-loom on its oracle path
        out.append(load_model(path)[0](x))
    mx.eval(out)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("model_type", kit.FAMILIES)
def test_the_output_equals_mlx_lm_converts_and_loads_in_both_engines(
    hf, tmp_path, model_type, variant
):
    src, options = hf(model_type), VARIANTS[variant]
    a = ours(src, tmp_path / model_type / "ours", **options)
    b = mlx_lm_convert(src, tmp_path / model_type / "theirs", **options)
    ta, tb = tensors_of(a), tensors_of(b)
    assert set(ta) == set(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and mx.array_equal(ta[name], tb[name]), name
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (a, b))
    assert set(ca) == set(cb)  # (mlx-lm also rewrites some fields its model classes rename)
    for key in ("quantization", "quantization_config"):
        assert unprefixed(ca.get(key)) == unprefixed(cb.get(key))
    first, *rest = logits_everywhere([a, b])
    assert all(mx.array_equal(first, other) for other in rest)


def test_qwen3_5_text_which_mlx_lm_cannot_load_round_trips_through_mlx_loom(hf, tmp_path):
    src = hf("qwen3_5_text")
    out = ours(src, tmp_path / "q", quantize=True, q_bits=8, q_group_size=32)
    x = kit.prompt(16)
    quantized, _ = mlx_loom.load(out)
    again = ours(out, tmp_path / "dense", dequantize=True)
    # Quantized matmul against a dense matmul of the same dequantized weights:
    # different ops, equal up to fp32 summation order.
    assert mx.allclose(quantized(x), mlx_loom.load(again)[0](x), atol=1e-5)


def test_a_cast_to_bfloat16_matches_mlx_lm(hf, tmp_path):
    src = hf("llama")
    a = ours(src, tmp_path / "ours", dtype="bfloat16", quantize=True)
    b = mlx_lm_convert(src, tmp_path / "theirs", dtype="bfloat16", quantize=True)
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta["model.norm.weight"].dtype == mx.bfloat16
    assert ta["model.layers.0.self_attn.q_proj.scales"].dtype == mx.bfloat16
    assert all(mx.array_equal(ta[n], tb[n]) and ta[n].dtype == tb[n].dtype for n in ta)
    first, *rest = logits_everywhere([a, b])
    assert all(mx.array_equal(first, other) for other in rest)


def test_dequantizing_a_quantized_checkpoint_matches_mlx_lm(hf, tmp_path):
    q = mlx_lm_convert(hf("gemma4_text"), tmp_path / "q", quantize=True, q_group_size=32)
    a = ours(q, tmp_path / "ours", dequantize=True)
    b = mlx_lm_convert(q, tmp_path / "theirs", dequantize=True)
    ta, tb = tensors_of(a), tensors_of(b)
    assert set(ta) == set(tb) and not any(n.endswith(".scales") for n in ta)
    assert all(mx.array_equal(ta[n], tb[n]) for n in ta)
    assert "quantization" not in json.loads((a / "config.json").read_text())


def test_the_family_keeps_its_router_at_8_bits(hf, tmp_path):
    config = json.loads(
        (ours(hf("gemma4_text"), tmp_path / "q", quantize=True) / "config.json").read_text()
    )
    assert config["quantization"]["model.layers.0.router.proj"] == {"group_size": 64, "bits": 8}
    assert config["quantization_config"] == config["quantization"]


def test_tokenizer_files_are_copied_and_a_model_card_written(hf, tmp_path):
    src = hf("llama")
    out = ours(src, tmp_path / "out")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert "library_name: mlx" in (out / "README.md").read_text()
    assert mlx_loom.load(out)[1].encode("the cat") == mlx_loom.load(src)[1].encode("the cat")


def test_shards_have_an_index_that_both_engines_read(hf, tmp_path):
    out = convert(hf("qwen3_next"), tmp_path / "out", progress=False, max_shard_bytes=64 << 10)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    first, second = logits_everywhere([out])
    assert mx.array_equal(first, second)


# --- refusals: each before a tensor is read, none leaving a directory behind -------------


def test_an_existing_output_is_refused(hf, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(ConvertError, match="already exists"):
        ours(hf("llama"), tmp_path / "out")


def test_quantize_and_dequantize_together_are_refused(hf, tmp_path):
    with pytest.raises(ConvertError, match="either quantize or dequantize"):
        ours(hf("llama"), tmp_path / "out", quantize=True, dequantize=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value", [("q_bits", 8), ("q_group_size", 64)])
def test_a_packing_a_microscaling_mode_cannot_hold_is_refused(hf, tmp_path, flag, value):
    with pytest.raises(ConvertError, match="mode mxfp4 packs group size 32 at 4 bits only"):
        ours(hf("llama"), tmp_path / "out", quantize=True, q_mode="mxfp4", **{flag: value})
    assert not (tmp_path / "out").exists()


def test_a_recipe_with_a_microscaling_mode_is_refused_as_mlx_lm_does(hf, tmp_path):
    with pytest.raises(ConvertError, match="cannot be combined with --q-mode nvfp4"):
        options = {"q_mode": "nvfp4", "quant_predicate": "mixed_3_6"}
        ours(hf("llama"), tmp_path / "o", quantize=True, **options)


@pytest.mark.parametrize("bits, group", [(7, 64), (4, 48)])
def test_an_unsupported_packing_is_refused(hf, tmp_path, bits, group):
    with pytest.raises(ConvertError, match="not supported"):
        ours(hf("llama"), tmp_path / "out", quantize=True, q_bits=bits, q_group_size=group)
    assert not list(tmp_path.iterdir())


def test_a_recipe_without_quantize_is_refused(hf, tmp_path):
    with pytest.raises(ConvertError, match="without -q"):
        ours(hf("llama"), tmp_path / "out", quant_predicate="mixed_3_6")


def test_upload_is_refused_offline_before_any_work(hf, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubRefused) as info:
        ours(hf("llama"), tmp_path / "out", upload_repo="me/tiny-mlx")
    assert "huggingface-cli upload me/tiny-mlx" in info.value.fix
    assert not (tmp_path / "out").exists()


def test_a_failed_upload_keeps_the_converted_model(hf, tmp_path, monkeypatch):
    import huggingface_hub

    class Unreachable:
        def create_repo(self, **_):
            raise ConnectionError("no route to host")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "HfApi", Unreachable)
    with pytest.raises(HubRefused, match="no route to host") as info:
        ours(hf("llama"), tmp_path / "out", upload_repo="me/tiny-mlx")
    assert str(tmp_path / "out") in info.value.fix
    assert mlx_loom.load(tmp_path / "out")


def test_a_failure_while_writing_leaves_no_partial_directory(hf, tmp_path, monkeypatch):
    from mlx_loom.artifacts import writer

    def broken(*_, **__):
        raise OSError("disk full")

    monkeypatch.setattr(writer, "_write_shard", broken)
    with pytest.raises(ConvertError, match="cannot write the converted model .*: disk full"):
        ours(hf("llama"), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# --- the command -------------------------------------------------------------------------


def test_loom_convert_takes_mlx_lm_converts_flags(hf, tmp_path, capsys):
    out = tmp_path / "q"
    argv = ["convert", "--hf-path", str(hf("qwen3_5")), "--mlx-path", str(out), "-q"]
    code = main([*argv, "--q-bits", "8", "--q-group-size", "32", "--dtype", "float32"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"loom: wrote {out}" in err and "converting" in err  # the progress bar
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}


def test_a_quantization_no_width_divides_loads_dense_in_both_engines_with_a_note(
    tmp_path, capsys
):
    # Hidden 96 and intermediate 160: no input width is a multiple of 64, so
    # both converters pack nothing yet write the quantization block. mlx-lm
    # loads that as the dense model; so must mlx-loom (it used to refuse it).
    src = kit.tiny_checkpoint(
        tmp_path / "hf", "llama", hidden_size=96, intermediate_size=160, num_attention_heads=2
    )
    a, b = tmp_path / "ours", tmp_path / "theirs"
    assert main(["convert", "--hf-path", str(src), "--mlx-path", str(a), "-q"]) == 0
    assert "no module was quantized" in capsys.readouterr().err
    mlx_lm_convert(src, b, quantize=True)
    for path in (a, b):
        config = json.loads((path / "config.json").read_text())
        assert config["quantization"]["group_size"] == 64
        assert not any(n.endswith(".scales") for n in tensors_of(path))
    first, *rest = logits_everywhere([a, b])
    assert all(mx.array_equal(first, other) for other in rest)
    assert main(["generate", "--model", str(a), "-p", "hi", "-m", "2"]) == 0


@pytest.mark.parametrize(
    "flags, code, message",
    [
        (["--trust-remote-code"], 3, "which mlx-loom never does"),
        (["-q", "--q-mode", "nvfp4", "--q-bits", "8"], 1, "mode nvfp4 packs group size 16"),
        (["-q", "-d"], 1, "either quantize or dequantize"),
    ],
)
def test_loom_convert_exit_codes(hf, tmp_path, capsys, flags, code, message):
    argv = ["convert", "--hf-path", str(hf("llama")), "--mlx-path", str(tmp_path / "o")]
    assert main([*argv, *flags]) == code
    err = capsys.readouterr().err
    assert message in err and "fix:" in err


@pytest.mark.parametrize("flag, value", [("--q-bits", "7"), ("--q-group-size", "48")])
def test_an_unsupported_packing_flag_is_a_usage_error(hf, tmp_path, capsys, flag, value):
    argv = ["convert", "--hf-path", str(hf("llama")), "--mlx-path", str(tmp_path / "o"), "-q"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "fix:" in err
    assert not (tmp_path / "o").exists()

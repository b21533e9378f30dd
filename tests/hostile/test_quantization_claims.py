"""Quantization claims and the tensors behind them, as mlx-lm reads them.

A module is quantized exactly when its scales are present: a global claim with
no scales anywhere is a dense model (what ``mlx_lm.convert -q`` writes when no
width divides the group size); packed shapes that contradict the claim are a
WeightsError naming the tensors.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.errors import WeightsError

from .conftest import FAMILIES, variant


@pytest.fixture(params=FAMILIES)
def family(request, family_dirs):
    return request.param, family_dirs[request.param]


def claim(key: str, bits: int = 4, group_size: int = 32, mode: str = "affine"):
    def edit(config: dict) -> None:
        config[key] = {"group_size": group_size, "bits": bits, "mode": mode}

    return edit


@pytest.mark.parametrize("key", ["quantization", "quantization_config"])
def test_a_claim_over_float_weights_loads_the_dense_model_as_mlx_lm_does(family, key, tmp_path):
    # mlx-lm's rule: a module is quantized exactly when its scales are present.
    # ``mlx_lm.convert -q`` itself writes such a config when no input width
    # divides the group size; refusing it refused checkpoints mlx-lm loads.
    _, src = family
    path = variant(src, tmp_path / "m", config=claim(key))
    tokens = mx.array([[1, 5, 9, 3]])
    claimed, _ = mlx_loom.load(path)
    plain, _ = mlx_loom.load(src)
    assert mx.array_equal(claimed(tokens), plain(tokens)).item()


def test_a_claim_over_float_weights_generates_from_the_cli(family, tmp_path):
    _, src = family
    path = variant(src, tmp_path / "m", config=claim("quantization"))
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(["generate", "--model", str(path), "-m", "1"])
    assert code == 0, err.getvalue()


def quantized(src, target, bits_claimed: int, mode_claimed: str = "affine"):
    """``src`` with its quantizable weights packed at 4 bits, group 32 (affine); the config
    claims ``bits_claimed`` in ``mode_claimed``."""
    model, _ = mlx_loom.load(src)
    module = model.module
    nn.quantize(
        module,
        group_size=32,
        bits=4,
        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0,
    )
    weights = dict(tree_flatten(module.parameters()))
    path = variant(src, target, config=claim("quantization", bits=bits_claimed, mode=mode_claimed))
    (path / "model.safetensors").unlink()
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    return path


def test_a_correct_claim_over_packed_weights_loads(family, tmp_path):
    _, src = family
    model, tok = mlx_loom.load(quantized(src, tmp_path / "q4", bits_claimed=4))
    assert mlx_loom.generate(model, tok, "hi", max_tokens=2) is not None


def test_packed_widths_that_disagree_with_the_claimed_bits_are_refused(family, tmp_path):
    _, src = family
    path = quantized(src, tmp_path / "q8", bits_claimed=8)
    with pytest.raises(WeightsError) as info:
        mlx_loom.load(path)
    # The strict loader compares the packed shapes the claim implies with the
    # stored ones before any graph is built: every disagreeing tensor is named.
    message = info.value.message
    assert "do not match the model" in message and "wrong shape" in message
    assert ".weight" in message and info.value.fix


def test_affine_packing_claimed_as_mxfp4_is_refused_though_the_shapes_agree(family, tmp_path):
    # mxfp4 packs 4 bits in groups of 32 too: only the scales' dtype (uint8, not
    # float) and the biases (none) tell the modes apart, and both are checked.
    _, src = family
    path = quantized(src, tmp_path / "mx", bits_claimed=4, mode_claimed="mxfp4")
    with pytest.raises(WeightsError) as info:
        mlx_loom.load(path)
    message = info.value.message
    assert ".scales" in message and ".biases" in message and info.value.fix


def test_a_claim_that_is_not_an_object_is_a_config_error_naming_the_field(family, tmp_path):
    _, src = family
    path = variant(src, tmp_path / "m", config=lambda c: c.update(quantization=[4, 32]))
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(["explain", str(path)])
    assert code == 1 and "quantization is a list, not an object" in err.getvalue()

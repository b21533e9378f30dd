"""Adapters and configs whose values would poison the model: refused like a NaN checkpoint.

Before: ``"num_layers": null`` raised a bare ``AssertionError`` (and under
``python -O`` went on); NaN factors, a scale past float32, a string scale and
a full fine-tune of ``embed_tokens`` holding NaN were accepted and gave NaN
logits; a Gemma 4 ``final_logit_softcapping`` of 0 zeroed every logit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.adapters import load_adapter
from mlx_loom.adapters.config import read_adapter_config
from mlx_loom.errors import AdapterError, ConfigError

from ..adapters import adapterkit as kit
from .bounded import run_bounded
from .conftest import variant


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return kit.tiny_checkpoint(tmp_path_factory.mktemp("adapter-base") / "llama", "llama")


@pytest.fixture
def adapter(llama, tmp_path) -> Path:
    return kit.write_adapter(llama, tmp_path / "adapter", num_layers=1)


def edit_config(adapter: Path, edit) -> Path:
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return adapter


def edit_tensors(adapter: Path, edit) -> Path:
    path = adapter / "adapters.safetensors"
    tensors = dict(mx.load(str(path)))
    edit(tensors)
    mx.save_safetensors(str(path), tensors)
    return adapter


def refused(llama, adapter, *needles: str) -> AdapterError:
    model, _ = mlx_loom.load(llama)
    with pytest.raises(AdapterError) as info:
        load_adapter(model, adapter)
    for needle in needles:
        assert needle in info.value.message, info.value.message
    assert info.value.fix and model.adapter is None
    return info.value


def test_num_layers_null_is_a_typed_error(llama, adapter):
    edit_config(adapter, lambda c: c.update(num_layers=None))
    refused(llama, adapter, "num_layers is null")


def test_num_layers_null_is_refused_under_python_O(llama, adapter):
    """No assert guards it: ``-O`` (PYTHONOPTIMIZE) strips asserts."""
    outcome = run_bounded(
        """
import sys
assert sys.flags.optimize == 1
import mlx_loom
from mlx_loom.adapters import AdapterConfig
from mlx_loom.adapters.targets import select_targets
model, _ = mlx_loom.load(ARGS["base"])
config = AdapterConfig.model_validate(
    {"num_layers": None, "lora_parameters": {"rank": 2, "scale": 1.0}}
)
select_targets(model.module, config)
""",
        args={"base": str(llama)},
        env={"PYTHONOPTIMIZE": "1"},
        timeout_s=60,
    )
    outcome.expect_error("AdapterError", "num_layers=None")


@pytest.mark.parametrize(
    "scale, needle",
    [(1e39, "within float32"), (-1e300, "within float32"), ("10", "scale"), (math.inf, "scale")],
)
def test_a_scale_that_is_not_a_float32_number_is_refused(llama, adapter, scale, needle):
    # (Python's json writes math.inf as Infinity, which the bounded parser reads)
    edit_config(adapter, lambda c: c["lora_parameters"].update(scale=scale))
    with pytest.raises(AdapterError, match=needle):
        read_adapter_config(adapter)


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_factors_holding_nan_or_inf_are_refused_naming_the_tensor(llama, adapter, poison):
    def edit(tensors):
        name = sorted(n for n in tensors if n.endswith("lora_b"))[0]
        tensors[name] = tensors[name].at[0, 0].add(poison)

    edit_tensors(adapter, edit)
    refused(llama, adapter, "holds NaN or Inf values in", "lora_b")


def test_a_full_fine_tune_of_the_embedding_holding_nan_is_refused(llama, tmp_path):
    base = dict(mx.load(str(llama / "model.safetensors")))
    embed = base["model.embed_tokens.weight"].at[3, 1].add(math.nan)
    adapter = tmp_path / "full"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), {"model.embed_tokens.weight": embed})
    (adapter / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full"}))
    refused(llama, adapter, "'model.embed_tokens.weight'")


def test_a_clean_adapter_still_applies(llama, adapter):
    model, _ = mlx_loom.load(llama)
    load_adapter(model, adapter)
    logits = model(mx.array([[1, 2, 3]]))
    assert bool(mx.all(mx.isfinite(logits)).item())


@pytest.mark.parametrize("cap", [0.0, -30.0])
def test_gemma4_softcapping_zero_or_negative_is_refused(family_dirs, tmp_path, cap):
    path = variant(
        family_dirs["gemma4_text"],
        tmp_path / "g",
        config=lambda c: c.update(final_logit_softcapping=cap),
    )
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        mlx_loom.load(path)

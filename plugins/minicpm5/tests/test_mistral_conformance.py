"""The conformance kit's behaviour checks on the Mistral model types, not only on Llama.

The kit runs its behaviour checks (batching, prompt-cache reuse, trimming,
speculation, KV quantization and codecs, the compiled step, the parallel
plan) once per implementation, on the first model type it builds — Llama
here. Declaring the family with one Mistral model type at a time puts every
capability to the test on a graph whose layers all slide (``mistral``: a
window of 8 that the kit's prompts wrap) and on Llama 4 query scaling
(``ministral3``).
"""

from __future__ import annotations

import dataclasses
import types

import pytest

from mlx_loom.testing import run_conformance
from mlx_loom_minicpm5 import plugin


@pytest.mark.parametrize("model_type", ["mistral", "ministral3"])
def test_the_kit_passes_on_the_model_type(model_type):
    (declared,) = [m for m in plugin.FAMILY.model_types if m.name == model_type]
    family = dataclasses.replace(plugin.FAMILY, model_types=(declared,), profiles=())
    stand_in = types.SimpleNamespace(
        loom_plugin_api_version=plugin.loom_plugin_api_version,
        loom_families=plugin.hookimpl(lambda: [family]),
    )
    report = run_conformance("minicpm5", plugin=stand_in, collisions=False)
    assert report.passed, report.format()
    assert f"PASS speculative-rounds[{model_type}]" in report.format()

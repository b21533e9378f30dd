"""The conformance kit's ``parallel-plan`` check: it passes a plan that splits, and
names the fault of one that cannot.

The check splits the tiny model for both ranks in one process; these tests
hand it the checkpoints of the parallel suite directly, so no conformance
run (and no second process) is needed.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

import mlx_loom
from mlx_loom.testing._model_checks import check_parallel_plan

from .support import write_tiny


def target(path):
    model, tokenizer = mlx_loom.load(path)
    resolved = mlx_loom.resolve_model(path)
    return SimpleNamespace(
        implementation=resolved.binding.implementation,
        resolved=resolved,
        model=model,
        tokenizer=tokenizer,
    )


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "gemma4_text"])
def test_each_family_plan_splits_its_tiny_model_in_both_modes(checkpoints, model_type):
    result = check_parallel_plan(target(checkpoints[model_type]))
    assert result.status == "pass", result.detail
    assert "tensor: " in result.detail and "pipeline: " in result.detail


def test_a_tiny_config_whose_heads_do_not_divide_fails_naming_the_field(tmp_path):
    one_head = write_tiny(tmp_path / "m", "llama", num_attention_heads=1)
    result = check_parallel_plan(target(one_head))
    assert result.status == "fail"
    assert "tensor: the tiny config does not split across 2 processes" in result.detail
    assert "num_attention_heads = 1" in result.detail


def test_an_implementation_without_a_plan_is_skipped_as_not_declared(checkpoints):
    subject = target(checkpoints["llama"])
    subject.implementation = replace(subject.implementation, parallel=None)
    result = check_parallel_plan(subject)
    assert (result.status, result.detail) == ("skip", "capability not declared")

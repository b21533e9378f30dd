"""The repository's family plugins pass the conformance suite, as installed.

Each runs exactly what ``loom plugins check NAME`` runs; on failure the
whole report (one line per check) is the assertion message.
"""

from __future__ import annotations

import pytest

from mlx_loom.testing import run_conformance

FAMILIES = ("minicpm5", "qwen3_next", "gemma4", "qwen3", "gpt_oss")


@pytest.mark.parametrize("family", FAMILIES)
def test_family_plugin_conforms(family, tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_LOOM_PLUGINS", raising=False)
    report = run_conformance(family, workdir=tmp_path)
    assert report.available, report.format()
    assert report.passed, report.format()
    plan = [r for r in report.results if r.name.startswith("parallel-plan[")]
    assert plan and all(r.status == "pass" for r in plan), report.format()

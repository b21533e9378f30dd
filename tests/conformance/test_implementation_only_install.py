"""A tuned implementation for one exact artifact, installed for real, changes that artifact only.

The minicpm5 family and the implementation-only ``tuned`` plugin
(:mod:`.tuned_plugin`) are pip-installed into a temporary directory; every
step runs in a subprocess that sees the core, its dependencies and those two
packages only, so discovery goes through real entry points.

Two tiny Llama checkpoints share one config: the *artifact* (bf16 weights,
the one the tuned plugin's exact-artifact profile names by fingerprint) and
*another* (fp32 weights). Without the tuned plugin both resolve to
minicpm5's family profile; with it, only the artifact changes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mlx_loom.host import PluginHost, PluginPolicy, resolve_model
from mlx_loom.testing import write_checkpoint
from mlx_loom_minicpm5.plugin import TINY_CONFIG, checkpoint_tensors

from ..core.sitetools import isolated_site, pip_install_target, run_loom
from . import tuned_plugin

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("tuned")
    fp32 = checkpoint_tensors(TINY_CONFIG)
    bf16 = {name: (shape, "bfloat16") for name, (shape, _) in fp32.items()}
    artifact = write_checkpoint(root / "artifact", TINY_CONFIG, bf16)
    other = write_checkpoint(root / "other", TINY_CONFIG, fp32)
    alone = PluginHost(policy=PluginPolicy.allow("minicpm5"))
    before = {
        label: resolve_model(path, host=alone).summary
        for label, path in (("artifact", artifact), ("other", other))
    }
    package = root / "loom-tuned-llama"
    package.mkdir()
    (package / "pyproject.toml").write_text(tuned_plugin.PYPROJECT)
    (package / "loom_tuned_llama.py").write_text(
        tuned_plugin.source(
            artifact=before["artifact"].artifact_fingerprint,
            config=before["artifact"].config_fingerprint,
        )
    )
    family = shutil.copytree(
        REPO / "plugins" / "minicpm5",
        root / "mlx-loom-minicpm5",
        ignore=shutil.ignore_patterns("tests", "build", "*.egg-info", "__pycache__"),
    )
    installed = root / "installed"
    pip_install_target([family, package], installed)
    return {
        "paths": [installed, isolated_site(root)],
        "artifact": artifact,
        "other": other,
        "before": before,
    }


def explain(world, which: str) -> dict:
    result = run_loom(["explain", str(world[which]), "--json"], paths=world["paths"])
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_without_the_tuned_plugin_both_checkpoints_get_the_family_profile(world):
    for summary in world["before"].values():
        assert (summary.profile, summary.implementation) == ("minicpm5/llama", "minicpm5.llama")


def test_with_it_installed_the_artifact_it_names_gets_the_tuned_implementation(world):
    summary = explain(world, "artifact")
    assert (summary["plugin"], summary["profile"], summary["implementation"]) == (
        "minicpm5",
        tuned_plugin.PROFILE,
        tuned_plugin.IMPLEMENTATION,
    )
    assert summary["graph"] == "minicpm5.llama"


def test_with_it_installed_every_other_checkpoint_resolves_as_before(world):
    summary = explain(world, "other")
    assert (summary["profile"], summary["implementation"]) == ("minicpm5/llama", "minicpm5.llama")


def test_the_tuned_artifact_generates_through_the_tuned_implementation(world):
    result = run_loom(
        ["generate", "--model", str(world["artifact"]), "-p", "hello", "-m", "3", "--verbose"],
        paths=world["paths"],
    )
    assert result.returncode == 0, result.stderr
    assert f"implementation: {tuned_plugin.IMPLEMENTATION}" in result.stderr


def test_loom_plugins_check_accepts_the_implementation_only_plugin(world):
    result = run_loom(["plugins", "check", tuned_plugin.NAME], paths=world["paths"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS registrations — implementation-only plugin" in result.stdout
    assert "tiny checkpoints of ['llama'] resolve as before" in result.stdout

"""Entry-point discovery for real: plugin packages pip-installed from a temporary directory.

Each test runs the real ``loom`` command in a subprocess that sees the core,
its dependencies, and only the plugins the test installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .sitetools import isolated_site, pip_install_target, run_loom
from .toyfamily import PLUGIN_SOURCE, PYPROJECT, write_toy_checkpoint

SUPPORT = Path(__file__).with_name("toyfamily.py")


def make_package(
    root: Path,
    *,
    name: str,
    dist: str,
    version: str,
    extra: str = "",
    model_type: str = "toy_lm",
    api_version: str = "1.1",
) -> Path:
    pkg = root / dist
    pkg.mkdir(parents=True)
    module = f"loom_{name}"
    (pkg / "pyproject.toml").write_text(
        PYPROJECT.format(dist=dist, version=version, name=name, module=module)
    )
    (pkg / f"{module}.py").write_text(
        PLUGIN_SOURCE.format(extra=extra, model_type=model_type, name=name, api_version=api_version)
    )
    shutil.copy(SUPPORT, pkg / "toyfamily_support.py")
    return pkg


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugins")
    good = make_package(root, name="toygood", dist="loom-toy-good", version="1.2.3")
    broken = make_package(
        root,
        name="toybroken",
        dist="loom-toy-broken",
        version="0.0.1",
        extra="raise ImportError('needs libfoo, which is not installed')",
        model_type="toy_broken",
    )
    old = make_package(
        root,
        name="toyold",
        dist="loom-toy-old",
        version="0.9.0",
        model_type="toy_old",
        api_version="1.0",
    )
    target = root / "installed"
    pip_install_target([good, broken, old], target)
    return {"bare": isolated_site(root), "installed": target}


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory):
    return write_toy_checkpoint(tmp_path_factory.mktemp("ckpt") / "toy")


def loom(args, sites, *, installed=True, env=None):
    paths = ([sites["installed"]] if installed else []) + [sites["bare"]]
    return run_loom(args, paths=paths, env=env)


def test_plugins_with_no_family_installed_lists_none(sites):
    result = loom(["plugins"], sites, installed=False)
    assert result.returncode == 0, result.stderr
    assert "No mlx-loom plugins are installed." in result.stdout
    assert "pip install mlx-loom-minicpm5" in result.stdout


def test_explain_with_no_family_installed_refuses_and_names_the_package(sites, tmp_path):
    ckpt = write_toy_checkpoint(tmp_path / "llama", model_type="llama")
    result = loom(["explain", str(ckpt)], sites, installed=False)
    assert result.returncode == 3
    assert "model_type 'llama' needs the 'minicpm5' family plugin, which is not installed" in (
        result.stderr
    )
    assert "fix: pip install mlx-loom-minicpm5" in result.stderr


def test_installed_plugin_is_discovered_with_distribution_and_version(sites):
    result = loom(["plugins", "--json"], sites)
    assert result.returncode == 0, result.stderr
    records = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    good = records["toygood"]
    assert (good["distribution"], good["version"], good["status"]) == (
        "loom-toy-good",
        "1.2.3",
        "loaded",
    )
    assert good["registers"]["implementations"] == ["toygood.lm"]


def test_a_plugin_that_fails_to_import_is_quarantined_and_the_cli_keeps_working(sites):
    result = loom(["plugins"], sites)
    assert result.returncode == 0, result.stderr
    assert "toybroken  loom-toy-broken 0.0.1  quarantined" in result.stdout
    assert "import failed: ImportError: needs libfoo, which is not installed" in result.stdout
    assert "toygood  loom-toy-good 1.2.3  loaded" in result.stdout


def test_quarantine_keeps_the_traceback_for_json_readers(sites):
    records = {
        p["name"]: p for p in json.loads(loom(["plugins", "--json"], sites).stdout)["plugins"]
    }
    assert "Traceback" in records["toybroken"]["traceback"]


def test_a_plugin_written_for_the_four_hooks_of_api_1_1_loads(sites):
    records = {
        p["name"]: p for p in json.loads(loom(["plugins", "--json"], sites).stdout)["plugins"]
    }
    assert (records["toygood"]["status"], records["toygood"]["api_version"]) == ("loaded", "1.1")


def test_a_plugin_written_for_api_1_0_is_refused_naming_the_version_it_needs(sites):
    records = {
        p["name"]: p for p in json.loads(loom(["plugins", "--json"], sites).stdout)["plugins"]
    }
    old = records["toyold"]
    assert old["status"] == "quarantined"
    assert "written for plugin API 1.0" in old["reason"]
    assert "needs plugin API 1.1 or later" in old["reason"]


def test_explain_selects_the_installed_plugin(sites, toy_checkpoint):
    result = loom(["explain", str(toy_checkpoint), "--json"], sites)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["model_type"] == "toy_lm"
    assert summary["plugin"] == "toygood"
    assert summary["profile"] == "toygood/family"
    assert summary["implementation"] == "toygood.lm"
    assert summary["backend"] == "cpu"


def test_explain_human_output_names_profile_and_reason(sites, toy_checkpoint):
    result = loom(["explain", str(toy_checkpoint)], sites)
    assert result.returncode == 0, result.stderr
    assert "toygood/family  (family profile for model_type 'toy_lm')" in result.stdout
    assert "kernels: none needed" in result.stdout


def test_explain_refuses_a_model_type_claimed_only_by_a_quarantined_plugin(sites, tmp_path):
    ckpt = write_toy_checkpoint(tmp_path / "b", model_type="toy_broken")
    result = loom(["explain", str(ckpt)], sites)
    assert result.returncode == 3
    assert "toybroken (loom-toy-broken 0.0.1): import failed" in result.stderr


def test_policy_from_environment_blocks_plugins(sites, toy_checkpoint):
    result = loom(["plugins"], sites, env={"MLX_LOOM_PLUGINS": "toybroken"})
    assert "toygood  loom-toy-good 1.2.3  blocked" in result.stdout
    refused = loom(["explain", str(toy_checkpoint)], sites, env={"MLX_LOOM_PLUGINS": ""})
    assert refused.returncode == 3
    assert "blocked by plugin policy (none)" in refused.stderr


def test_policy_naming_an_uninstalled_plugin_is_a_usage_error(sites):
    result = loom(["plugins"], sites, env={"MLX_LOOM_PLUGINS": "toygood,gemma9"})
    assert result.returncode == 2
    assert "names ['gemma9'], which match no installed plugin" in result.stderr


def test_explain_of_a_missing_directory_is_a_clear_error(sites, tmp_path):
    result = loom(["explain", str(tmp_path / "nowhere")], sites)
    assert result.returncode in (1, 3)
    assert "nowhere" in result.stderr
    assert "fix:" in result.stderr

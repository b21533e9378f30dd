"""``loom plugins new`` writes a package a third party could publish as is.

One generated package is pip-installed into a temporary directory; every
step runs the real command line in a subprocess that sees the core, its
dependencies and that package only (no family plugins of this repository):
discovery, ``loom explain``, ``loom generate``, ``loom plugins check``, and
the package's own tests (which use the kit's pytest fixtures and its
mlx-lm parity harness).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..core.sitetools import CORE_SRC, isolated_site, pip_install_target, run_loom

NAME = "demo_lm"

#: A pip install and a subprocess per step: ~1 minute for the module on 2 cores.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("template")
    package = root / "mlx-loom-demo-lm"
    bare = isolated_site(root)
    created = run_loom(["plugins", "new", NAME, "--path", str(package)], paths=[bare])
    assert created.returncode == 0, created.stderr
    target = root / "installed"
    pip_install_target([package], target)
    paths = [target, bare]
    checkpoint = root / "demo-checkpoint"
    python(
        "from mlx_loom.testing import write_checkpoint\n"
        "from mlx_loom_demo_lm.plugin import TINY_CONFIG, checkpoint_tensors\n"
        f"write_checkpoint({str(checkpoint)!r}, TINY_CONFIG, checkpoint_tensors(TINY_CONFIG))\n",
        paths=paths,
    )
    return {
        "package": package,
        "paths": paths,
        "checkpoint": checkpoint,
        "created": created,
        "bare": [bare],
    }


def python(code: str, *, paths: list[Path], args: list[str] = (), cwd: Path | None = None):
    environ = {k: v for k, v in os.environ.items() if k not in ("MLX_LOOM_PLUGINS", "PYTHONPATH")}
    environ["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(CORE_SRC)])
    command = [sys.executable, "-S", *(["-c", code] if code else []), *args]
    result = subprocess.run(
        command, capture_output=True, text=True, env=environ, cwd=cwd, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_new_writes_a_package_with_entry_point_graph_loader_profile_and_tests(site):
    package = site["package"]
    pyproject = (package / "pyproject.toml").read_text()
    assert '[project.entry-points.mlx_loom]\ndemo_lm = "mlx_loom_demo_lm.plugin"' in pyproject
    for module in ("config", "graph", "loader", "plugin"):
        assert (package / "src" / "mlx_loom_demo_lm" / f"{module}.py").is_file()
    assert (package / "tests" / "test_conformance.py").is_file()
    assert "loom plugins check demo_lm" in site["created"].stdout


def test_new_refuses_to_overwrite_an_existing_project(site):
    result = run_loom(["plugins", "new", NAME, "--path", str(site["package"])], paths=site["bare"])
    assert result.returncode == 1
    assert "already exists and is not an empty directory" in result.stderr


def test_new_refuses_a_name_that_cannot_be_a_package(site, tmp_path):
    result = run_loom(
        ["plugins", "new", "Bad-Name", "--path", str(tmp_path / "x")], paths=site["bare"]
    )
    assert result.returncode == 1
    assert "Plugin name 'Bad-Name' is not usable" in result.stderr


def test_installed_package_is_discovered_by_loom_plugins(site):
    result = run_loom(["plugins", "--json"], paths=site["paths"])
    assert result.returncode == 0, result.stderr
    records = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    assert records[NAME]["status"] == "loaded"
    assert records[NAME]["distribution"] == "mlx-loom-demo-lm"
    assert records[NAME]["registers"]["implementations"] == ["demo_lm.decoder"]


def test_explain_selects_the_new_plugin_for_a_checkpoint_it_claims(site):
    result = run_loom(["explain", str(site["checkpoint"]), "--json"], paths=site["paths"])
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["plugin"], summary["profile"], summary["implementation"]) == (
        NAME,
        "demo_lm/decoder",
        "demo_lm.decoder",
    )


def test_the_new_plugin_generates_text(site):
    result = run_loom(
        [
            "generate",
            "--model",
            str(site["checkpoint"]),
            "--prompt",
            "hello world",
            "--max-tokens",
            "5",
        ],
        paths=site["paths"],
    )
    assert result.returncode == 0, result.stderr
    assert "Generation: " in result.stderr  # the stats line after the streamed text
    assert result.stdout.strip()


def test_the_new_plugin_passes_loom_plugins_check(site):
    result = run_loom(["plugins", "check", NAME], paths=site["paths"])
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("PASS hooks — ")
    assert f"PASS weight-coverage[{NAME}] — " in result.stdout
    assert f"SKIP speculative-rounds[{NAME}] — (capability not declared)" in lines
    assert lines[-1].startswith(f"plugin {NAME!r} conforms: ")
    assert not [line for line in lines[:-1] if line.startswith("FAIL")]


def test_check_of_a_plugin_that_is_not_installed_is_a_refusal(site):
    result = run_loom(["plugins", "check", "not_installed"], paths=site["paths"])
    assert result.returncode == 3
    assert "plugin 'not_installed' is not installed (installed: demo_lm)" in result.stderr


def test_check_of_a_blocked_plugin_is_a_refusal(site):
    env = {"MLX_LOOM_PLUGINS": "-" + NAME}
    result = run_loom(["plugins", "check", NAME], paths=site["paths"], env=env)
    assert result.returncode == 3
    assert "blocked by plugin policy" in result.stderr


def test_plain_loom_plugins_still_lists_plugins(site):
    result = run_loom(["plugins"], paths=site["paths"])
    assert result.returncode == 0, result.stderr
    assert f"{NAME}  mlx-loom-demo-lm 0.1.0  loaded" in result.stdout


def test_the_generated_package_passes_its_own_tests_with_the_kit_fixtures(site):
    result = python(
        "",
        paths=site["paths"],
        args=["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=site["package"],
    )
    assert "3 passed" in result.stdout, result.stdout

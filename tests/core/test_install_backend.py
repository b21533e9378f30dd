"""Which MLX backend an install of the core brings on Linux, read from the metadata its build
declares (offline): exactly one — ``mlx-cpu`` by default, MLX's CUDA package with
``MLX_LOOM_BACKEND=cuda`` — never both (they install the same ``libmlx.so``)."""

from __future__ import annotations

import importlib.metadata
import os
import runpy
import shutil
import subprocess
import sys
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

CORE = Path(__file__).resolve().parents[2] / "core"
LINUX = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
MACOS = {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64"}
BACKEND_PACKAGES = {"mlx-cpu", "mlx-cuda-12", "mlx-cuda-13", "mlx-metal"}


@pytest.fixture(scope="module")
def build_rules() -> dict:
    return runpy.run_path(str(CORE / "setup.py"), run_name="build_rules")


def mlx_backends(requires: list[str], env: dict[str, str]) -> set[str]:
    """MLX backend packages that ``requires`` installs on ``env``, through mlx's own extras
    (read from the installed mlx's metadata: the same version the core pins)."""
    found: set[str] = set()
    mlx_requires = [Requirement(r) for r in importlib.metadata.requires("mlx") or []]
    for text in requires:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        if req.name in BACKEND_PACKAGES:
            found.add(req.name)
        if req.name != "mlx":
            continue
        assert req.specifier.contains(importlib.metadata.version("mlx")), text
        for extra in ["", *req.extras]:
            for dep in mlx_requires:
                if dep.name in BACKEND_PACKAGES and (
                    dep.marker is None or dep.marker.evaluate({**env, "extra": extra})
                ):
                    found.add(dep.name)
    return found


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        (None, {"mlx-cpu"}),
        ("cpu", {"mlx-cpu"}),
        ("cuda", {"mlx-cuda-12"}),
        ("cuda12", {"mlx-cuda-12"}),
        ("cuda13", {"mlx-cuda-13"}),
    ],
)
def test_each_backend_choice_installs_exactly_its_mlx_package_on_linux(
    build_rules, backend, expected
):
    env = {} if backend is None else {"MLX_LOOM_BACKEND": backend}
    requires = build_rules["requirements"](env)
    assert mlx_backends(requires, LINUX) == expected
    # On a Mac mlx brings Metal, whatever was asked for Linux.
    assert mlx_backends(requires, MACOS) == {"mlx-metal"}


def test_an_unknown_backend_stops_the_build_with_the_choices_named(build_rules):
    with pytest.raises(SystemExit, match="cuda13"):
        build_rules["requirements"]({"MLX_LOOM_BACKEND": "rocm"})


@pytest.mark.parametrize(("backend", "expected"), [(None, "mlx-cpu"), ("cuda", "mlx-cuda-12")])
def test_the_built_metadata_names_one_backend(tmp_path, backend, expected):
    """What pip reads: the core's METADATA as setuptools writes it (no network, no compiler).

    Built from a copy of the core's build files (and an empty package), so the
    build's egg-info is not left in the source tree, where ``importlib.metadata``
    would find it before the installed distribution.
    """
    core = tmp_path / "core"
    (core / "src" / "mlx_loom").mkdir(parents=True)
    (core / "src" / "mlx_loom" / "__init__.py").write_text("")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(CORE / name, core / name)
    out_dir = tmp_path / "metadata"
    out_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MLX_LOOM_BACKEND"}
    if backend is not None:
        env["MLX_LOOM_BACKEND"] = backend
    script = (
        "import sys, setuptools.build_meta as b;"
        "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(out_dir)],
        cwd=core,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    info = out_dir / out.stdout.strip().splitlines()[-1] / "METADATA"
    requires = Parser().parsestr(info.read_text()).get_all("Requires-Dist") or []
    assert mlx_backends(requires, LINUX) == {expected}

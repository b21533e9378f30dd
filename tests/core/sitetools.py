"""Run the real ``loom`` CLI in a subprocess against a controlled set of installed plugins.

``isolated_site`` mirrors this interpreter's site-packages minus every
mlx-loom family plugin, so a subprocess started with ``python -S`` and that
directory on ``PYTHONPATH`` sees the core and its dependencies but no
plugins — exactly what a user who installed only ``mlx-loom`` sees. Plugins a
test installs with ``pip install --target`` are added in front.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

CORE_SRC = Path(__file__).resolve().parents[2] / "core" / "src"


def _is_plugin_entry(name: str) -> bool:
    """A family plugin's install record (``mlx_loom_<family>...``), never the core's own.

    The core's record normalises to ``mlx_loom_0.1.0...`` (a version follows the
    name), so a plugin is told apart by a letter after ``mlx_loom_``; dropping the
    core's record would also drop its pytest fixtures from the isolated site.
    """
    lowered = name.lower().replace("-", "_")
    return re.match(r"(__editable___?\.?)?mlx_loom_[a-z]", lowered) is not None


def isolated_site(root: Path) -> Path:
    site = root / "site-without-plugins"
    if site.exists():
        return site
    site.mkdir(parents=True)
    purelib = Path(sysconfig.get_paths()["purelib"])
    for entry in purelib.iterdir():
        if not _is_plugin_entry(entry.name):
            (site / entry.name).symlink_to(entry)
    return site


def pip_install_target(packages: list[Path], target: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            *map(str, packages),
        ],
        check=True,
        capture_output=True,
    )


def run_loom(
    args: list[str],
    *,
    paths: list[Path],
    env: dict[str, str] | None = None,
    stdin: str | None = None,
) -> subprocess.CompletedProcess:
    """``loom ARGS`` with only ``paths`` (plus the core's sources) importable."""
    environ = {k: v for k, v in os.environ.items() if k not in ("MLX_LOOM_PLUGINS", "PYTHONPATH")}
    environ["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(CORE_SRC)])
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-S", "-m", "mlx_loom.cli.main", *args],
        capture_output=True,
        text=True,
        env=environ,
        input=stdin,
        timeout=300,
    )

"""The core's build: its dependencies on MLX's Linux backend, and its one compiled part.

Everything else about the distribution is declared in ``pyproject.toml``.

**Which MLX backend on Linux.** MLX ships its Linux backends as separate
packages behind extras of ``mlx``: ``mlx[cpu]`` (``mlx-cpu``), ``mlx[cuda]``
and ``mlx[cuda12]`` (``mlx-cuda-12``), ``mlx[cuda13]`` (``mlx-cuda-13``).
Each installs the same file, ``mlx/lib/libmlx.so``, so exactly one of them
may be installed: with two, whichever pip unpacked last is the MLX that runs.
A plain install must keep the CPU backend (``pip install -e core``), so the
core depends on ``mlx[cpu]`` by default — and an extra of the core cannot
take that away: pip installs ``pkg[extra]`` as ``pkg``'s dependencies *plus*
the extra's, evaluating every marker of the base dependencies with no extra
(so ``mlx[cpu]; extra != "cuda"`` is still installed with ``[cuda]``;
measured with pip 26.3). The backend is therefore chosen when the core is
built, by ``MLX_LOOM_BACKEND`` (``cpu``, the default; ``cuda``, ``cuda12``,
``cuda13``), and the built metadata names exactly one backend::

    MLX_LOOM_BACKEND=cuda pip install -e core -e plugins/minicpm5

On macOS ``mlx`` itself brings Metal (``mlx-metal``) and the variable is not
read.

**The native CPU kernels** (``mlx_loom.cpu._native``) are x86-64 SIMD code,
so the extension is built on x86-64 Linux only; everywhere else (macOS with
Metal, Linux on ARM) the package installs without it and the ``cpu-native``
kernel set is refused with that reason, while the ``cpu-ops`` set (MLX
operations) serves the CPU. ``MLX_LOOM_NATIVE=0`` skips the build on x86-64
Linux too. It compiles against the headers and ``libmlx`` of ``mlx[cpu]``
in the build environment (``pyproject.toml``'s build requirements, whatever
backend is installed) and links ``libmlx.so`` by name, so at run time it
binds to the ``libmlx`` of the backend that is installed: every MLX symbol
it uses is exported by ``mlx-cuda-12``'s ``libmlx`` 0.32.4 too (compared
with ``nm -D``). If it cannot load there, :mod:`mlx_loom.cpu.native` records
why and ``loom explain`` shows it.
"""

from __future__ import annotations

import os
import platform
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: ``MLX_LOOM_BACKEND`` -> the extra of ``mlx`` that installs that Linux backend.
LINUX_BACKENDS = {"cpu": "cpu", "cuda": "cuda", "cuda12": "cuda12", "cuda13": "cuda13"}


def linux_backend(environ: Mapping[str, str]) -> str:
    """The ``mlx`` extra this build installs on Linux (``MLX_LOOM_BACKEND``, default ``cpu``)."""
    name = environ.get("MLX_LOOM_BACKEND", "").strip().lower() or "cpu"
    if name not in LINUX_BACKENDS:
        raise SystemExit(
            f"MLX_LOOM_BACKEND={name!r} is not one of MLX's Linux backends "
            f"({', '.join(LINUX_BACKENDS)}).\n"
            "fix: unset it for the CPU backend, or set MLX_LOOM_BACKEND=cuda (CUDA 12) or cuda13"
        )
    return LINUX_BACKENDS[name]


def requirements(environ: Mapping[str, str]) -> list[str]:
    """The core's dependencies: ``pyproject.toml``'s list plus one MLX backend for Linux."""
    with open(HERE / "pyproject.toml", "rb") as f:
        declared: list[str] = tomllib.load(f)["tool"]["mlx-loom"]["dependencies"]
    (mlx,) = [r for r in declared if r.replace(" ", "").startswith("mlx==")]
    version = mlx.split("==", 1)[1].strip()
    backend = linux_backend(environ)
    return [*declared, f"mlx[{backend}]=={version}; sys_platform == 'linux'"]


def native_build(environ: Mapping[str, str]) -> tuple[list, dict]:
    if environ.get("MLX_LOOM_NATIVE", "1") == "0":
        return [], {}
    if not sys.platform.startswith("linux") or platform.machine().lower() not in (
        "x86_64",
        "amd64",
    ):
        return [], {}
    # mlx's own helpers: CMake against the headers and libmlx the wheel
    # ships, with an rpath to that libmlx.
    from mlx import extension

    ext = extension.CMakeExtension("mlx_loom.cpu._native", sourcedir="csrc")
    return [ext], {"build_ext": extension.CMakeBuild}


if __name__ == "__main__":  # how setuptools runs it; tests import the rules above
    from setuptools import setup

    ext_modules, cmdclass = native_build(os.environ)
    setup(install_requires=requirements(os.environ), ext_modules=ext_modules, cmdclass=cmdclass)

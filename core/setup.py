"""Build of the core's one compiled part: the native CPU kernels (``mlx_loom.cpu._native``).

Everything else about the distribution is declared in ``pyproject.toml``.
The kernels are x86-64 SIMD code, so the extension is built on x86-64 Linux
only; everywhere else (macOS with Metal, Linux on ARM) the package installs
without it and the ``cpu-native`` kernel set is refused with that reason,
while the ``cpu-ops`` set (MLX operations) serves the CPU. Setting
``MLX_LOOM_NATIVE=0`` skips the build on x86-64 Linux too.
"""

from __future__ import annotations

import os
import platform
import sys

from setuptools import setup


def native_build() -> tuple[list, dict]:
    if os.environ.get("MLX_LOOM_NATIVE", "1") == "0":
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


ext_modules, cmdclass = native_build()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

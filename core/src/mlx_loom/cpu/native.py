"""The compiled CPU kernels (``mlx_loom.cpu._native``), loaded on first use.

The extension is built by ``pip install`` on x86-64 Linux only. Whether it
can run here has two parts, both reported rather than guessed: was it built
into this install, and does this CPU have the instructions it was compiled
for (AVX2, FMA, F16C — detected at run time by the extension itself, which
is built for baseline x86-64 so that importing it never faults).
"""

from __future__ import annotations

import functools
import platform
import sys
from pathlib import Path
from types import ModuleType

import mlx.core  # noqa: F401  (registers mx.array for the extension's signatures)

#: Instruction sets the native kernels need.
REQUIRED_INSTRUCTIONS = ("avx2", "fma", "f16c")

#: The CPU kernel sets that run on this extension (:mod:`mlx_loom.cpu.path`):
#: both use its norm, RoPE and attention kernels, and differ only in the
#: activations of 4-bit matrix-vector products (fp32, or int8).
NATIVE_KERNEL_SETS = frozenset({"cpu-native", "cpu-native-int8-act"})


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    try:
        # optional: built only on x86-64 Linux; its absence is reported
        from . import _native  # type: ignore[attr-defined]  # compiled; no stub
    except Exception as err:  # a broken extension is a reason, never a crash at import
        return None, _why_not(err)
    return _native, ""


def _built() -> bool:
    """Whether ``pip install`` compiled the extension into this package."""
    return any(Path(__file__).parent.glob("_native*.so"))


def _why_not(err: Exception) -> str:
    """Why the extension did not load: not built here, or built but not loadable."""
    if not (sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")):
        return (
            "the native CPU kernels are x86-64 code and are not built on "
            f"{sys.platform}/{platform.machine()}"
        )
    if not _built():
        return (
            f"the native CPU kernels are not built into this install ({err}); "
            "reinstall mlx-loom with a C++ compiler available (MLX_LOOM_NATIVE=0 skips them)"
        )
    # Built, but the libmlx of the MLX backend installed now (mlx-cpu or
    # mlx-cuda-*, see setup.py) does not serve it: a different MLX version,
    # or a build from another environment.
    return (
        f"the native CPU kernels are built but do not load against the installed MLX "
        f"({type(err).__name__}: {err}); reinstall mlx-loom so they are built against it "
        "(pip install --force-reinstall --no-deps -e <clone>/core), or skip them with "
        "MLX_LOOM_NATIVE=0"
    )


def module() -> ModuleType:
    """The extension module; raises ``ImportError`` (with the reason) when absent."""
    mod, why = _load()
    if mod is None:
        raise ImportError(why)
    return mod


def cpu_features() -> dict[str, bool]:
    """Instruction sets of this CPU as the extension detects them ({} without it)."""
    mod, _ = _load()
    return dict(mod.cpu_features()) if mod is not None else {}


def unavailable_reason(features: dict[str, bool] | None = None) -> str | None:
    """Why the native kernels cannot run here, or ``None`` when they can.

    ``features`` overrides the detected instruction sets (how the refusal on
    a CPU without AVX2 is tested on one that has it).
    """
    mod, why = _load()
    if mod is None:
        return why
    found = dict(mod.cpu_features()) if features is None else features
    missing = [name for name in REQUIRED_INSTRUCTIONS if not found.get(name, False)]
    if missing:
        return (
            f"this CPU lacks {', '.join(missing).upper()}, which the native CPU kernels need "
            f"(they need {', '.join(REQUIRED_INSTRUCTIONS).upper()})"
        )
    return None


#: ``MLX_LOOM_CPU_ISA`` values: the instruction set of the kernels that have
#: an AVX-512 variant (``auto``: AVX-512 VNNI where the CPU and OS have it,
#: else AVX2).
CPU_ISA_CHOICES = ("auto", "avx2", "avx512")


def cpu_isa() -> str | None:
    """The instruction set the 4-bit kernels run on (``None`` without the extension).

    ``avx512-vnni`` where the CPU has AVX-512 F/BW/VL with VNNI and the OS
    saves the zmm state (detected by the extension at run time), else
    ``avx2``; ``MLX_LOOM_CPU_ISA=avx2`` forces the baseline. Both give
    bit-identical results. It governs the fp32-activation matrix-vector
    products of 4-bit weights (every row count), the micro-kernel of the
    fp32 GEMM that prefill runs for every weight kind, and the
    int8-activation products of two or more activation rows; one int8 row
    (decode) as :func:`one_row_avx512` says. Raises ``ValueError`` for a
    ``MLX_LOOM_CPU_ISA`` that is not one of :data:`CPU_ISA_CHOICES` or
    names a set this CPU lacks.
    """
    mod, _ = _load()
    return str(mod.cpu_isa()) if mod is not None else None


def one_row_avx512() -> bool:
    """Whether one int8 activation row (single-stream decode) runs on AVX-512
    where the set in use is AVX-512.

    Which kernel is faster for one row depends on the core's vector width, so
    it is a rule on the CPU's vendor and family (Zen 5 and later: yes; Zen 4
    and the Intel Xeons measured: no, docs/cpu.md), unless
    ``MLX_LOOM_CPU_ISA=avx512`` names the set, which runs it at every row
    count. The bits are the same either way. ``False`` without the extension.
    """
    mod, _ = _load()
    return bool(mod.one_row_avx512()) if mod is not None else False


def describe_available() -> str:
    """``loom explain``'s line for a loadable extension: the instruction sets its kernels use."""
    try:
        isa = cpu_isa()
    except ValueError as err:
        return f"available (AVX2/FMA/F16C); 4-bit and int8 products: {err}"
    return (
        f"available: AVX2/FMA/F16C, 4-bit and int8 products on {isa} "
        f"(MLX_LOOM_CPU_ISA={'|'.join(CPU_ISA_CHOICES)})"
    )


def threads() -> int | None:
    """Threads one native product runs on (``MLX_LOOM_CPU_THREADS``, else every usable CPU)."""
    mod, _ = _load()
    return int(mod.threads()) if mod is not None else None

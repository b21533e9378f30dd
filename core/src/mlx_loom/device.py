"""The MLX this process runs on: its backend package, the device, its memory; the wired limit.

``loom explain`` names all three, so a user who meant MLX's CUDA backend and
got the CPU one (or has both installed: they ship the same ``libmlx.so``,
and the one pip unpacked last is the one that runs) sees it before loading
anything. How the backend is chosen at install time is in the core's
``setup.py``.

**Wired memory (Metal).** macOS may page a GPU buffer out under memory
pressure; wiring it keeps it resident. MLX wires nothing unless
``mx.set_wired_limit`` is raised, so a model that fits the device's
*recommended working set* still pays page-ins. Like mlx-lm (which wraps
each generation in a ``wired_limit`` context), generation runs with the
limit raised to that recommended working set and restores the old limit
after; a model over 90 % of it gets a warning, as it will be slow. On CUDA
and the CPU, ``mx.device_info()`` reports no recommended working set and
the context does nothing. Several engine threads (a multi-model server)
share one process-wide limit: the first to enter raises it, the last to
leave restores it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .backends import Backend, active_backend

log = logging.getLogger("mlx_loom.device")

#: The packages that carry MLX's compiled backend (``mlx[cpu]``, ``mlx[cuda]``
#: / ``mlx[cuda12]``, ``mlx[cuda13]``; Metal's on macOS).
BACKEND_PACKAGES = ("mlx-cpu", "mlx-cuda-12", "mlx-cuda-13", "mlx-metal")
#: A model over this share of the recommended working set is warned about (mlx-lm's 0.9).
TIGHT_SHARE = 0.9


@dataclass(frozen=True)
class DeviceReport:
    """What ``loom explain`` says about the MLX installation and the device."""

    backend: Backend
    #: The MLX backend packages installed, as ``name version``.
    packages: tuple[str, ...]
    device: str
    #: The device's memory in bytes (system memory for the CPU); ``None``: unknown.
    memory_bytes: int | None
    #: Metal's recommended working set (what generation wires); ``None`` elsewhere.
    working_set_bytes: int | None
    #: Something wrong with the installation (two backends), with its fix; ``None``: fine.
    problem: str | None


def installed_backend_packages() -> tuple[str, ...]:
    """``name version`` of each MLX backend package installed."""
    found = []
    for name in BACKEND_PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(found)


def report(info: Mapping[str, Any] | None = None) -> DeviceReport:
    """The backend, device and memory of this process (``info``: a device's
    ``mx.device_info()`` in its place, for tests)."""
    info = dict(mx.device_info()) if info is None else dict(info)
    backend = active_backend()
    packages = installed_backend_packages()
    linux = [p for p in packages if not p.startswith("mlx-metal")]
    problem = None
    if len(linux) > 1:
        names = [p.split()[0] for p in linux]
        problem = (
            f"{' and '.join(names)} are both installed; each ships mlx/lib/libmlx.so, so the "
            f"one pip unpacked last runs (here: {backend}). Fix: pip uninstall -y "
            f"{' '.join(names)}, then reinstall mlx-loom with the one you want "
            "(MLX_LOOM_BACKEND=cpu|cuda|cuda13; see the README)"
        )
    name = str(info.get("device_name") or info.get("architecture") or "unknown")
    kind = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
    memory = info.get("memory_size") or info.get("total_memory") or _system_memory()
    working_set = info.get("max_recommended_working_set_size")
    return DeviceReport(
        backend=backend,
        packages=packages,
        device=f"{kind}: {name}",
        memory_bytes=int(memory) if memory else None,
        working_set_bytes=int(working_set) if working_set else None,
        problem=problem,
    )


def _system_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX, or not reported
        return None


# --- the wired limit ------------------------------------------------------------------


@dataclass(frozen=True)
class WiredPlan:
    """What generation wires: ``limit`` bytes (``None``: leave the limit alone), and a
    warning when the model is too big for the device to keep it resident."""

    limit: int | None
    warning: str | None = None


def wired_plan(info: Mapping[str, Any], model_bytes: int) -> WiredPlan:
    """The wired limit for a model of ``model_bytes`` on a device described by ``info``
    (``mx.device_info()``): its recommended working set, where it reports one (Metal)."""
    working_set = info.get("max_recommended_working_set_size")
    if not working_set:
        return WiredPlan(None)
    warning = None
    if model_bytes > TIGHT_SHARE * working_set:
        warning = (
            f"the model takes {model_bytes // 2**20:,} MB, close to or over this device's "
            f"recommended working set of {int(working_set) // 2**20:,} MB: generation will be "
            "slow (a quantized model, or a machine with more memory, fits)"
        )
    return WiredPlan(int(working_set), warning)


class _Wired:
    """The one process-wide wired limit, shared by every engine thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.previous = 0


_WIRED = _Wired()


def model_bytes(module: Any) -> int:
    """Bytes of a module's parameters (what generation keeps resident)."""
    leaves = tree_flatten(module.parameters())
    assert isinstance(leaves, list)  # a list unless asked for a dict (destination=)
    return sum(int(a.nbytes) for _, a in leaves if isinstance(a, mx.array))


@contextmanager
def wired_limit(module: Any, stream: mx.Stream | None = None) -> Iterator[None]:
    """Generation with the device's recommended working set wired (Metal; elsewhere a
    no-op), the previous limit restored when the last holder leaves.

    ``stream`` is synchronised before the limit is restored: MLX must not have
    the limit changed under an evaluation in flight.
    """
    info = mx.device_info()
    if wired_plan(info, 0).limit is None:
        yield
        return
    plan = wired_plan(info, model_bytes(module))
    limit = plan.limit
    assert limit is not None  # the same device info as above
    if plan.warning is not None:
        log.warning("%s", plan.warning)
    with _WIRED.lock:
        if _WIRED.holders == 0:
            _WIRED.previous = mx.set_wired_limit(limit)
        _WIRED.holders += 1
    try:
        yield
    finally:
        if stream is not None:
            mx.synchronize(stream)
        else:
            mx.synchronize()
        with _WIRED.lock:
            _WIRED.holders -= 1
            if _WIRED.holders == 0:
                mx.set_wired_limit(_WIRED.previous)

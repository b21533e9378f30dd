"""Kernels registered per (name, backend), and which backend this device runs.

A family plugin registers each kernel once per backend it supports:

* ``metal`` — an ``mx.fast.metal_kernel`` (runs only where Metal is available),
* ``cuda`` — an ``mx.fast.cuda_kernel`` (runs only where CUDA is available),
* ``cpu`` — the same computation in plain MLX ops.

The ``cpu`` registration is an implementation in its own right, chosen because
the device is a CPU — never as a silent fallback for a missing Metal kernel.
On a Metal device a kernel with no ``metal`` registration is a refusal unless
the host pins the ``cpu`` backend explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import mlx.core as mx

from .errors import KernelUnavailable, RegistrationError
from .field_checks import check_callable, check_id, check_instance, check_text

Backend = Literal["metal", "cuda", "cpu"]
BACKENDS: tuple[Backend, ...] = ("metal", "cuda", "cpu")


@dataclass(frozen=True)
class Provider:
    """Who registered something: the plugin name, its distribution and version."""

    plugin: str
    distribution: str = "(in-process)"
    version: str = "0"

    def __str__(self) -> str:
        if self.distribution == "(in-process)":
            return f"{self.plugin} (in-process)"
        return f"{self.plugin} ({self.distribution} {self.version})"


def registered_twice(
    first: Provider | None, second: Provider | None, *, rename: str
) -> tuple[str, str]:
    """How a message names who registered one id twice, and the fix: ``(phrase, fix)``.

    ``phrase`` follows "is registered twice": ``": by A and by B"``, ``", both
    times by A"`` (one plugin registering it twice), or — for registrations
    handed to a registry directly, which carry no provider — says so instead
    of the ambiguous "by a plugin and by a plugin". ``rename`` is what to
    rename ("one of the ids").
    """
    if first is None and second is None:
        return (
            " (both registrations were passed in directly, so no plugin is named)",
            f"Pass each registration once, or rename {rename}.",
        )
    if first == second:
        return f", both times by {first}", f"Register it once in {first}, or rename {rename}."
    named = [str(p) if p else "a registration passed in directly" for p in (first, second)]
    return (
        f": by {named[0]} and by {named[1]}",
        f"Uninstall or disallow one of the two plugins, or rename {rename}.",
    )


@dataclass(frozen=True)
class Kernel:
    """One kernel for one backend.

    ``fn`` is the callable the graph invokes; ``source`` is the kernel source
    for ``metal``/``cuda`` registrations (kept so ``loom explain`` and tests can
    show what would run on that device).
    """

    name: str
    backend: Backend
    fn: Callable[..., object]
    source: str | None = None
    description: str = ""
    provider: Provider | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_id("Kernel", "name", self.name)
        if self.backend not in BACKENDS:
            raise RegistrationError(
                f"Kernel {self.name!r} names backend {self.backend!r}; known backends are "
                f"{', '.join(BACKENDS)}.",
                fix="Register the kernel for 'metal', 'cuda' or 'cpu'.",
            )
        check_callable("Kernel", "fn", self.fn)
        if self.source is not None:
            check_text("Kernel", "source", self.source)
        check_text("Kernel", "description", self.description)
        check_instance("Kernel", "provider", self.provider, Provider, optional=True)


def runnable_backends() -> frozenset[Backend]:
    """Backends whose kernels can execute in this process."""
    found: set[Backend] = {"cpu"}
    if mx.metal.is_available():
        found.add("metal")
    if _cuda_available():
        found.add("cuda")
    return frozenset(found)


def active_backend() -> Backend:
    """The backend the default MLX device runs kernels on."""
    if mx.default_device().type == mx.DeviceType.gpu:
        if mx.metal.is_available():
            return "metal"
        if _cuda_available():
            return "cuda"
    return "cpu"


def _cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


class KernelRegistry:
    """Immutable map from (kernel name, backend) to one :class:`Kernel`."""

    def __init__(self, kernels: Iterable[Kernel] = ()) -> None:
        table: dict[tuple[str, Backend], Kernel] = {}
        for kernel in kernels:
            check_instance("KernelRegistry", "kernels[]", kernel, Kernel)
            kernel.__post_init__()  # re-checked: a frozen instance can still be forged
            key = (kernel.name, kernel.backend)
            if key in table:
                who, fix = registered_twice(
                    table[key].provider, kernel.provider, rename="one of the kernels"
                )
                raise RegistrationError(
                    f"Kernel {kernel.name!r} for backend {kernel.backend!r} is registered "
                    f"twice{who}.",
                    fix=fix,
                )
            table[key] = kernel
        self._table: Mapping[tuple[str, Backend], Kernel] = dict(table)

    def __iter__(self):
        return iter(self._table.values())

    def __len__(self) -> int:
        return len(self._table)

    def backends_for(self, name: str) -> tuple[Backend, ...]:
        return tuple(b for b in BACKENDS if (name, b) in self._table)

    def resolve(self, name: str, backend: Backend | None = None) -> Kernel:
        """The one kernel to run for ``name``: on ``backend`` if pinned, else this device's.

        Raises :class:`KernelUnavailable` rather than substituting another backend.
        """
        pinned = backend is not None
        want: Backend = backend if backend is not None else active_backend()
        registered = self.backends_for(name)
        if want not in runnable_backends():
            raise KernelUnavailable(
                f"Kernel {name!r} is pinned to backend {want!r}, which cannot run on this "
                f"machine (runnable here: {', '.join(sorted(runnable_backends()))}).",
                fix=f"Run on a device with {want} support, or pin a backend that runs here "
                "(e.g. kernel_backend='cpu').",
            )
        kernel = self._table.get((name, want))
        if kernel is None:
            have = ", ".join(registered) if registered else "none"
            how = "pinned" if pinned else "selected for this device"
            raise KernelUnavailable(
                f"Kernel {name!r} has no {want!r} registration (backend {how}); "
                f"registered backends: {have}.",
                fix="Install or allow the plugin that provides it for this backend, "
                + (
                    f"or pin one of: {have}."
                    if registered and any(b in runnable_backends() for b in registered)
                    else "or run on a device one of its backends supports."
                ),
            )
        return kernel

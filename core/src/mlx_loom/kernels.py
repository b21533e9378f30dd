"""Moved: this module is now :mod:`mlx_loom.host` (private module ``mlx_loom.backends``).

Kept so code written against plugin API 1.0 imports unchanged. Family
authors import from :mod:`mlx_loom.plugin`; embedding hosts from
:mod:`mlx_loom.host`.
"""

from .host._kernels import (  # noqa: F401 - re-exported for plugin API 1.x
    BACKENDS,
    Backend,
    Kernel,
    KernelRegistry,
    Provider,
    active_backend,
    runnable_backends,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "Kernel",
    "KernelRegistry",
    "Provider",
    "active_backend",
    "runnable_backends",
]

"""Moved: this module is now :mod:`mlx_loom.host` (private module ``mlx_loom.host._resolution``).

Kept so code written against plugin API 1.0 imports unchanged. Family
authors import from :mod:`mlx_loom.plugin`; embedding hosts from
:mod:`mlx_loom.host`.
"""

from .host._resolution import (  # noqa: F401 - re-exported for plugin API 1.x
    KNOWN_FAMILIES,
    KernelChoice,
    Resolution,
    Resolved,
    resolve,
)

__all__ = [
    "KNOWN_FAMILIES",
    "KernelChoice",
    "Resolution",
    "Resolved",
    "resolve",
]

"""Moved: this module is now :mod:`mlx_loom.host` (private module ``mlx_loom.loader``).

Kept so code written against plugin API 1.0 imports unchanged. Family
authors import from :mod:`mlx_loom.plugin`; embedding hosts from
:mod:`mlx_loom.host`.
"""

from .host._loading import (  # noqa: F401 - re-exported for plugin API 1.x
    build_model,
    default_host,
    load,
    make_host,
    resolve_model,
)

__all__ = [
    "build_model",
    "default_host",
    "load",
    "make_host",
    "resolve_model",
]

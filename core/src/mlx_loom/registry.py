"""Moved: this module is now :mod:`mlx_loom.host` (private module ``mlx_loom.host._registry``).

Kept so code written against plugin API 1.0 imports unchanged. Family
authors import from :mod:`mlx_loom.plugin`; embedding hosts from
:mod:`mlx_loom.host`.
"""

from .host._registry import (  # noqa: F401 - re-exported for plugin API 1.x
    Binding,
    BuildContext,
    Implementation,
    ModelType,
    Registry,
)

__all__ = [
    "Binding",
    "BuildContext",
    "Implementation",
    "ModelType",
    "Registry",
]

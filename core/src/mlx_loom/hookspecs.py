"""Moved: this module is now :mod:`mlx_loom.host` (private module ``mlx_loom.host._hookspecs``).

Kept so code written against plugin API 1.0 imports unchanged. Family
authors import from :mod:`mlx_loom.plugin`; embedding hosts from
:mod:`mlx_loom.host`.
"""

from .host._hookspecs import (  # noqa: F401 - re-exported for plugin API 1.x
    ENTRY_POINT_GROUP,
    PLUGIN_API_VERSION,
    PROJECT,
    REGISTRATION_HOOKS,
    hookimpl,
    hookspec,
    loom_cache_kinds,
    loom_families,
    loom_implementations,
    loom_kernels,
    loom_model_types,
    loom_plugin_api_version,
    loom_profiles,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLUGIN_API_VERSION",
    "PROJECT",
    "REGISTRATION_HOOKS",
    "hookimpl",
    "hookspec",
    "loom_cache_kinds",
    "loom_families",
    "loom_implementations",
    "loom_kernels",
    "loom_model_types",
    "loom_plugin_api_version",
    "loom_profiles",
]

"""The hooks a family plugin implements.

A plugin is a module (or object) exposed through the entry-point group
``mlx_loom``; its functions are marked with :data:`hookimpl`. The host calls
each hook once per plugin, at discovery, and records the results against that
plugin, so every registration carries its provider's name and version.

Call order at discovery: :func:`loom_plugin_api_version` first (an
incompatible answer quarantines the plugin before anything else is called),
then :func:`loom_model_types`, :func:`loom_kernels`,
:func:`loom_implementations`, :func:`loom_profiles`. A plugin implements only
the hooks it needs; a hook implementation whose name matches no spec below
(a misspelling) makes the plugin fail validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ._kernels import Kernel
    from ._profiles import Profile
    from ._registry import Implementation, ModelType

PROJECT = "mlx_loom"
ENTRY_POINT_GROUP = "mlx_loom"

#: The plugin-API version this core speaks. A plugin returns the version it was
#: written for from :func:`loom_plugin_api_version`; the major part must match.
PLUGIN_API_VERSION = "1.0"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def loom_plugin_api_version() -> str:
    """The plugin-API version (``"MAJOR.MINOR"``) this plugin was written for.

    Required. A plugin whose major version differs from the core's is refused
    and quarantined with both versions named.
    """


@hookspec
def loom_model_types() -> Sequence[ModelType]:
    """The config ``model_type`` values this plugin claims, with their schemas."""


@hookspec
def loom_kernels() -> Sequence[Kernel]:
    """Kernels this plugin provides, one :class:`~mlx_loom.kernels.Kernel` per backend."""


@hookspec
def loom_implementations() -> Sequence[Implementation]:
    """Implementations (graph + loader + loop + kernels + factory) this plugin provides."""


@hookspec
def loom_profiles() -> Sequence[Profile]:
    """Family profiles and exact-artifact profiles this plugin registers."""


REGISTRATION_HOOKS: tuple[str, ...] = (
    "loom_model_types",
    "loom_kernels",
    "loom_implementations",
    "loom_profiles",
)

# Hook specifications are signatures: pluggy never runs their bodies.
# mypy: disable-error-code="empty-body"
"""The hooks a family plugin implements.

A plugin is a module (or object) exposed through the entry-point group
``mlx_loom``; its functions are marked with :data:`hookimpl`. The host calls
each hook once per plugin, at discovery, and records the results against that
plugin, so every registration carries its provider's name and version.

Call order at discovery: :func:`loom_plugin_api_version` first (an
incompatible answer quarantines the plugin before anything else is called),
then :func:`loom_families`, :func:`loom_model_types`, :func:`loom_kernels`,
:func:`loom_implementations`, :func:`loom_profiles`,
:func:`loom_cache_kinds`, :func:`loom_tool_parsers`. A plugin implements
only the hooks it needs; a hook implementation whose name matches no spec
below (a misspelling) makes the plugin fail validation.

Every call runs on a host worker thread under a time limit (see
:mod:`mlx_loom.host._bounded`): anything a hook raises — ``SystemExit`` and
``KeyboardInterrupt`` included — or a hook that does not return in time
quarantines the plugin. Return plain registrations; build MLX arrays inside
factories, not in hooks.

Versions: 1.0 had the four registration hooks; 1.1 added
:func:`loom_families` (the declarative family), :func:`loom_cache_kinds`
and :func:`loom_tool_parsers`; 1.2 added KV codecs. This core loads plugins
written for 1.1 or later (:data:`OLDEST_PLUGIN_API_VERSION`); a 1.0 plugin is
refused with the version it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ..backends import Kernel
    from ..text.tool_calls import ToolParser
    from ._profiles import Profile
    from ._registrations import Family, Implementation, ModelType

PROJECT = "mlx_loom"
ENTRY_POINT_GROUP = "mlx_loom"

#: The plugin-API version this core speaks. A plugin returns the version it was
#: written for from :func:`loom_plugin_api_version`; the major part must match.
#: 1.2 added KV codecs: cache kinds (registered with :func:`loom_cache_kinds`)
#: that declare ``codec``/``from_plain`` and return attention views from
#: ``append`` (see ``mlx_loom.cache.codecs``).
PLUGIN_API_VERSION = "1.2"

#: The oldest plugin-API version this core loads: 1.1, the first with the
#: declarative family. A plugin declaring an older one is refused, naming it.
OLDEST_PLUGIN_API_VERSION = "1.1"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def loom_plugin_api_version() -> str:
    """The plugin-API version (``"MAJOR.MINOR"``) this plugin was written for.

    Required. A plugin whose major version differs from the core's is refused
    and quarantined with both versions named.
    """


@hookspec
def loom_families() -> Sequence[Family]:
    """Declarative families (plugin API 1.1): model types, graphs, kernels, capabilities.

    The core derives each graph's implementation (id = graph id) and family
    profile from them; see :class:`mlx_loom.plugin.Family`.
    """


@hookspec
def loom_model_types() -> Sequence[ModelType]:
    """The config ``model_type`` values this plugin claims, with their schemas."""


@hookspec
def loom_kernels() -> Sequence[Kernel]:
    """Kernels this plugin provides, one :class:`~mlx_loom.backends.Kernel` per backend."""


@hookspec
def loom_implementations() -> Sequence[Implementation]:
    """Implementations (graph + loader + loop + kernels + factory) this plugin provides."""


@hookspec
def loom_profiles() -> Sequence[Profile]:
    """Family profiles and exact-artifact profiles this plugin registers."""


@hookspec
def loom_cache_kinds() -> Sequence[type]:
    """Cache classes of this plugin that prompt-cache files may name (plugin API 1.1).

    Each needs a unique string ``kind`` and ``from_state(state, meta_state)``;
    :meth:`mlx_loom.PromptCache.load` restores only registered kinds. Since
    plugin API 1.2, kinds that also declare ``codec``, ``codec_bits``,
    ``codec_default_bits`` and ``from_plain`` form a KV codec that requests
    select with ``kv_codec=`` (``mlx_loom.cache.codecs``); the conformance
    kit's ``kv-codec-kinds`` check holds them to the view contract.
    """


@hookspec
def loom_tool_parsers() -> Sequence[ToolParser]:
    """Tool-call formats this plugin provides, beyond the core's built-in ones (plugin API 1.1).

    Each is a :class:`~mlx_loom.text.tool_calls.ToolParser`; its ``name`` is
    what ``tool_parser_type``, ``--tool-call-parser`` and a model type's
    ``tool_parser`` refer to, and may not be a built-in name. Plugin parsers
    are tried before the built-ins when a chat template's markers are matched.
    """


REGISTRATION_HOOKS: tuple[str, ...] = (
    "loom_families",
    "loom_model_types",
    "loom_kernels",
    "loom_implementations",
    "loom_profiles",
    "loom_cache_kinds",
    "loom_tool_parsers",
)

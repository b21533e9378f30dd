"""The family author's API: everything a model-family plugin imports from the core.

A plugin imports from here, from :mod:`mlx_loom.cache` (cache kinds, masks,
attention) and from :mod:`mlx_loom.nn` (layers families share) — nothing
else in the core is a contract for plugins.
"""

from __future__ import annotations

from .artifacts.fields import (
    Count,
    FieldError,
    FiniteFloat,
    Flag,
    LayerCount,
    PositiveFloat,
    Size,
    UnitFloat,
)
from .errors import (
    CacheError,
    CapabilityRefused,
    ConfigError,
    RequestError,
    WeightsError,
)
from .host import (
    ADAPTERS,
    BATCH,
    GENERATE,
    KV_QUANTIZATION,
    PLUGIN_API_VERSION,
    PROMPT_CACHE,
    SPECULATIVE,
    Backend,
    BuildContext,
    Execution,
    Implementation,
    Kernel,
    ModelType,
    Profile,
    hookimpl,
)

__all__ = [
    "ADAPTERS",
    "BATCH",
    "GENERATE",
    "KV_QUANTIZATION",
    "PLUGIN_API_VERSION",
    "PROMPT_CACHE",
    "SPECULATIVE",
    "Backend",
    "BuildContext",
    "CacheError",
    "CapabilityRefused",
    "ConfigError",
    "Count",
    "Execution",
    "FieldError",
    "FiniteFloat",
    "Flag",
    "Implementation",
    "Kernel",
    "LayerCount",
    "ModelType",
    "PositiveFloat",
    "Profile",
    "RequestError",
    "Size",
    "UnitFloat",
    "WeightsError",
    "hookimpl",
]

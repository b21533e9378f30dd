"""Moved: this module is now :mod:`mlx_loom.host` (private module ``mlx_loom.host._profiles``).

Kept so code written against plugin API 1.0 imports unchanged. Family
authors import from :mod:`mlx_loom.plugin`; embedding hosts from
:mod:`mlx_loom.host`.
"""

from .host._profiles import (  # noqa: F401 - re-exported for plugin API 1.x
    BATCH,
    GENERATE,
    KV_QUANTIZATION,
    LOOP_CAPABILITIES,
    PROMPT_CACHE,
    SPECULATIVE,
    Execution,
    Profile,
    ProfileChoice,
    resolve_profile,
    validate_profile,
)

__all__ = [
    "BATCH",
    "Execution",
    "GENERATE",
    "KV_QUANTIZATION",
    "LOOP_CAPABILITIES",
    "PROMPT_CACHE",
    "Profile",
    "ProfileChoice",
    "SPECULATIVE",
    "resolve_profile",
    "validate_profile",
]

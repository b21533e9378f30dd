"""Moved: this module is now :mod:`mlx_loom.host` (private modules ``mlx_loom.host._discovery``
and ``mlx_loom.host._policy``).

Kept so code written against plugin API 1.0 imports unchanged. Embedding
hosts import :class:`PluginHost` and :class:`PluginPolicy` from
:mod:`mlx_loom.host` (or :mod:`mlx_loom`).
"""

from .host._discovery import STRICT_ENV, PluginHost, PluginRecord, Status  # noqa: F401
from .host._policy import POLICY_ENV, PluginPolicy  # noqa: F401

__all__ = ["POLICY_ENV", "STRICT_ENV", "PluginHost", "PluginPolicy", "PluginRecord", "Status"]

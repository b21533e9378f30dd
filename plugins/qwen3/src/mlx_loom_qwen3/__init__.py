"""Qwen3 and Qwen3-MoE for mlx-loom.

Installed, it is discovered through the ``mlx_loom`` entry point; nothing here
needs importing by hand. The names below are for tests and tooling.
"""

from .config import FINGERPRINT_FIELDS, MOE_FINGERPRINT_FIELDS, Qwen3Config, Qwen3MoeConfig
from .graph import Model
from .loader import build, checkpoint_tensors, sanitize

__all__ = [
    "FINGERPRINT_FIELDS",
    "MOE_FINGERPRINT_FIELDS",
    "Model",
    "Qwen3Config",
    "Qwen3MoeConfig",
    "build",
    "checkpoint_tensors",
    "sanitize",
]

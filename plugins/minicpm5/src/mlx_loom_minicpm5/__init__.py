"""MiniCPM5 for mlx-loom: the Llama architecture MiniCPM5 is published in.

Installed, it is discovered through the ``mlx_loom`` entry point; nothing here
needs importing by hand. The names below are for tests and tooling.
"""

from .config import FINGERPRINT_FIELDS, MiniCPM5Config
from .graph import Model
from .loader import build, checkpoint_tensors

__all__ = [
    "FINGERPRINT_FIELDS",
    "MiniCPM5Config",
    "Model",
    "build",
    "checkpoint_tensors",
]

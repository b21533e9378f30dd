"""MiniCPM5 for mlx-loom: the Llama architecture MiniCPM5 is published in.

Installed, it is discovered through the ``mlx_loom`` entry point; nothing here
needs importing by hand. The names below are for tests and tooling.
"""

from .config import FINGERPRINT_FIELDS, MiniCPM5Config
from .graph import MiniCPM5ForCausalLM
from .loader import expected_tensors, load_model

__all__ = [
    "FINGERPRINT_FIELDS",
    "MiniCPM5Config",
    "MiniCPM5ForCausalLM",
    "expected_tensors",
    "load_model",
]

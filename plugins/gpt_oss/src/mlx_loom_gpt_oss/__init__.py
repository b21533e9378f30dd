"""gpt-oss for mlx-loom: attention sinks, alternating window/full layers, biased experts.

Installed, it is discovered through the ``mlx_loom`` entry point; nothing here
needs importing by hand. The names below are for tests and tooling.
"""

from .config import FINGERPRINT_FIELDS, GptOssConfig
from .graph import Model
from .loader import build, checkpoint_tensors, sanitize

__all__ = ["FINGERPRINT_FIELDS", "GptOssConfig", "Model", "build", "checkpoint_tensors", "sanitize"]

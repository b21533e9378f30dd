"""mlx-loom plugin for Gemma 4 text models (``gemma4_text``, and the text tower of ``gemma4``)."""

from mlx_loom_gemma4.config import Gemma4TextConfig
from mlx_loom_gemma4.graph import Model
from mlx_loom_gemma4.loader import build, checkpoint_tensors

__all__ = ["Gemma4TextConfig", "Model", "build", "checkpoint_tensors"]

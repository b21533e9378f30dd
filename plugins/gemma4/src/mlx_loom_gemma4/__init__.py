"""mlx-loom plugin for Gemma 4 text models (``gemma4_text``, and the text tower of ``gemma4``)."""

from mlx_loom_gemma4.config import Gemma4Config, Gemma4TextConfig
from mlx_loom_gemma4.graph import Gemma4LM, Gemma4TextLM
from mlx_loom_gemma4.loader import build

__all__ = ["Gemma4Config", "Gemma4LM", "Gemma4TextConfig", "Gemma4TextLM", "build"]

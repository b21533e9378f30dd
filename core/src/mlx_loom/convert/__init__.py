"""``loom convert`` and ``loom fuse``: writing MLX checkpoints that both engines load.

:func:`convert` reads a checkpoint through its family plugin's loader and
writes it back cast, quantized (uniformly, by the family's own per-layer
choices, or by a mixed recipe) or dequantized; :func:`fuse` folds an adapter
into its base. Both write tensor by tensor (:mod:`mlx_loom.artifacts.writer`),
so memory stays near one tensor above what the source itself costs.
"""

from .convert import MODES, convert, load_lazily
from .fuse import fuse
from .quantize import DTYPES
from .recipes import RECIPES

__all__ = ["DTYPES", "MODES", "RECIPES", "convert", "fuse", "load_lazily"]

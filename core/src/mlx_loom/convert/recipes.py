"""Mixed-bit quantization recipes (``--quant-predicate mixed_3_6`` ...), as mlx-lm defines them.

A recipe spends more bits where quantization error costs most, in the manner
of llama.cpp's ``Q4_K_M``: the value projections and the MLP's down
projection of the first and last eighth of the layers and of every third
layer in between, and the output head, get the high width; everything else
the low one. The layer index is read from the module path at the position
where the first ``down_proj`` path has its first number
(``model.layers.<i>.mlp.down_proj``); paths too short to have one count as
layer 0. The decisions — and so the written tensors — are mlx-lm's exactly.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from mlx_loom.adapters.targets import decoder_layers
from mlx_loom.errors import ConvertError

from .quantize import QuantPredicate

__all__ = ["RECIPES", "mixed_predicate"]

#: recipe -> (low bits, high bits)
RECIPES: dict[str, tuple[int, int]] = {
    "mixed_2_6": (2, 6),
    "mixed_3_4": (3, 4),
    "mixed_3_6": (3, 6),
    "mixed_4_6": (4, 6),
}


def mixed_predicate(recipe: str, model: nn.Module, group_size: int) -> QuantPredicate:
    """The predicate for ``recipe`` on ``model`` (refused if the model has no ``down_proj``)."""
    if recipe not in RECIPES:
        raise ConvertError(
            f"unknown quantization recipe {recipe!r}",
            fix=f"choose one of {', '.join(RECIPES)}",
        )
    low, high = RECIPES[recipe]
    down = [path for path, _ in model.named_modules() if "down_proj" in path]
    if not down:
        raise ConvertError(
            f"recipe {recipe} places its extra bits on 'down_proj' layers, and this model has none",
            fix="quantize uniformly (drop --quant-predicate) and pick --q-bits",
        )
    parts = down[0].split(".")
    where = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
    n = len(decoder_layers(model)[1])

    def predicate(path: str, _: nn.Module) -> dict[str, Any]:
        parts = path.split(".")
        try:
            index = int(parts[where]) if len(parts) > where else 0
        except ValueError as err:
            raise ConvertError(
                f"recipe {recipe}: {path} has no layer number at position {where}",
                fix="quantize uniformly (drop --quant-predicate)",
            ) from err
        more = index < n // 8 or index >= 7 * n // 8 or (index - n // 8) % 3 == 2
        bits = low
        if more and ("v_proj" in path or "v_a_proj" in path or "v_b_proj" in path):
            bits = high
        elif more and "down_proj" in path:
            bits = high
        elif "lm_head" in path:
            bits = high
        return {"group_size": group_size, "bits": bits, "mode": "affine"}

    return predicate

"""Bounded field types for family config schemas, and the one way to report a bad field.

A ``config.json`` is untrusted input: a 600-byte file can ask for 100,000
layers, a head size past int32 or ``rope_theta: Infinity``. Every family
schema types its fields with these, so each such value is refused at
validation, as a :class:`~mlx_loom.errors.ConfigError` naming the field,
before anything is sized from it:

* integers are strict (JSON gives no reason to coerce ``true`` or ``"64"``
  into a size) and fit in int32, which is what MLX shapes hold;
* counts that drive per-layer (or per-expert) Python work are bounded far
  past any published model, so no schema default or loop grows with a hostile
  value before the weights' headers are compared;
* floats are finite (JSON parsing in Python accepts ``Infinity`` and ``NaN``)
  and accept integers (``"rope_theta": 10000``).

Cross-field checks raise :class:`FieldError` from a validator: it names the
field that is inconsistent and its own fix, and
:func:`mlx_loom.artifacts.validate_family_config` reports it like any other
bad field — by dotted path, with the value found.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictBool

__all__ = [
    "INT32_MAX",
    "MAX_LAYERS",
    "Count",
    "FieldError",
    "FiniteFloat",
    "Flag",
    "LayerCount",
    "PositiveFloat",
    "Size",
    "UnitFloat",
]

#: The largest value an MLX shape dimension holds.
INT32_MAX = 2**31 - 1

#: Upper bound on layer counts. The deepest published decoders have ~130
#: layers; this leaves two orders of magnitude and keeps a per-layer list of
#: this length (layer kinds, caches, manifest entries) at a few megabytes.
MAX_LAYERS = 65536

#: A positive size (hidden size, heads, vocabulary, window ...), within int32.
Size = Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)]
#: A non-negative count or index, within int32.
Count = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]
#: A number of layers: positive and at most :data:`MAX_LAYERS`.
LayerCount = Annotated[int, Field(strict=True, ge=1, le=MAX_LAYERS)]
#: Any finite float (integers accepted).
FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
#: A finite float > 0 (epsilons, RoPE bases, scaling factors).
PositiveFloat = Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0)]
#: A finite float in (0, 1] (partial rotary factors).
UnitFloat = Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0, le=1)]
#: A JSON boolean (``1`` and ``"true"`` are refused).
Flag = StrictBool


class FieldError(ValueError):
    """A validator's verdict on one field: which field, what is wrong with it, the fix.

    Raise it from a pydantic validator (field- or model-level). Pydantic
    wraps it in a ``ValidationError``; the core's validation helper unwraps
    it, so the reported path is ``field`` (not the validator's location) and
    the fix is this one.
    """

    def __init__(self, field: str, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.fix = fix

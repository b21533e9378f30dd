"""The config dialect of family plugins: bounded field types, one base, one way to report.

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

:class:`FamilyConfig` is the base every family schema derives from, so the
plugins are siblings: fields as ``config.json`` spells them, omitted values
``derived()`` once by :meth:`FamilyConfig.fill`, cross-field checks in
:meth:`FamilyConfig.check`, pure functions of the fields as properties.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    TypeAdapter,
    ValidationError,
    model_validator,
)

__all__ = [
    "INT32_MAX",
    "MAX_LAYERS",
    "Count",
    "FamilyConfig",
    "FieldError",
    "FiniteFloat",
    "Flag",
    "Given",
    "LayerCount",
    "PositiveFloat",
    "Size",
    "UnitFloat",
    "derived",
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


# --- the config dialect: one base for every family's schema ---------------------

_DERIVED = "mlx_loom_derived"


def derived() -> Any:
    """Declare a field the checkpoint may omit and :meth:`FamilyConfig.fill` derives.

    Use it as the field's default (``head_dim: Size = derived()``): the field
    keeps its bounded, non-optional type, so the graph reads ``cfg.head_dim``
    without a ``None`` check. The value :meth:`~FamilyConfig.fill` returns is
    validated like a value the checkpoint gave.
    """
    return Field(None, json_schema_extra={_DERIVED: True})


class Given:
    """The checkpoint's raw fields as :meth:`FamilyConfig.fill` reads them.

    ``given.get(name)`` is the field's value *only if it passes the field's own
    type* (a bounded size, a layer count ...), else ``None``: a hostile or
    malformed input never sizes a derived value (``["full_attention"] *
    100_000_000``), and its own error is reported by the field's validation.
    """

    def __init__(self, schema: type[BaseModel], data: Mapping[str, Any]) -> None:
        self._schema, self._data = schema, data

    def __contains__(self, name: object) -> bool:
        """Present and not null (Hugging Face writes ``"head_dim": null`` for "derive it")."""
        return isinstance(name, str) and self._data.get(name) is not None

    def get(self, name: str) -> Any:
        value = self._data.get(name)
        info = self._schema.model_fields.get(name)
        if value is None or info is None:
            return value
        try:
            return _adapter(self._schema, name).validate_python(value)
        except ValidationError:
            return None


@lru_cache(maxsize=512)
def _adapter(schema: type[BaseModel], name: str) -> TypeAdapter[Any]:
    info = schema.model_fields[name]
    # The field's type and its bounds (pydantic keeps a bare Size's bounds in metadata).
    form: Any = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
    return TypeAdapter(form)


class FamilyConfig(BaseModel):
    """The base of every family's config schema: one way to default, check and report.

    * **Fields** are typed with the bounded types above and named as the
      checkpoint's ``config.json`` spells them; unknown keys are ignored
      (checkpoints carry many fields a graph does not read) and a validated
      config is frozen.
    * **Derived values** a checkpoint may omit (``head_dim``, key/value
      heads, per-layer kinds) are declared ``= derived()`` and filled once, by
      :meth:`fill`, before validation; values that are pure functions of the
      validated fields are properties.
    * **Cross-field checks** live in :meth:`check`, run once on the validated
      config; each raises :class:`FieldError` naming the field it blames, so
      the user reads ``field: found value; message`` exactly as for a type
      error, in the same :class:`~mlx_loom.errors.ConfigError`.

    A field whose JSON needs parsing into an object (``rope_scaling``) keeps a
    ``mode="before"`` field validator that calls the core's parser.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    @classmethod
    def fill(cls, given: Given) -> Mapping[str, Any]:
        """Values for ``derived()`` fields the checkpoint omits (or sets null).

        Read inputs with ``given.get(name)`` (``None`` when absent or invalid:
        then leave the value out; the input's own error is reported). Raise
        :class:`FieldError` where a value cannot be derived. Only absent
        fields take the value returned.
        """
        return {}

    def check(self) -> None:
        """Cross-field checks on the validated config: raise :class:`FieldError`."""

    @model_validator(mode="before")
    @classmethod
    def _fill_derived(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data  # pydantic reports the wrong type
        out = dict(data)
        for name, value in cls.fill(Given(cls, data)).items():
            if out.get(name) is None and value is not None:
                out[name] = value
        return out

    @model_validator(mode="after")
    def _cross_field_checks(self) -> Self:
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get(_DERIVED) and getattr(self, name) is None:
                raise FieldError(
                    name,
                    "is absent and the schema derived no value for it",
                    fix=f"set {name} in config.json",
                )
        self.check()
        return self

"""Quantization as a checkpoint declares it, and swapping layers to match.

Two spellings reach us. mlx-lm's converter writes ``"quantization"`` (and
copies it to ``"quantization_config"`` for the Hub's model tree)::

    "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                     "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
                     "lm_head": false}

A key that is a module path overrides the global spec for that module; ``false``
leaves it unquantized. Hugging Face style ``quantization_config`` is accepted
when it describes an MLX scheme, and so is a Hugging Face ``quant_method:
mxfp4`` or ``mxfp8`` export (OpenAI publishes gpt-oss so): MLX's mode of the
same name packs those weights bit for bit (group 32; the family's ``sanitize``
maps the tensor names), so it is read as that mode, as mlx-lm reads it, and —
the rule for every mode — a module is quantized exactly where its scales are
stored. Other methods (AWQ, GPTQ, FP8, bitnet) are refused by name rather than
approximated.

**Modes.** MLX packs a weight one of four ways (``mx.quantize``'s ``mode``),
and ``mlx_lm.convert --q-mode`` writes each of them:

======  ==============  ========  ==============================  =========
mode    group size      bits      ``scales``                      ``biases``
======  ==============  ========  ==============================  =========
affine  32, 64, 128     2-6, 8    the checkpoint's float dtype    yes
mxfp4   32              4         uint8 (E8M0 power of two)       no
nvfp4   16              4         uint8 (E4M3)                    no
mxfp8   32              8         uint8 (E8M0 power of two)       no
======  ==============  ========  ==============================  =========

A microscaling mode fixes its group size and bits, so a config may omit them
there (MLX's layers fill in the same values); given, they must be those.
Modes mix per module: a global ``mxfp4`` with the router kept at 8-bit
affine is what ``mlx_lm.convert --q-mode mxfp4`` writes for Gemma 4.

:func:`apply_quantization` then swaps exactly the modules for which the
checkpoint stores ``<module>.scales`` — mirroring mlx-lm's loader, which also
keys on the presence of scales — and checks that the packed shapes agree with
the config, so a mismatch is a typed error instead of a reshape failure deep
inside ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from pydantic import BaseModel, ConfigDict

from mlx_loom.artifacts.safetensors_header import TensorInfo
from mlx_loom.errors import ConfigError, WeightsError

__all__ = [
    "MODE_PACKING",
    "MicroscalingEmbedding",
    "QUANT_MODES",
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "QuantSpec",
    "QuantizationConfig",
    "apply_quantization",
    "parse_quantization",
]

#: Affine bit widths MLX's ``quantize``/``quantized_matmul`` implement.
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
#: Affine group sizes MLX implements.
SUPPORTED_GROUP_SIZES = (32, 64, 128)
QuantMode = Literal["affine", "mxfp4", "nvfp4", "mxfp8"]
#: The modes MLX's ``quantize``/``quantized_matmul``/``gather_qmm`` implement.
QUANT_MODES: tuple[QuantMode, ...] = ("affine", "mxfp4", "nvfp4", "mxfp8")
#: ``(group_size, bits)`` each microscaling mode is fixed to (MLX 0.32's table).
MODE_PACKING: dict[str, tuple[int, int]] = {"mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
_GLOBAL_KEYS = {"group_size", "bits", "mode"}
# Keys some writers add next to the global spec that carry no layer information.
_IGNORED_KEYS = {"quant_method"}
_CONVERT_FIX = (
    "convert the checkpoint to MLX quantization (loom convert -q or mlx_lm.convert -q: "
    "affine with bits in 2,3,4,5,6,8 and group size 32, 64 or 128, or --q-mode "
    "mxfp4/nvfp4/mxfp8), or use an unquantized checkpoint"
)


class QuantSpec(BaseModel):
    """How one module's weight is packed."""

    model_config = ConfigDict(frozen=True)

    group_size: int
    bits: int
    mode: QuantMode = "affine"

    @property
    def has_biases(self) -> bool:
        """Whether the packing stores ``biases`` beside ``scales`` (affine only)."""
        return self.mode == "affine"

    def describe(self) -> str:
        """``4-bit group 64`` for affine, the mode's name otherwise (it fixes the rest)."""
        return f"{self.bits}-bit group {self.group_size}" if self.has_biases else self.mode

    def to_quantized_kwargs(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


class QuantizationConfig(BaseModel):
    """A checkpoint's quantization: a global spec plus per-module overrides.

    ``overrides[path] is None`` means the config leaves that module unquantized.
    """

    model_config = ConfigDict(frozen=True)

    default: QuantSpec
    overrides: dict[str, QuantSpec | None] = {}
    source_key: str = "quantization"

    def for_module(self, path: str) -> QuantSpec | None:
        """The spec the config declares for ``path`` (``None``: unquantized)."""
        if path in self.overrides:
            return self.overrides[path]
        return self.default


def _spec(data: Mapping[str, Any], *, where: str, source: Path) -> QuantSpec:
    """Validate one ``{group_size, bits, mode}`` mapping.

    For affine, ``group_size`` and ``bits`` are required, for overrides too:
    mlx-lm would fill an omitted one from MLX's layer default (group 64, 4
    bits), not from the global spec, and guessing which was meant is how a
    model loads with the wrong packing. ``mode`` defaults to affine, the only
    mode MLX checkpoints omitted it for. A microscaling mode fixes both, so
    either may be omitted there and a different value is refused.
    """
    mode = data.get("mode", "affine")
    if mode not in QUANT_MODES:
        raise ConfigError(
            f"{source}: {where}.mode = {mode!r} is an unsupported quantization mode "
            f"(supported: {', '.join(QUANT_MODES)})",
            fix=_CONVERT_FIX,
        )
    if mode in MODE_PACKING:
        return _fixed_spec(data, mode, where=where, source=source)
    values: dict[str, Any] = {}
    for key in ("group_size", "bits"):
        if key not in data:
            raise ConfigError(
                f"{source}: {where}.{key} is missing",
                fix=f"add {key!r} to {where} in {source.name}; {_CONVERT_FIX}",
            )
        values[key] = data[key]
    bits, group_size = values["bits"], values["group_size"]
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ConfigError(
            f"{source}: {where}.bits = {bits!r} is unsupported "
            f"(supported: {', '.join(map(str, SUPPORTED_BITS))})",
            fix=_CONVERT_FIX,
        )
    if isinstance(group_size, bool) or group_size not in SUPPORTED_GROUP_SIZES:
        raise ConfigError(
            f"{source}: {where}.group_size = {group_size!r} is unsupported "
            f"(supported: {', '.join(map(str, SUPPORTED_GROUP_SIZES))})",
            fix=_CONVERT_FIX,
        )
    return QuantSpec(group_size=group_size, bits=bits, mode="affine")


def _fixed_spec(data: Mapping[str, Any], mode: str, *, where: str, source: Path) -> QuantSpec:
    """A microscaling mode's spec: its own group size and bits, or a refusal naming them."""
    group_size, bits = MODE_PACKING[mode]
    for key, fixed in (("group_size", group_size), ("bits", bits)):
        value = data.get(key, fixed)
        if isinstance(value, bool) or value != fixed:
            raise ConfigError(
                f"{source}: {where}.{key} = {value!r}, but mode {mode!r} packs "
                f"group size {group_size} at {bits} bits only",
                fix=f"set {where}.{key} to {fixed} (or remove it) in {source.name}",
            )
    return QuantSpec(group_size=group_size, bits=bits, mode=mode)  # type: ignore[arg-type]


#: Hugging Face ``quant_method`` values that are one of MLX's modes, bit for bit.
_HF_MICROSCALING = {"mxfp4": "mxfp4", "mxfp8": "mxfp8"}


def parse_quantization(config: Mapping[str, Any], *, source: Path) -> QuantizationConfig | None:
    """Parse the quantization a ``config.json`` declares, or ``None`` if it declares none.

    Looks, in mlx-lm's order, at ``quantization``, then ``quantization_config``,
    then ``text_config.quantization_config`` (wrapper layouts).
    """
    key, data = None, None
    if config.get("quantization") is not None:
        key, data = "quantization", config["quantization"]
    elif config.get("quantization_config") is not None:
        key, data = "quantization_config", config["quantization_config"]
    else:
        text = config.get("text_config")
        if isinstance(text, Mapping) and text.get("quantization_config") is not None:
            key, data = "text_config.quantization_config", text["quantization_config"]
    if key is None:
        return None
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: {key} is a {type(data).__name__}, not an object",
            fix=f"make {key} an object with group_size and bits; {_CONVERT_FIX}",
        )
    method = data.get("quant_method")
    if method in _HF_MICROSCALING:
        # One mode for every module; its ``modules_to_not_convert`` list is what the
        # absent scales already say.
        mode = _HF_MICROSCALING[method]
        group_size, bits = MODE_PACKING[mode]
        spec = QuantSpec(group_size=group_size, bits=bits, mode=mode)  # type: ignore[arg-type]
        return QuantizationConfig(default=spec, overrides={}, source_key=key)
    if method is not None and method != "mlx":
        raise ConfigError(
            f"{source}: {key}.quant_method = {method!r} is an unsupported quantization method "
            "(supported: mlx, the quantization MLX converters write, and Hugging Face's "
            "mxfp4 and mxfp8 exports)",
            fix=_CONVERT_FIX,
        )

    default = _spec(data, where=key, source=source)
    overrides: dict[str, QuantSpec | None] = {}
    for name, value in data.items():
        if name in _GLOBAL_KEYS or name in _IGNORED_KEYS:
            continue
        where = f"{key}[{name!r}]"
        if value is False:
            overrides[name] = None
        elif isinstance(value, Mapping):
            unknown = set(value) - _GLOBAL_KEYS
            if unknown:
                raise ConfigError(
                    f"{source}: {where} has unsupported keys {sorted(unknown)}",
                    fix=_CONVERT_FIX,
                )
            overrides[name] = _spec(value, where=where, source=source)
        else:
            raise ConfigError(
                f"{source}: {where} = {value!r}; a module override must be an object "
                "with group_size/bits or false",
                fix=f"correct {where} in {source.name}",
            )
    return QuantizationConfig(default=default, overrides=overrides, source_key=key)


def _shape(x: mx.array | TensorInfo) -> tuple[int, ...]:
    return tuple(x.shape)


def apply_quantization(
    model: nn.Module,
    qconfig: QuantizationConfig | None,
    weights: Mapping[str, mx.array | TensorInfo],
) -> list[str]:
    """Swap ``model``'s layers for quantized ones exactly where ``weights`` has scales.

    ``weights`` may be loaded arrays or a header manifest: only names and
    shapes are read, so this can run before any tensor data is loaded. The
    swapped layers keep placeholder parameters; ``model.load_weights`` then
    installs the checkpoint's arrays in the dtype they were stored in.

    Returns the paths of the swapped modules. Raises :class:`WeightsError`
    listing every module where checkpoint and config disagree: scales the
    config does not declare, scales whose packing contradicts it, and a
    per-module override with no scales behind it.

    A global spec with no scales anywhere is not a disagreement: it is what
    ``mlx_lm.convert -q`` (and ``loom convert -q``) write when no module's
    input width is a multiple of the group size. mlx-lm's rule — a module is
    quantized exactly when its ``scales`` are present — loads it as the dense
    model it is, and so does this.
    """
    plan: dict[str, QuantSpec] = {}
    problems: list[str] = []
    for path, module in model.named_modules():
        if not path:
            continue
        has_scales = f"{path}.scales" in weights
        quantizable = hasattr(module, "to_quantized") and "weight" in module
        if not has_scales:
            declared = qconfig.overrides.get(path) if qconfig is not None else None
            if quantizable and declared is not None:
                problems.append(
                    f"{path}: config declares {declared.describe()} "
                    "but the checkpoint has no scales for it"
                )
            continue
        if qconfig is None:
            problems.append(
                f"{path}: checkpoint has {path}.scales but config.json has no quantization"
            )
            continue
        if not quantizable:
            problems.append(
                f"{path}: checkpoint has {path}.scales but the model's "
                f"{type(module).__name__} there cannot be quantized"
            )
            continue
        spec = qconfig.for_module(path)
        if spec is None:
            problems.append(
                f"{path}: config leaves it unquantized ({qconfig.source_key}[{path!r}] = false) "
                "but the checkpoint has scales for it"
            )
            continue
        mismatch = _geometry_mismatch(path, module, spec, weights)
        if mismatch:
            problems.append(mismatch)
            continue
        plan[path] = spec

    if problems:
        raise WeightsError(
            f"quantized tensors and the config's quantization disagree "
            f"({len(problems)} module(s)):\n  "
            + "\n  ".join(problems[:20])
            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""),
            fix="correct the quantization entry of config.json to match the checkpoint, "
            "or re-convert the checkpoint",
        )

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        spec = plan.get(path)
        return False if spec is None else spec.to_quantized_kwargs()

    nn.quantize(model, class_predicate=predicate)
    for path, module in model.named_modules():
        if path in plan:
            _microscaling_lookups(module)
    return sorted(plan)


class MicroscalingEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` in a microscaling mode (mxfp4, nvfp4, mxfp8), with two
    lookup fixes; ``as_linear`` (a tied head) stays MLX's ``quantized_matmul``.

    * **Pairs of rows.** MLX 0.32.4's ``mx.dequantize`` in nvfp4 mode raises
      ``[reshape] Cannot reshape array of size 10 into shape (2,4)`` when the
      packed words it is given are not a multiple of four: one looked-up row
      of a table whose width is an odd multiple of 16 (mlx-lm fails the same
      way: a tiny Gemma 4 with 80-wide per-layer embeddings cannot decode a
      token). Rows dequantize independently, so an odd lookup there takes its
      first row twice and drops the copy: the bits of any lookup that works.
    * **The compute dtype.** MLX dequantizes uint8-scaled rows to bfloat16.
      Every such value is exact in bfloat16, but what the family does next
      (Gemma's ``embedding * sqrt(hidden)``) would then run in bf16 under a
      float32 compute dtype; ``lookup_dtype`` (set by the CPU path) converts
      the rows first. ``None``, MLX's own result: the oracle's arithmetic.
    """

    lookup_dtype: mx.Dtype | None = None

    def __call__(self, x: mx.array) -> mx.array:
        flat = x.reshape(-1)
        count = flat.size
        paired = count % 2 == 1 and self["weight"].shape[-1] % 4 != 0
        if paired:
            flat = mx.concatenate([flat, flat[:1]])
        rows = mx.dequantize(
            self["weight"][flat],
            self["scales"][flat],
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        if paired:
            rows = rows[:count]
        rows = rows.reshape(*x.shape, -1)
        return rows if self.lookup_dtype is None else rows.astype(self.lookup_dtype)


def _microscaling_lookups(module: nn.Module) -> None:
    """Give a microscaling ``nn.QuantizedEmbedding`` the :class:`MicroscalingEmbedding`
    lookup (in place: the parameters and attributes stay)."""
    if type(module) is nn.QuantizedEmbedding and module.mode != "affine":
        module.__class__ = MicroscalingEmbedding


def _geometry_mismatch(
    path: str, module: nn.Module, spec: QuantSpec, weights: Mapping[str, mx.array | TensorInfo]
) -> str | None:
    """Compare the stored packed weight/scales(/biases) with what ``spec`` produces.

    The scales' kind is compared too: affine stores them in a float dtype,
    the microscaling modes as uint8, so a checkpoint packed in one mode and
    declared as another is caught here even where the shapes coincide.
    """
    dense = tuple(module.weight.shape)
    in_dims, lead = dense[-1], dense[:-1]
    if in_dims % spec.group_size:
        return (
            f"{path}: input dimension {in_dims} is not a multiple of group size {spec.group_size}"
        )
    groups = lead + (in_dims // spec.group_size,)
    want = {"weight": lead + (in_dims * spec.bits // 32,), "scales": groups}
    if spec.has_biases:
        want["biases"] = groups
    present = [k for k in ("weight", "scales", "biases") if f"{path}.{k}" in weights]
    found = {k: _shape(weights[f"{path}.{k}"]) for k in present}
    byte_scales = _is_byte(weights[f"{path}.scales"])
    if found == want and byte_scales != spec.has_biases:
        return None
    hint = ""
    if "weight" in found and "scales" in found and found["scales"][-1]:
        group = in_dims // found["scales"][-1]
        bits = found["weight"][-1] * 32 // in_dims
        kind = "uint8 scales (a microscaling mode)" if byte_scales else "float scales (affine)"
        hint = f" (the stored shapes fit {bits}-bit, group size {group}, with {kind})"
    return (
        f"{path}: config declares {spec.describe()}{' (affine)' if spec.has_biases else ''}, "
        f"which packs to {want}, but the checkpoint has {found}{hint}"
    )


def _is_byte(x: mx.array | TensorInfo) -> bool:
    """Whether ``x`` is stored as uint8 (microscaling scales), from an array or a header."""
    if isinstance(x, TensorInfo):
        return x.dtype == "U8"
    return x.dtype == mx.uint8

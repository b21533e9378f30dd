"""Casting, quantizing and dequantizing a built (lazy) graph, as ``mlx_lm.convert`` does.

Everything here rewrites the module tree lazily: no tensor is read until the
writer evaluates it, one at a time.

* **Cast** (``--dtype``): every floating parameter whose path the family's
  ``cast_predicate`` accepts (default: all) becomes ``dtype``; done before
  quantizing, so scales and biases are in the cast dtype, as in mlx-lm.
* **Quantize** (``-q``): every module that has ``to_quantized`` and whose
  input width divides the group size is packed, unless the predicate says
  otherwise, in the mode asked for (``--q-mode``: affine, or MLX's
  microscaling mxfp4, nvfp4, mxfp8, which fix their own group size and
  bits). The predicate is a mixed recipe (affine only), else the family
  graph's own ``quant_predicate`` (mlx-lm's convention: Gemma 4 keeps its
  router at 8-bit affine, whatever the mode), else none. A predicate may
  return ``False`` (keep dense), ``True`` (the global spec) or a
  ``{group_size, bits[, mode]}`` override, which is recorded per module in
  the config's ``quantization``.
* **Dequantize** (``-d``): every packed module's weight is unpacked with its
  own group size, bits and mode and its scales/biases dropped; this works on
  the tensors, so it needs no dense twin of a family's quantized layer class.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, MutableMapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from mlx_loom.adapters.layers import dense_weight, is_quantized
from mlx_loom.artifacts import MODE_PACKING, QUANT_MODES, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from mlx_loom.errors import ConvertError

__all__ = [
    "DTYPES",
    "default_packing",
    "QuantPredicate",
    "cast",
    "dequantized_tensors",
    "quantize",
    "validate_spec",
]

#: The dtypes ``--dtype`` accepts (mlx-lm's ``MODEL_CONVERSION_DTYPES``).
DTYPES: dict[str, mx.Dtype] = {
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}

QuantPredicate = Callable[[str, nn.Module], bool | dict[str, Any]]

#: mlx-lm's defaults when ``--q-bits`` / ``--q-group-size`` are not given (affine).
DEFAULT_BITS, DEFAULT_GROUP_SIZE = 4, 64


def default_packing(mode: str, group_size: int | None, bits: int | None) -> tuple[int, int]:
    """``(group_size, bits)`` with what was not given filled in as mlx-lm does for ``mode``."""
    fixed_group, fixed_bits = MODE_PACKING.get(mode, (DEFAULT_GROUP_SIZE, DEFAULT_BITS))
    return group_size or fixed_group, bits or fixed_bits


def validate_spec(bits: int, group_size: int, *, where: str, mode: str = "affine") -> None:
    """Refuse a packing this engine cannot load back (MLX's modes, bit widths and groups)."""
    if mode not in QUANT_MODES:
        raise ConvertError(
            f"{where}: quantization mode {mode!r} is not supported "
            f"(supported: {', '.join(QUANT_MODES)})",
            fix="choose --q-mode from " + ", ".join(QUANT_MODES),
        )
    if mode in MODE_PACKING:
        fixed_group, fixed_bits = MODE_PACKING[mode]
        if (group_size, bits) != (fixed_group, fixed_bits):
            raise ConvertError(
                f"{where}: mode {mode} packs group size {fixed_group} at {fixed_bits} bits "
                f"only, not group size {group_size} at {bits} bits",
                fix=f"drop --q-group-size/--q-bits with --q-mode {mode} (or give "
                f"{fixed_group}/{fixed_bits})",
            )
        return
    if bits not in SUPPORTED_BITS:
        raise ConvertError(
            f"{where}: {bits}-bit quantization is not supported "
            f"(supported: {', '.join(map(str, SUPPORTED_BITS))})",
            fix="choose --q-bits from " + ", ".join(map(str, SUPPORTED_BITS)),
        )
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ConvertError(
            f"{where}: group size {group_size} is not supported "
            f"(supported: {', '.join(map(str, SUPPORTED_GROUP_SIZES))})",
            fix="choose --q-group-size from " + ", ".join(map(str, SUPPORTED_GROUP_SIZES)),
        )


def cast(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast floating parameters to ``dtype`` where the graph's ``cast_predicate`` allows."""
    allowed = getattr(model, "cast_predicate", None) or (lambda _: True)

    def one(path: str, value: mx.array) -> mx.array:
        if allowed(path) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(dtype)
        return value

    model.update(tree_map_with_path(one, model.parameters()))


def quantize(
    model: nn.Module,
    config: dict[str, Any],
    *,
    bits: int,
    group_size: int,
    mode: str = "affine",
    predicate: QuantPredicate | None = None,
) -> dict[str, Any]:
    """Pack ``model`` in place; return ``config`` with ``quantization`` (and its HF copy).

    Mirrors mlx-lm's ``quantize_model``: when the config already declares a
    quantization (a partly quantized source), every newly packed module is
    recorded by path.
    """
    validate_spec(bits, group_size, where="--q-bits/--q-group-size", mode=mode)
    out = copy.deepcopy(config)
    predicate = predicate or getattr(model, "quant_predicate", None)
    spec = {"group_size": group_size, "bits": bits, "mode": mode}
    fine_grained = "quantization" in out
    if not fine_grained:
        out["quantization"] = dict(spec)

    def wrapped(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if not hasattr(module, "to_quantized"):
            return False
        if module.weight.shape[-1] % group_size != 0:
            return False
        choice: bool | dict[str, Any] = True if predicate is None else predicate(path, module)
        if isinstance(choice, dict):
            validate_spec(
                choice["bits"],
                choice["group_size"],
                where=f"the predicate for {path}",
                mode=choice.get("mode", "affine"),
            )
            out["quantization"][path] = choice
        elif fine_grained and choice:
            out["quantization"][path] = spec
        return choice

    nn.quantize(model, group_size, bits, mode=mode, class_predicate=wrapped)
    out["quantization_config"] = out["quantization"]
    return out


def dequantized_tensors(
    model: nn.Module, tensors: MutableMapping[str, mx.array]
) -> dict[str, mx.array]:
    """``tensors`` (the model's flattened parameters) with every packed weight unpacked."""
    packed = {
        path: module for path, module in model.named_modules() if path and is_quantized(module)
    }
    out: dict[str, mx.array] = {}
    for name, value in tensors.items():
        module_path, _, leaf = name.rpartition(".")
        module = packed.get(module_path)
        if module is None:
            out[name] = value
        elif leaf == "weight":
            out[name] = dense_weight(module)
        elif leaf not in ("scales", "biases"):
            out[name] = value
    return out

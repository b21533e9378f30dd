"""What a checkpoint is, in the numbers a person compares models by — from headers only.

``loom explain`` and ``loom models`` show parameter count, dtype,
quantization and context length. All of it comes from ``config.json`` and the
safetensors headers (:func:`~mlx_loom.artifacts.weights.read_manifest`), so a
70B checkpoint is summarised without reading one byte of tensor data.

How the numbers are counted, and why:

* **Parameters** are the model's logical weights. A quantized matrix is
  stored packed (``bits`` per value in ``uint32`` words), so its count is the
  packed element count times ``32 / bits``; its ``scales`` and ``biases`` are
  packing overhead, not parameters (mlx names a layer's real bias ``bias``
  and quantization offsets ``biases``). This matches the count of the
  unquantized checkpoint the file was converted from. Every tensor the
  checkpoint holds counts — a vision tower beside the language model too —
  as model cards count them.
* **dtype** is the floating type that holds the most parameters; an
  affine-quantized matrix counts under the dtype of its scales, which is the
  type its matmuls compute in. A 4-bit mlx-community checkpoint therefore
  reads ``bfloat16`` with quantization ``4-bit``. A microscaling matrix
  (mxfp4, nvfp4, mxfp8: uint8 scales) has no float dtype and does not count.
* **Quantization** names the affine widths and groups (``4-bit, group 64``)
  and each microscaling mode by name (``mxfp4``; mixed: ``mxfp4 + 8-bit,
  group 64``).
* **Context length** is ``max_position_embeddings`` (of ``text_config`` for
  wrapper layouts) — what the engine itself treats as the context.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from mlx_loom.artifacts.config import ArtifactConfig
from mlx_loom.artifacts.safetensors_header import TensorInfo
from mlx_loom.artifacts.weights import list_weight_files, read_manifest

__all__ = ["WeightsSummary", "summarize_artifact"]

# safetensors codes of floating types, and the names people know them by.
_FLOAT_NAMES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3",
    "F8_E8M0": "float8_e8m0",
}


class WeightsSummary(BaseModel):
    """Parameter count, dtype, quantization and context of one checkpoint."""

    model_config = ConfigDict(frozen=True)

    parameters: int
    dtype: str | None
    quantization: str | None
    quantization_bits: tuple[int, ...]
    #: The packing modes of the quantized matrices (``affine``, ``mxfp4`` ...).
    quantization_modes: tuple[str, ...] = ()
    context_length: int | None
    weights_bytes: int


def summarize_artifact(
    model_dir: str | os.PathLike[str],
    config: ArtifactConfig,
    manifest: Mapping[str, TensorInfo] | None = None,
) -> WeightsSummary:
    """Summarise the checkpoint in ``model_dir`` (headers only; never loads tensors)."""
    model_dir = Path(model_dir)
    if manifest is None:
        manifest = read_manifest(model_dir)
    quantized = {
        name.removesuffix(".weight")
        for name in manifest
        if name.endswith(".weight") and f"{name.removesuffix('.weight')}.scales" in manifest
    }
    overhead = {f"{m}.{part}" for m in quantized for part in ("scales", "biases")}
    by_dtype: Counter[str] = Counter()
    bits_seen: set[int] = set()
    affine_seen: set[tuple[int, int]] = set()
    modes_seen: set[str] = set()
    parameters = 0
    for name, info in manifest.items():
        if name in overhead:
            continue
        module = name.removesuffix(".weight")
        if module in quantized:
            spec = config.quantization.for_module(module) if config.quantization else None
            count = info.numel * 32 // spec.bits if spec is not None else info.numel
            if spec is not None:
                bits_seen.add(spec.bits)
                modes_seen.add(spec.mode)
                if spec.mode == "affine":
                    affine_seen.add((spec.bits, spec.group_size))
            code = manifest[f"{module}.scales"].dtype
        else:
            count, code = info.numel, info.dtype
        parameters += count
        if code in _FLOAT_NAMES:
            by_dtype[_FLOAT_NAMES[code]] += count
    dtype = by_dtype.most_common(1)[0][0] if by_dtype else None
    bits = tuple(sorted(bits_seen))
    context = config.text_config().get("max_position_embeddings")
    return WeightsSummary(
        parameters=parameters,
        dtype=dtype,
        quantization=_describe_quantization(affine_seen, modes_seen),
        quantization_bits=bits,
        quantization_modes=tuple(sorted(modes_seen)),
        context_length=context if isinstance(context, int) and context > 0 else None,
        weights_bytes=sum(f.stat().st_size for f in list_weight_files(model_dir)),
    )


def _describe_quantization(affine: set[tuple[int, int]], modes: set[str]) -> str | None:
    parts = sorted(modes - {"affine"})
    bits, groups = sorted({b for b, _ in affine}), {g for _, g in affine}
    if bits:
        width = "/".join(map(str, bits)) + "-bit" + (" mixed" if len(bits) > 1 else "")
        parts.append(width + (", group " + "/".join(map(str, sorted(groups))) if groups else ""))
    return " + ".join(parts) or None

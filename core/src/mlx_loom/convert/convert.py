"""``convert``: a Hugging Face (or MLX) checkpoint in, an MLX checkpoint out (``mlx_lm.convert``).

The source is read through the family plugin's own loader — the same
resolution, schema, name mapping and strict weight check as :func:`mlx_loom.load`
— with the graph built lazily, so tensors are only read when the writer asks
for them. The graph's parameters are the output's tensors: their names are the
family's module paths, which mlx-lm's loaders accept for every family here.

Options and their mlx-lm defaults: ``dtype`` falls back to the config's
``torch_dtype`` (or ``text_config.dtype``) and is applied only when it is a
conversion dtype; ``q_bits``/``q_group_size`` default to 4 and 64 for affine
and to the mode's own packing for mxfp4 (32, 4 bits), nvfp4 (16, 4 bits) and
mxfp8 (32, 8 bits); a recipe (affine only, as in mlx-lm) without
``q_group_size`` uses 64 (mlx-lm records ``null`` there, which no
loader can check; the tensors are the same).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mlx.utils import tree_flatten

from mlx_loom.artifacts import QUANT_MODES
from mlx_loom.errors import ConvertError
from mlx_loom.host import resolve_model
from mlx_loom.loader import build_model

from .output import (
    check_destination,
    check_upload,
    hub_repo,
    in_checkpoint_layout,
    upload,
    write_model,
)
from .quantize import DTYPES, cast, default_packing, dequantized_tensors, quantize
from .recipes import RECIPES, mixed_predicate

__all__ = ["MODES", "convert", "load_lazily"]

#: ``--q-mode`` values mlx-lm offers; each loads back in mlx-loom and in mlx-lm.
MODES = QUANT_MODES


def load_lazily(source: str | os.PathLike[str], **host_options: Any):
    """The family's graph for ``source`` with its weights unread, and the resolution.

    Built on the checkpoint's own terms — its stored dtypes (``compute_dtype``
    ``"checkpoint"``) and MLX's own layers (``cpu_kernels`` ``"cpu-ops"``) —
    whatever the CPU path would choose for running it: a conversion writes
    what the checkpoint holds, transformed only as asked.
    """
    options = {"compute_dtype": "checkpoint", "cpu_kernels": "cpu-ops", **host_options}
    resolved = resolve_model(os.fspath(source), **options)
    return build_model(resolved, lazy=True), resolved


def _config_dtype(raw: dict[str, Any], dtype: str | None) -> str | None:
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConvertError(
                f"--dtype {dtype} is not a conversion dtype",
                fix=f"choose one of {', '.join(DTYPES)}",
            )
        return dtype
    found = raw.get("torch_dtype")
    text = raw.get("text_config")
    if found is None and isinstance(text, dict):
        found = text.get("dtype")
    return found if found in DTYPES else None


def _check_options(quantize_: bool, dequantize: bool, q_mode: str, recipe: str | None) -> None:
    if quantize_ and dequantize:
        raise ConvertError(
            "-q/--quantize and -d/--dequantize were both given",
            fix="choose either quantize or dequantize, not both",
        )
    if q_mode not in MODES:
        raise ConvertError(f"--q-mode {q_mode} is unknown", fix=f"choose one of {', '.join(MODES)}")
    if recipe is not None and q_mode != "affine":
        raise ConvertError(
            f"--quant-predicate {recipe} mixes affine bit widths and cannot be combined "
            f"with --q-mode {q_mode}",
            fix="drop --quant-predicate, or quantize with --q-mode affine",
        )
    if recipe is not None and recipe not in RECIPES:
        raise ConvertError(
            f"--quant-predicate {recipe} is unknown", fix=f"choose one of {', '.join(RECIPES)}"
        )
    if recipe is not None and not quantize_:
        raise ConvertError(
            f"--quant-predicate {recipe} was given without -q/--quantize",
            fix="add -q to quantize with the recipe",
        )


def convert(
    hf_path: str | os.PathLike[str],
    mlx_path: str | os.PathLike[str] = "mlx_model",
    *,
    quantize_: bool = False,
    q_group_size: int | None = None,
    q_bits: int | None = None,
    q_mode: str = "affine",
    dtype: str | None = None,
    quant_predicate: str | None = None,
    dequantize: bool = False,
    upload_repo: str | None = None,
    progress: bool = True,
    max_shard_bytes: int | None = None,
    **host_options: Any,
) -> Path:
    """Convert ``hf_path`` into a new MLX model directory ``mlx_path`` and return it.

    ``host_options`` (``policy``, ``host``, ``registry``) choose the plugin
    composition, as for :func:`mlx_loom.load`. Every option is checked —
    including an upload the host's ``HF_HUB_OFFLINE`` forbids — before a
    tensor is read.
    """
    dst = Path(mlx_path).expanduser()
    check_destination(dst)
    _check_options(quantize_, dequantize, q_mode, quant_predicate)
    check_upload(upload_repo)
    model, resolved = load_lazily(hf_path, **host_options)
    module = model.module
    config = dict(resolved.config.raw)

    target = _config_dtype(config, dtype)
    if target is not None:
        cast(module, DTYPES[target])
    if quantize_:
        group_size, bits = default_packing(q_mode, q_group_size, q_bits)
        predicate = (
            mixed_predicate(quant_predicate, module, group_size) if quant_predicate else None
        )
        config = quantize(
            module,
            config,
            bits=bits,
            group_size=group_size,
            mode=q_mode,
            predicate=predicate,
        )
    tensors = dict(tree_flatten(module.parameters()))
    if dequantize:
        tensors = dequantized_tensors(module, tensors)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    tensors, config = in_checkpoint_layout(tensors, config)
    source_dir = resolved.model_dir
    del model, module, resolved  # the writer must hold the only references to the tensors
    write_model(
        dst,
        source_dir=source_dir,
        tensors=tensors,
        config=config,
        progress=progress,
        base_model=hub_repo(hf_path),
        desc="converting",
        max_shard_bytes=max_shard_bytes,
    )
    if upload_repo is not None:
        upload(dst, upload_repo)
    return dst

"""``fuse``: fold an adapter into its base model and write the result, like ``mlx_lm.fuse``.

The base is built lazily through its family's loader, the adapter applied by
the core's transform (so it is checked exactly as at load time), and each
adapted layer replaced by the tensors of the equivalent plain layer
(:meth:`mlx_loom.adapters.AdaptedLayer.fused`): a quantized base stays
quantized with its own group size and bits unless ``dequantize`` is asked,
in which case every packed layer of the model is written dense and the
config's quantization dropped. A full fine-tune's weights are written as they
were applied. The output is an ordinary checkpoint: both engines load it
without the adapter.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_loom.adapters import adapted_layers, load_adapter

from .convert import load_lazily
from .output import (
    check_destination,
    check_upload,
    hub_repo,
    in_checkpoint_layout,
    upload,
    write_model,
)
from .quantize import dequantized_tensors

__all__ = ["fuse", "fused_tensors"]


def fused_tensors(module, *, dequantize: bool = False) -> dict[str, mx.array]:
    """The module's parameters with every adapted layer folded, in the tree's order."""
    adapted = dict(adapted_layers(module))
    written: set[str] = set()
    out: dict[str, mx.array] = {}
    flat = cast(list[tuple[str, mx.array]], tree_flatten(module.parameters()))
    for name, value in flat:
        owner = next((p for p in adapted if name.startswith(p + ".")), None)
        if owner is None:
            out[name] = value
        elif owner not in written:  # the first of the layer's tensors: emit the fused layer
            written.add(owner)
            fused = adapted[owner].fused(dequantize=dequantize)
            out.update({f"{owner}.{leaf}": v for leaf, v in fused.items()})
    return out


def fuse(
    model: str | os.PathLike[str],
    adapter_path: str | os.PathLike[str] = "adapters",
    save_path: str | os.PathLike[str] = "fused_model",
    *,
    dequantize: bool = False,
    upload_repo: str | None = None,
    progress: bool = True,
    max_shard_bytes: int | None = None,
    **host_options: Any,
) -> Path:
    """Write ``model`` with the adapter at ``adapter_path`` fused in, to ``save_path``."""
    dst = Path(save_path).expanduser()
    check_destination(dst)
    check_upload(upload_repo)
    built, resolved = load_lazily(model, **host_options)
    load_adapter(built, adapter_path)
    module = built.module
    tensors = fused_tensors(module, dequantize=dequantize)
    config = dict(resolved.config.raw)
    if dequantize:
        tensors = dequantized_tensors(module, tensors)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    tensors, config = in_checkpoint_layout(tensors, config)
    source_dir = resolved.model_dir
    del built, module, resolved
    write_model(
        dst,
        source_dir=source_dir,
        tensors=tensors,
        config=config,
        progress=progress,
        base_model=hub_repo(model),
        desc="fusing",
        max_shard_bytes=max_shard_bytes,
    )
    if upload_repo is not None:
        upload(dst, upload_repo)
    return dst

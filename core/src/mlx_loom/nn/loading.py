"""One strict weight loader: the checkpoint is compared with the graph before weights attach.

A family's graph tensors form a **manifest** — the one rule that both this
loader and the conformance kit's checkpoint writer
(``ModelType.checkpoint_tensors``) derive from, so they cannot disagree.
Entries name either a :class:`Matrix` (a quantizable weight at a module path,
with its optional bias) or a :class:`Tensor` (anything else, by full name), in
the graph's own tensor names. By default the manifest is **read from the
graph** (:func:`graph_manifest`): MLX creates parameters lazily, so building
the module allocates nothing and its parameter shapes *are* the rule — a
family writes its graph once instead of restating every shape. Building costs
Python objects per layer, though, so a config's layer count is first held to
the checkpoint's (``layers=``): a config claiming 65,536 layers over a
two-layer checkpoint is refused before any module exists.

:func:`load_checkpoint` then runs, in this order:

1. every safetensors header is validated and the tensors are opened lazily
   (``mx.load`` maps the files; no tensor data is read);
2. a wrapper layout's names become the text model's (:class:`ConfigView`),
   and the family's ``sanitize`` renames and reshapes (lazy ops only);
3. the config's layer count is checked against the layers the checkpoint
   holds (``layers=``), and the graph is built (lazy parameters) when the
   manifest is to be read from it;
4. the manifest is expanded — quantized where the checkpoint stores
   ``<module>.scales`` and the config's quantization covers the module — and
   compared with the tensors' names, shapes and dtypes. The comparison stops
   reading the manifest once it names more tensors than the checkpoint holds
   plus a margin, so a config that asks for 100,000 layers costs the size of
   the checkpoint, not of the config. Every mismatch goes into one
   :class:`~mlx_loom.errors.WeightsError`;
5. only then are quantized layers swapped in and the checkpoint's lazy
   arrays attached (``strict=True``: the graph and the manifest must agree).

Nothing here evaluates a weight: the core decides when (``mlx_loom.load``
evaluates unless ``lazy=True``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_loom.artifacts import (
    TEXT_LAYOUT,
    ArtifactConfig,
    ExpectedTensor,
    QuantizationConfig,
    QuantSpec,
    TextLayout,
    apply_quantization,
    load_weights,
    tensor_signature,
)
from mlx_loom.artifacts.weights import FLOAT_CODES, mismatch_error, weight_mismatches
from mlx_loom.errors import WeightsError

__all__ = [
    "MANIFEST_MARGIN",
    "Entry",
    "Manifest",
    "Matrix",
    "Tensor",
    "dense_tensors",
    "expected_tensors",
    "graph_checkpoint_tensors",
    "graph_manifest",
    "load_checkpoint",
]

_M = TypeVar("_M", bound=nn.Module)
_C = TypeVar("_C")

#: How many manifest entries past the checkpoint's tensor count are read
#: before the comparison stops: enough to list every missing tensor of a
#: checkpoint short of a few layers, bounded whatever the config claims.
MANIFEST_MARGIN = 256


@dataclass(frozen=True)
class Matrix:
    """A quantizable weight at a module path: ``weight`` of ``shape`` (``[..., out, in]``).

    Linear layers, embeddings and stacked experts (``[experts, out, in]``).
    ``bias`` adds ``bias [..., out]``. Quantized, ``weight`` is ``uint32
    [..., out, in * bits / 32]`` and ``scales`` has one column per group: in
    the checkpoint's float dtype with ``biases`` beside it (affine), or uint8
    with no ``biases`` (the microscaling modes mxfp4, nvfp4, mxfp8).
    """

    shape: tuple[int, ...]
    bias: bool = False


@dataclass(frozen=True)
class Tensor:
    """Any other tensor (norm gains, convolution weights, per-head parameters), by full name."""

    shape: tuple[int, ...]


Entry = Matrix | Tensor
#: ``(name, entry)`` pairs: a module path for a :class:`Matrix`, a tensor name
#: for a :class:`Tensor`. A generator is fine (and is what keeps step 3 bounded).
Manifest = Iterable[tuple[str, Entry]]


def dense_tensors(manifest: Manifest, dtype: str = "F32") -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of an unquantized checkpoint: name -> (shape, safetensors dtype)."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, entry in manifest:
        if isinstance(entry, Matrix):
            out[f"{name}.weight"] = (entry.shape, dtype)
            if entry.bias:
                out[f"{name}.bias"] = (entry.shape[:-1], dtype)
        else:
            out[name] = (entry.shape, dtype)
    return out


def _quantizable(module: nn.Module) -> bool:
    """The modules :func:`~mlx_loom.artifacts.apply_quantization` may swap (the same test)."""
    return hasattr(module, "to_quantized") and "weight" in module


def graph_manifest(model: nn.Module) -> list[tuple[str, Entry]]:
    """The manifest of ``model`` read from its parameters: every shape the graph will load.

    ``model`` is built but not evaluated (MLX parameters are lazy, so this
    reads shapes only). A quantizable module (a linear layer, an embedding,
    stacked experts — anything quantization may swap) is one :class:`Matrix`
    at its path, with its bias when it has one; every other parameter (norm
    gains, convolution kernels, per-head scalars) is a :class:`Tensor`.
    Private attributes (``_freqs``) are not parameters and are not listed.
    """
    matrices = {path: m for path, m in model.named_modules() if path and _quantizable(m)}
    out: list[tuple[str, Entry]] = []
    leaves: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for name, array in leaves:
        path, _, leaf = name.rpartition(".")
        module = matrices.get(path)
        shape = tuple(array.shape)
        if module is None:
            out.append((name, Tensor(shape)))
        elif leaf == "weight":
            out.append((path, Matrix(shape, bias="bias" in module)))
        elif leaf != "bias":
            out.append((name, Tensor(shape)))
    return out


def graph_checkpoint_tensors(
    schema: Callable[[Mapping[str, object]], _C],
    build: Callable[[_C], nn.Module],
    *,
    to_checkpoint: Callable[[list[tuple[str, Entry]], _C], Manifest] | None = None,
) -> Callable[..., dict[str, tuple[tuple[int, ...], str]]]:
    """A ``ModelType.checkpoint_tensors`` read from the graph: what the conformance kit writes.

    ``schema`` validates a raw config (a pydantic model's ``model_validate``);
    ``build`` makes the graph from it. ``to_checkpoint`` rewrites the graph's
    manifest into the checkpoint's layout where the two differ (per-expert
    tensors a checkpoint stores that the graph stacks, a wrapper's names);
    the loader's ``sanitize`` is its inverse.
    """

    def checkpoint_tensors(
        config: Mapping[str, object] | _C, dtype: str = "F32"
    ) -> dict[str, tuple[tuple[int, ...], str]]:
        cfg = schema(config) if isinstance(config, Mapping) else config
        manifest = graph_manifest(build(cfg))
        return dense_tensors(manifest if to_checkpoint is None else to_checkpoint(manifest, cfg), dtype)

    return checkpoint_tensors


def _check_layer_count(
    weights: Mapping[str, object], layers: tuple[str, int], model_dir: Path
) -> None:
    """Refuse a config whose layer count the checkpoint cannot back, before building anything."""
    prefix, count = layers
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    stored = {int(m.group(1)) for name in weights if (m := pattern.match(name))}
    if count > len(stored):
        missing = [i for i in range(count) if i not in stored]
        raise WeightsError(
            f"{model_dir}: config.json describes {count} layers under {prefix} but the checkpoint "
            f"holds {len(stored)}; missing layers: {', '.join(map(str, missing[:10]))}"
            + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""),
            fix="config.json does not describe these weights (a layer count was changed?): "
            "restore it, or use the checkpoint it belongs to",
        )


def _quantized(
    path: str, entry: Matrix, spec: QuantSpec, dtype: str | frozenset[str]
) -> Iterator[tuple[str, ExpectedTensor]]:
    """The packed tensors of one quantized matrix: affine scales and biases in a
    float dtype; a microscaling mode's uint8 scales alone."""
    *lead, rows, cols = entry.shape
    groups = (*lead, rows, cols // spec.group_size)
    yield f"{path}.weight", ((*lead, rows, cols * spec.bits // 32), "U32")
    if spec.has_biases:
        yield f"{path}.scales", (groups, dtype)
        yield f"{path}.biases", (groups, dtype)
    else:
        yield f"{path}.scales", (groups, "U8")


def expected_tensors(
    manifest: Manifest,
    stored: Mapping[str, object],
    quantization: QuantizationConfig | None,
    *,
    dtype: str | frozenset[str] = FLOAT_CODES,
    limit: int | None = None,
) -> tuple[dict[str, ExpectedTensor], list[str], bool]:
    """Expand ``manifest`` against what the checkpoint stores.

    Returns ``(expected, problems, truncated)``: the tensors the graph needs
    (quantized exactly where ``stored`` has ``<module>.scales`` and the
    config's quantization declares the module), the quantization claims
    the checkpoint contradicts, and whether the manifest was cut off after
    ``limit`` tensors.
    """
    expected: dict[str, ExpectedTensor] = {}
    problems: list[str] = []
    for name, entry in manifest:
        if limit is not None and len(expected) > limit:
            return expected, problems, True
        if isinstance(entry, Tensor):
            expected[name] = (entry.shape, dtype)
            continue
        has_scales = f"{name}.scales" in stored
        spec = quantization.for_module(name) if quantization is not None else None
        declared = quantization.overrides.get(name) if quantization is not None else None
        if has_scales and quantization is None:
            problems.append(
                f"{name}: the checkpoint has scales but config.json has no quantization"
            )
        elif has_scales and spec is None:
            problems.append(
                f"{name}: the config leaves it unquantized ({quantization.source_key}"  # type: ignore[union-attr]
                f"[{name!r}] = false) but the checkpoint has scales for it"
            )
        elif not has_scales and declared is not None:
            problems.append(
                f"{name}: the config declares {declared.describe()} "
                "but the checkpoint has no scales for it"
            )
        if has_scales and spec is not None:
            if entry.shape[-1] % spec.group_size:
                problems.append(
                    f"{name}: input dimension {entry.shape[-1]} is not a multiple of the "
                    f"quantization group size {spec.group_size}"
                )
            expected.update(_quantized(name, entry, spec, dtype))
        else:
            expected[f"{name}.weight"] = (entry.shape, dtype)
        if entry.bias:
            expected[f"{name}.bias"] = (entry.shape[:-1], dtype)
    return expected, problems, False


def load_checkpoint(
    model_dir: str | os.PathLike[str],
    config: ArtifactConfig,
    *,
    build: Callable[[], _M],
    manifest: Manifest | None = None,
    layers: tuple[str, int] | None = None,
    sanitize: Callable[[dict[str, mx.array]], dict[str, mx.array]] | None = None,
    layout: TextLayout = TEXT_LAYOUT,
    uniform_dtype_of: str | None = None,
) -> _M:
    """Compare the checkpoint with the graph's tensors, then attach the weights to the graph.

    ``manifest`` is the family's tensor rule for this config (graph names);
    left out, it is read from ``build()``'s parameters (:func:`graph_manifest`).
    ``layers`` is ``(prefix, count)`` — the graph's layer list and the
    config's layer count, e.g. ``("model.layers", cfg.num_hidden_layers)`` —
    checked against the checkpoint's tensor names before anything is built
    (required in practice when the manifest is read from the graph: it is
    what keeps a hostile layer count from costing a huge build).
    ``sanitize`` maps the checkpoint's names and layouts to them (after the
    wrapper ``layout`` has been stripped). ``uniform_dtype_of`` names a
    tensor whose stored float dtype every float tensor must share (a family
    that refuses mixed-precision checkpoints); otherwise each float tensor
    may be bf16, fp16 or fp32. Raises one :class:`WeightsError` listing every
    difference before any weight is attached (and, with an explicit
    ``manifest``, before ``build`` is called).
    """
    model_dir = Path(model_dir)
    view = config.view(layout)
    weights = view.text_weights(load_weights(model_dir))
    if sanitize is not None:
        weights = sanitize(weights)
    if layers is not None:
        _check_layer_count(weights, layers, model_dir)
    model = build() if manifest is None else None
    if manifest is None:
        manifest = graph_manifest(model)  # type: ignore[arg-type]
    quantization = view.quantization
    dtype: str | frozenset[str] = FLOAT_CODES
    if uniform_dtype_of is not None and uniform_dtype_of in weights:
        dtype = tensor_signature(weights[uniform_dtype_of])[1]
        if dtype not in FLOAT_CODES:
            raise WeightsError(
                f"{model_dir}: {uniform_dtype_of} is stored as {dtype}; float tensors must be "
                f"one of {', '.join(sorted(FLOAT_CODES))}",
                fix="re-export the checkpoint in bf16, fp16 or fp32",
            )
    limit = len(weights) + MANIFEST_MARGIN
    expected, problems, truncated = expected_tensors(
        manifest, weights, quantization, dtype=dtype, limit=limit
    )
    if truncated:
        missing = [n for n in expected if n not in weights]
        raise WeightsError(
            f"{model_dir}: config.json describes more than {limit} tensors but the checkpoint "
            f"holds {len(weights)}; the first of the {len(missing)}+ missing: "
            + ", ".join(missing[:10]),
            fix="config.json does not describe these weights (a layer count or size was "
            "changed?): restore it, or use the checkpoint it belongs to",
        )
    sections = weight_mismatches(weights, expected)
    if problems:
        sections.insert(0, ("quantization", problems))
    if sections:
        raise mismatch_error(sections, source=model_dir)
    if model is None:
        model = build()
    apply_quantization(model, quantization, weights)
    model.load_weights(list(weights.items()), strict=True)
    return model

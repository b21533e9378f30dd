"""Reading an adapter directory and applying it to a built graph, strictly.

The transform runs after the family's factory has built and loaded the graph;
the family code never sees it. Every check happens before the graph is
touched, and every misfit is reported at once, naming the tensor:

* a tensor for a module the model lacks, or one the adapter's own config does
  not select (``unexpected``);
* a factor or magnitude the config selects but the file lacks (``missing``) —
  mlx-lm would quietly keep its random initialisation there;
* a shape that does not fit the module (``wrong shape``), with the rank the
  tensor implies when only the rank differs from ``lora_parameters.rank``;
* a tensor that is not floating point (``wrong dtype``).

Nothing is half-applied: the graph is modified only once the whole adapter fits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import cast
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_loom.artifacts import read_safetensors_header
from mlx_loom.artifacts.finite import named_list, non_finite
from mlx_loom.errors import AdapterError

from .config import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, AdapterConfig, read_adapter_config
from .layers import (
    AdaptedEmbedding,
    AdaptedExpertLinear,
    AdaptedLayer,
    AdaptedLinear,
    Factors,
    RowSelection,
)
from .names import NameMap, infer_name_map
from .targets import Target, decoder_layers, select_targets

__all__ = [
    "Adapter",
    "apply_adapter",
    "expected_factors",
    "install",
    "plan_adapter",
    "read_adapter",
]

_SHOW = 12  # tensors listed per category in one error


@dataclass(frozen=True)
class Adapter:
    """An adapter read from disk: its config and its tensors (lazy, headers validated)."""

    path: Path
    config: AdapterConfig
    tensors: Mapping[str, mx.array]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def kind(self) -> str:
        return self.config.fine_tune_type


def read_adapter(path: str | os.PathLike[str]) -> Adapter:
    """Read ``path/adapter_config.json`` and ``path/adapters.safetensors``.

    The safetensors header is validated by the core's reader before MLX maps
    the file, exactly as for model weights.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is a file, not a directory"
        raise AdapterError(
            f"adapter path {path} {what}",
            fix=f"pass the directory holding {ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE} "
            "(what mlx-lm's trainer writes to --adapter-path)",
        )
    config = read_adapter_config(path)
    weights = path / ADAPTER_WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(
            f"{path} has {ADAPTER_CONFIG_FILE} but no {ADAPTER_WEIGHTS_FILE}",
            fix="point at the adapter directory the trainer finished writing",
        )
    read_safetensors_header(weights)
    # Without return_metadata, mx.load of a safetensors file is a dict of arrays.
    tensors = cast(dict[str, mx.array], mx.load(str(weights), format="safetensors"))
    bad = non_finite(sorted(tensors.items()))
    if bad:  # the rule a base checkpoint meets: NaN or Inf would poison every logit
        raise AdapterError(
            f"{weights} holds NaN or Inf values in {named_list(bad)}",
            fix="the adapter is corrupt or its training diverged; use an earlier checkpoint "
            "of it, or retrain",
        )
    return Adapter(path=path, config=config, tensors=tensors)


def _factor_shapes(target: Target, rank: int, dora: bool) -> dict[str, tuple[int, ...]]:
    r = rank
    out: dict[str, tuple[int, ...]]
    if target.kind == "linear":
        out = {"lora_a": (target.cols, r), "lora_b": (r, target.rows)}
    elif target.kind == "expert":
        e = target.experts
        out = {"lora_a": (e, r, target.cols), "lora_b": (e, target.rows, r)}
    else:
        out = {"lora_a": (target.rows, r), "lora_b": (r, target.cols)}
    if dora:
        out["m"] = (target.rows,)
    return out


def expected_factors(target: Target, config: AdapterConfig) -> dict[str, tuple[int, ...]]:
    """Leaf name -> shape of every tensor the adapter must hold for ``target``.

    Linear: ``lora_a [in, r]``, ``lora_b [r, out]``; routed experts:
    ``lora_a [E, r, in]``, ``lora_b [E, out, r]``; embedding: ``lora_a
    [num_embeddings, r]``, ``lora_b [r, dims]``; DoRA adds ``m [out]``
    (``[num_embeddings]``). ``in`` is the dense width, also for packed weights.
    """
    assert config.lora_parameters is not None
    return _factor_shapes(target, config.lora_parameters.rank, config.dora)


def _rank_of(leaf: str, target: Target, shape: tuple[int, ...]) -> int | None:
    """The rank a factor's shape implies when only its rank differs from the config's."""
    for r in set(shape):
        if _factor_shapes(target, r, False).get(leaf) == shape:
            return r
    return None


def _capped(items: list[str]) -> str:
    shown = "; ".join(items[:_SHOW])
    return shown + (f"; ... ({len(items) - _SHOW} more)" if len(items) > _SHOW else "")


def _refuse_unsupported(targets: list[Target], config: AdapterConfig) -> None:
    if not config.dora:
        return
    for t in targets:
        if t.kind == "expert":
            raise AdapterError(
                f"DoRA is not defined for the routed-expert projection {t.path} "
                "(mlx-lm refuses DoRA there too)",
                fix="train a LoRA adapter for expert layers, or leave them out of "
                "lora_parameters.keys",
            )
        if t.kind == "embedding" and t.quantized:
            raise AdapterError(
                f"DoRA needs the dense rows of {t.path}, which is quantized",
                fix="apply the adapter to an unquantized base, or leave the embedding out of "
                "lora_parameters.keys",
            )


def _check_factors(
    adapter: Adapter, targets: list[Target], names: NameMap
) -> dict[str, dict[str, mx.array]]:
    """Match the file's tensors to the targets; one error listing every misfit."""
    by_name = {names.to_trainer(t.path): t for t in targets}
    assert adapter.config.lora_parameters is not None
    rank_in_config = adapter.config.lora_parameters.rank
    found: dict[str, dict[str, mx.array]] = {t.path: {} for t in targets}
    present: set[str] = set()  # fitting or not, these names were accounted for
    unexpected, misshaped, mistyped = [], [], []
    for name in sorted(adapter.tensors):
        module, _, leaf = name.rpartition(".")
        target = by_name.get(module)
        want = expected_factors(target, adapter.config) if target is not None else {}
        if target is None or leaf not in want:
            unexpected.append(name)
            continue
        present.add(name)
        value = adapter.tensors[name]
        shape = tuple(value.shape)
        if shape != want[leaf]:
            rank = _rank_of(leaf, target, shape)
            note = (
                f" (rank {rank}; adapter_config.json says rank {rank_in_config})"
                if rank is not None
                else ""
            )
            misshaped.append(f"{name} {shape}, expected {want[leaf]}{note}")
        elif not mx.issubdtype(value.dtype, mx.floating):
            mistyped.append(f"{name} {value.dtype}")
        else:
            found[target.path][leaf] = value
    missing = [
        f"{trainer}.{leaf}"
        for trainer, t in by_name.items()
        for leaf in expected_factors(t, adapter.config)
        if f"{trainer}.{leaf}" not in present
    ]
    sections = [
        ("unexpected (no such module selected in this model)", unexpected),
        ("missing", missing),
        ("wrong shape", misshaped),
        ("wrong dtype (factors must be floating point)", mistyped),
    ]
    sections = [(label, items) for label, items in sections if items]
    if sections:
        body = "\n  ".join(f"{label} ({len(i)}): {_capped(i)}" for label, i in sections)
        raise AdapterError(
            f"{adapter.path / ADAPTER_WEIGHTS_FILE} does not fit this model "
            f"({len(targets)} module(s) selected by its config):\n  {body}",
            fix="use the adapter with the base model it was trained on (same model type, "
            "sizes and adapter_config.json)",
        )
    return found


_KINDS: dict[str, type[AdaptedLayer]] = {
    "linear": AdaptedLinear,
    "expert": AdaptedExpertLinear,
    "embedding": AdaptedEmbedding,
}


def install(
    model: nn.Module,
    layers: Mapping[str, tuple[Target, list[Factors | None]]],
    selection: RowSelection | None,
) -> list[str]:
    """Swap each planned module for its adapted layer (one factor set per slot)."""
    modules = dict(model.named_modules())
    built = [
        (path, _KINDS[target.kind](modules[path], factors, selection))
        for path, (target, factors) in layers.items()
    ]
    model.update_modules(tree_unflatten(built))
    mx.eval([_own_arrays(layer) for _, layer in built])
    return list(layers)


def _own_arrays(layer: AdaptedLayer) -> list[mx.array]:
    """The factors and precomputed ratios, not the base layer (which stays as loaded:
    evaluating it here would read a lazily built base into memory all at once)."""
    return [
        v
        for f in layer.adapters
        if isinstance(f, Factors)
        for v in f.values()
        if isinstance(v, mx.array)
    ]


def _apply_full(model: nn.Module, adapter: Adapter) -> list[str]:
    """A full fine-tune: replacement weights for some of the graph's parameters."""
    params = dict(tree_flatten(model.parameters()))
    modules = {p for p, _ in model.named_modules()}
    names = infer_name_map(
        (n.rpartition(".")[0] for n in adapter.tensors), modules, decoder_layers(model)[0]
    )
    problems, updates = [], []
    for name in sorted(adapter.tensors):
        ours = names.to_graph(name)
        value = adapter.tensors[name]
        have = params.get(ours)
        if have is None:
            problems.append(f"{name}: no such parameter in this model")
        elif tuple(value.shape) != tuple(have.shape):
            problems.append(f"{name} {tuple(value.shape)}, expected {tuple(have.shape)}")
        elif mx.issubdtype(have.dtype, mx.floating) != mx.issubdtype(value.dtype, mx.floating):
            problems.append(f"{name} {value.dtype}, expected {have.dtype}")
        else:
            updates.append((ours, value))
    if problems:
        raise AdapterError(
            f"{adapter.path / ADAPTER_WEIGHTS_FILE} (a full fine-tune) does not fit this model: "
            + _capped(problems),
            fix="use the fine-tuned weights with the base model they were trained from",
        )
    model.update(tree_unflatten(updates))
    mx.eval([v for _, v in updates])
    return [n for n, _ in updates]


def plan_adapter(model: nn.Module, adapter: Adapter) -> list[tuple[Target, Factors]]:
    """Every module ``adapter`` adapts in ``model`` with its factors, all checked.

    Nothing is changed; raises :class:`AdapterError` (naming each misfit) if
    the adapter does not fit. A full fine-tune has no factors to plan.
    """
    config = adapter.config
    assert config.low_rank and config.lora_parameters is not None
    modules = dict(model.named_modules())
    names = infer_name_map(
        (n.rpartition(".")[0] for n in adapter.tensors), set(modules), decoder_layers(model)[0]
    )
    targets = select_targets(model, config, full_path=names.to_trainer)
    _refuse_unsupported(targets, config)
    found = _check_factors(adapter, targets, names)
    scale = config.lora_parameters.scale
    return [
        (
            t,
            Factors(
                found[t.path]["lora_a"], found[t.path]["lora_b"], scale, found[t.path].get("m")
            ),
        )
        for t in targets
    ]


def apply_adapter(model: nn.Module, adapter: Adapter) -> list[str]:
    """Apply ``adapter`` to every row of ``model`` (the family's graph); returns the paths.

    Raises :class:`AdapterError` before changing anything if the adapter does not fit.
    """
    if not adapter.config.low_rank:
        return _apply_full(model, adapter)
    plan = plan_adapter(model, adapter)
    return install(model, {t.path: (t, [f]) for t, f in plan}, selection=None)

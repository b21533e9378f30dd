"""Which modules of a built graph an adapter touches, and what each one is.

The rule is mlx-lm's ``linear_to_lora_layers``, so an adapter trained there
lands on the same modules here:

1. The decoder layers are the graph's ``layers`` attribute when it has one
   (mlx-lm's convention), otherwise the one list of modules named ``layers``
   in its tree. Zero or several such lists: refused, the adapter cannot be
   placed.
2. ``keys`` absent: every adaptable module of any layer, by its path relative
   to the layer (``self_attn.q_proj``), taken over all layers.
3. The last ``num_layers`` layers (all of them when ``num_layers <= 0`` or it
   exceeds the depth, as ``layers[-max(num_layers, 0):]`` does) adapt every
   module whose relative path is a key; then any module whose *full* path is a
   key (``lm_head``) is adapted too.

Adaptable modules are ``nn.Linear``/``nn.QuantizedLinear``, ``nn.Embedding``/
``nn.QuantizedEmbedding`` and routed-expert projections: a module whose
``weight`` is ``[experts, out, in]`` (packed along ``in`` when quantized) and
that can be quantized or already is, i.e. the SwitchLinear contract mlx-lm's
MoE families and ours follow. A key that names anything else (a norm, a
convolution) is refused, as in mlx-lm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import mlx.nn as nn

from mlx_loom.errors import AdapterError

from .config import AdapterConfig

__all__ = ["LayerKind", "Target", "decoder_layers", "kind_of", "select_targets"]

LayerKind = Literal["linear", "expert", "embedding"]


@dataclass(frozen=True)
class Target:
    """One module to adapt: its path in the graph, its kind and geometry.

    ``rows``/``cols`` are the dense weight's ``[out, in]`` for a linear,
    ``[num_embeddings, dims]`` for an embedding; ``experts`` is the expert
    count for a routed-expert projection (else 0).
    """

    path: str
    kind: LayerKind
    rows: int
    cols: int
    experts: int
    quantized: bool


def kind_of(module: nn.Module) -> LayerKind | None:
    """What kind of adaptable layer ``module`` is, or ``None`` if it is not one."""
    if isinstance(module, nn.Linear | nn.QuantizedLinear):
        return "linear"
    if isinstance(module, nn.Embedding | nn.QuantizedEmbedding):
        return "embedding"
    if "weight" in module and getattr(module["weight"], "ndim", 0) == 3:
        if hasattr(module, "to_quantized") or "scales" in module:
            return "expert"
    return None


def _dense_columns(module: nn.Module) -> int:
    """The dense input width: packed uint32 columns hold ``32 / bits`` values each."""
    packed = module["weight"].shape[-1]
    if "scales" not in module:
        return packed
    return packed * 32 // module.bits


def describe(path: str, module: nn.Module) -> Target:
    kind = kind_of(module)
    if kind is None:
        raise AdapterError(
            f"the adapter targets {path}, a {type(module).__name__}, which cannot carry "
            "LoRA factors (only linear, routed-expert linear and embedding layers can)",
            fix="remove it from lora_parameters.keys in adapter_config.json",
        )
    shape = module["weight"].shape
    experts = shape[0] if kind == "expert" else 0
    return Target(
        path=path,
        kind=kind,
        rows=shape[-2],
        cols=_dense_columns(module),
        experts=experts,
        quantized="scales" in module,
    )


def decoder_layers(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """The decoder layers and their path (``model.layers``), by the rule in the module doc."""
    candidates: list[tuple[str, list[nn.Module]]] = []
    for path, module in model.named_modules():
        value = module.get("layers")
        if isinstance(value, list) and value and all(isinstance(v, nn.Module) for v in value):
            candidates.append((f"{path}.layers" if path else "layers", value))
    declared = getattr(type(model), "layers", None)
    if isinstance(declared, property):
        layers = model.layers
        for path, value in candidates:
            if value is layers or (
                len(value) == len(layers)
                and all(a is b for a, b in zip(value, layers, strict=True))
            ):
                return path, value
    if len(candidates) == 1:
        return candidates[0]
    found = ", ".join(p for p, _ in candidates) or "none"
    raise AdapterError(
        f"cannot tell which modules of {type(model).__name__} are its decoder layers "
        f"(lists of modules named 'layers': {found})",
        fix="the family's graph should expose its decoder layers as a `layers` property, "
        "as mlx-lm's models do",
    )


def _default_keys(layers: list[nn.Module]) -> set[str]:
    keys: set[str] = set()
    for layer in layers:
        for rel, module in layer.named_modules():
            if rel and kind_of(module) is not None:
                keys.add(rel)
    return keys


def select_targets(
    model: nn.Module, config: AdapterConfig, *, full_path: Callable[[str], str] | None = None
) -> list[Target]:
    """The modules ``config`` adapts in ``model``, in tree order; refused if none.

    ``full_path`` turns a graph path into the path the adapter's trainer saw
    (they differ only by a wrapper prefix, see :mod:`.names`); whole-model keys
    are matched against that.
    """
    if config.lora_parameters is None or config.num_layers is None:
        raise AdapterError(
            "a LoRA/DoRA adapter config needs num_layers and lora_parameters; this one has "
            f"num_layers={config.num_layers!r}, lora_parameters={config.lora_parameters!r}",
            fix="read the config with mlx_loom.adapters.read_adapter_config, or set both fields",
        )
    prefix, layers = decoder_layers(model)
    keys = set(config.lora_parameters.keys or ()) or _default_keys(layers)
    n = len(layers)
    start = n - config.num_layers if 0 < config.num_layers < n else 0
    chosen: dict[str, nn.Module] = {}
    for i in range(start, n):
        for rel, module in layers[i].named_modules():
            if rel in keys:
                chosen[f"{prefix}.{i}.{rel}"] = module
    to_trainer = full_path or (lambda p: p)
    for path, module in model.named_modules():
        if path and to_trainer(path) in keys:
            chosen[path] = module
    if not chosen:
        raise AdapterError(
            f"the adapter selects no module of this model: keys "
            f"{sorted(keys) if config.lora_parameters.keys else '(all adaptable)'} in the last "
            f"{config.num_layers} of {n} layers",
            fix="use an adapter trained for this model type (its lora_parameters.keys must "
            "name modules of the model's decoder layers)",
        )
    order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    return [describe(p, chosen[p]) for p in sorted(chosen, key=order.__getitem__)]

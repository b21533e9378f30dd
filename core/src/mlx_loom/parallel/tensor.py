"""Applying a plan's tensor rules (and the vocabulary split) to a built model.

The model arrives from the family's factory with every weight lazy and at
full size. For each :class:`~.plan.Split` this rank's slice of each matched
parameter replaces it (read from the file where possible, see
:mod:`.reading`); :class:`~.plan.Resize` corrects head counts;
:class:`~.plan.Reduce` and ``reduce=True`` splits put the ``all_sum`` where the
partial products meet. Every geometry problem — a head count the group size
does not divide, an input slice that is not whole quantization groups — is
found for the whole model before anything changes, and refused at once with
the group sizes that would work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_loom.errors import ParallelRefused

from .layers import reduce_output, row_parallel, vocab_head, vocab_rows
from .plan import (
    PLAN_FAULT_FIX,
    GeometryCheck,
    PlanFault,
    Reduce,
    Resize,
    Rule,
    Split,
    Units,
    Vocab,
    matches,
    sizes_that_work,
    units_check,
)
from .reading import SliceReader

__all__ = ["Wrap", "shard_tensor", "shard_vocab", "tensor_checks", "vocab_checks", "wrap"]

#: A class change to make once the model is otherwise final: ``(module path, change)``.
#: Applied after the CPU path has swapped in its kernels, so the change wraps
#: whichever class the module then has (:mod:`.layers`).
Wrap = tuple[str, Callable[[nn.Module], None]]


@dataclass(frozen=True)
class _Param:
    """One parameter a split slices: where it lives and how its axis maps to features."""

    module: nn.Module
    name: str
    full_name: str
    axis: int
    #: Parameter elements per feature along ``axis`` (packing, scale groups).
    ratio: Fraction
    group_size: int | None = None


@dataclass(frozen=True)
class _Target:
    rule: Split
    path: str
    params: tuple[_Param, ...]
    extent: int  # features along the split dimension


def _linear_params(path: str, module: nn.Module, dim: str) -> tuple[tuple[_Param, ...], int]:
    weight = module.get("weight") if isinstance(module, dict) else None
    if not isinstance(weight, mx.array) or weight.ndim < 2:
        raise PlanFault(
            f"the parallel plan splits {path!r}, a {type(module).__name__} without a weight "
            "matrix; only linear-like modules (weight [..., out, in]) split by 'out'/'in'",
            fix=PLAN_FAULT_FIX,
        )
    bits = getattr(module, "bits", None) if "scales" in module else None
    group = getattr(module, "group_size", None) if bits is not None else None
    packed = Fraction(bits, 32) if bits is not None else Fraction(1)
    extent = weight.shape[-2] if dim == "out" else int(weight.shape[-1] / packed)
    params = []
    for name, value in module.items():
        if not isinstance(value, mx.array):
            continue
        if name == "bias":
            if dim == "in":
                continue
            axis, ratio = value.ndim - 1, Fraction(1)
        elif dim == "out":
            axis, ratio = value.ndim - 2, Fraction(1)
        else:
            axis = value.ndim - 1
            ratio = packed if name == "weight" else Fraction(1, group or 1)
        params.append(
            _Param(module, name, f"{path}.{name}", axis, ratio, group if dim == "in" else None)
        )
    return tuple(params), extent


def _targets(model: nn.Module, rules: tuple[Rule, ...]) -> Iterator[tuple[Rule, str, Any]]:
    """Every ``(rule, path, module-or-parent)`` a rule matches (matching nothing is a fault)."""
    modules = [(p, m) for p, m in model.named_modules() if p]
    parameters = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    for rule in rules:
        found = False
        if isinstance(rule, Split) and rule.axis is not None:
            for name, _ in parameters:
                if matches(rule.path, name):
                    found = True
                    parent_path, _, leaf = name.rpartition(".")
                    yield rule, name, (dict(modules)[parent_path], leaf)
        else:
            for path, module in modules:
                if matches(rule.path, path):
                    found = True
                    yield rule, path, module
        if not found:
            raise PlanFault(
                f"the parallel plan names {rule.path!r}, which the built model does not have",
                fix=PLAN_FAULT_FIX,
            )


def _resolve(model: nn.Module, rules: tuple[Rule, ...]):
    splits: list[_Target] = []
    reduces: list[tuple[str, nn.Module]] = []
    resizes: list[tuple[Resize, str, nn.Module]] = []
    for rule, path, target in _targets(model, rules):
        if isinstance(rule, Split):
            if rule.axis is not None:
                parent, leaf = target
                value = parent[leaf]
                param = _Param(parent, leaf, path, rule.axis % value.ndim, Fraction(1))
                splits.append(_Target(rule, path, (param,), value.shape[param.axis]))
            else:
                params, extent = _linear_params(path, target, rule.dim)
                if (
                    rule.dim == "in"
                    and not rule.reduce
                    and "bias" in target
                    and not _reduced_above(path, rules)
                ):
                    raise PlanFault(
                        f"the parallel plan leaves {path!r} a partial sum, but it has a bias "
                        "that every rank would add, and no Reduce above it sums the ranks",
                        fix="This is a fault in the plugin's parallel plan: reduce at this "
                        "linear (reduce=True), or Reduce the module that contains it.",
                    )
                splits.append(_Target(rule, path, params, extent))
        elif isinstance(rule, Reduce):
            reduces.append((path, target))
        else:
            resizes.append((rule, path, target))
    for t in splits:
        total = sum(s.size for s in t.rule.segments(t.extent))
        if total != t.extent:
            raise PlanFault(
                f"the parallel plan's segments of {t.path!r} cover {total} features, but it "
                f"has {t.extent}",
                fix=PLAN_FAULT_FIX,
            )
    return splits, reduces, resizes


def _reduced_above(path: str, rules: tuple[Rule, ...]) -> bool:
    """Whether a :class:`Reduce` sums the output of a module that contains ``path``."""
    parts = path.split(".")
    return any(
        isinstance(rule, Reduce) and matches(rule.path, ".".join(parts[:n]))
        for rule in rules
        for n in range(1, len(parts))
    )


def _feature_ranges(target: _Target, rank: int, size: int) -> list[tuple[int, int]]:
    ranges, offset = [], 0
    for segment in target.rule.segments(target.extent):
        unit = Fraction(segment.size, segment.units.count)
        if unit.denominator != 1:
            raise PlanFault(
                f"the parallel plan splits {target.path!r}: {segment.size} features are not a "
                f"whole number per unit of {segment.units.describe()}",
                fix=PLAN_FAULT_FIX,
            )
        start, stop = segment.units.local(rank, size)
        ranges.append((offset + int(start * unit), offset + int(stop * unit)))
        offset += segment.size
    return ranges


def _quantization_check(target: _Target) -> list[GeometryCheck]:
    """Input splits of quantized weights must give whole quantization groups per rank."""
    checks = []
    units = target.rule.all_units
    for param in target.params:
        if param.ratio.denominator == 1 or param.group_size is None:
            continue

        def check(size: int, target: _Target = target, param: _Param = param) -> str | None:
            if not all(u.fits(size) for u in units):
                return None  # reported by the units check
            for start, stop in _feature_ranges(target, 0, size):
                if ((stop - start) * param.ratio).denominator != 1:
                    return (
                        f"{target.path} is quantized in groups of {param.group_size} input "
                        f"features, and {target.extent} split across {size} processes leaves "
                        f"{stop - start} per process, not whole groups"
                    )
            return None

        checks.append(GeometryCheck(units[0].field, check))
    return checks


def tensor_checks(model: nn.Module, rules: tuple[Rule, ...]) -> tuple[GeometryCheck, ...]:
    """Every divisibility requirement the rules put on the group size."""
    splits, _, resizes = _resolve(model, rules)
    units: dict[Units, None] = {}
    for t in splits:
        units.update(dict.fromkeys(t.rule.all_units))
    for rule, _, _ in resizes:
        units.update(dict.fromkeys(rule.attrs.values()))
    checks = [units_check(u) for u in units]
    for t in splits:
        checks += _quantization_check(t)
    return tuple(checks)


def vocab_checks(model: nn.Module, vocab: Vocab) -> tuple[GeometryCheck, ...]:
    """Each rank must hold at least one row of every vocabulary table."""
    checks = []
    for path in _vocab_paths(vocab):
        rows = _module(model, path)["weight"].shape[0]

        def check(size: int, rows: int = rows, path: str = path) -> str | None:
            block = -(-rows // size)
            if block * (size - 1) >= rows:
                return f"{path} has {rows} vocabulary rows, too few for {size} processes"
            return None

        checks.append(GeometryCheck("vocab_size", check))
    return tuple(checks)


def refuse_geometry(
    what: str, mode: str, size: int, checks: tuple[GeometryCheck, ...], *, other: str
) -> None:
    """Raise :class:`ParallelRefused` if any check fails at ``size``, naming the sizes that work.

    ``other`` is the alternative to suggest (the other mode, when it fits).
    """
    failed = [(c.field, p) for c in checks if (p := c.check(size)) is not None]
    if not failed:
        return
    fields = sorted({f for f, _ in failed})
    working = sizes_that_work(checks)
    sizes = (
        f"group sizes that would work: {', '.join(map(str, working))}"
        if working
        else "no group size up to 64 works"
    )
    fixes = [f"launch {n} processes (mlx.launch -n {n} ...)" for n in working[:1]]
    fixes += [other] if other else []
    raise ParallelRefused(
        f"{what} cannot run {mode} parallel across {size} processes: "
        + "; ".join(dict.fromkeys(p for _, p in failed))
        + f" (field{'s' if len(fields) > 1 else ''}: {', '.join(fields)}; {sizes}).",
        fix=(" or ".join(fixes) if fixes else "run it on one machine").capitalize() + ".",
    )


def shard_tensor(
    model: nn.Module, rules: tuple[Rule, ...], group: Any, reader: SliceReader
) -> list[Wrap]:
    """Replace every matched parameter by this rank's slice; return where the sums go.

    A linear whose partial products are summed (at it, or by a Reduce above
    it) keeps its bias on rank 0 alone (zeros elsewhere), so the sum adds it once.
    """
    rank, size = group.rank(), group.size()
    splits, reduces, resizes = _resolve(model, rules)
    wraps: list[Wrap] = []
    for target in splits:
        features = _feature_ranges(target, rank, size)
        for param in target.params:
            ranges = [(int(a * param.ratio), int(b * param.ratio)) for a, b in features]
            value = param.module[param.name]
            setattr(
                param.module,
                param.name,
                reader.take(param.full_name, value, param.axis, ranges),
            )
        if target.rule.dim == "in" and target.rule.axis is None:
            # An input split's partial products are summed — here (reduce=True)
            # or by a Reduce above (stacked experts' down_proj, whose per-expert
            # bias is weighted by the router before the sum) — so rank 0 alone
            # keeps the bias and the sum adds it once.
            module = _module(model, target.path)
            if "bias" in module and rank:
                module.bias = mx.zeros_like(module["bias"])
        if target.rule.reduce:
            wraps.append((target.path, partial(row_parallel, group=group)))
    for rule, path, module in resizes:
        for attr, units in rule.attrs.items():
            start, stop = units.local(rank, size)
            old = getattr(module, attr, None)
            if not isinstance(old, int):
                raise PlanFault(
                    f"the parallel plan resizes {path}.{attr}, which is not an integer "
                    f"attribute of the built {type(module).__name__}",
                    fix=PLAN_FAULT_FIX,
                )
            new = Fraction(old * (stop - start), units.count)
            if new.denominator != 1:
                raise PlanFault(
                    f"the parallel plan resizes {path}.{attr} = {old} by {units.describe()}, "
                    "which does not give a whole number",
                    fix=PLAN_FAULT_FIX,
                )
            setattr(module, attr, int(new))
    wraps += [(path, partial(reduce_output, group=group)) for path, _ in reduces]
    return wraps


def wrap(model: nn.Module, wraps: list[Wrap]) -> None:
    """Make the class changes :func:`shard_tensor` and :func:`shard_vocab` returned."""
    for path, change in wraps:
        change(_module(model, path))


def _vocab_paths(vocab: Vocab) -> tuple[str, ...]:
    return (*vocab.embeddings, *((vocab.head,) if vocab.head else ()))


def _module(model: nn.Module, path: str) -> nn.Module:
    found = dict(model.named_modules()).get(path)
    if found is None:
        raise PlanFault(
            f"the parallel plan names {path!r}, which the built model does not have",
            fix=PLAN_FAULT_FIX,
        )
    return found


def shard_vocab(model: nn.Module, vocab: Vocab, group: Any, reader: SliceReader) -> list[Wrap]:
    """Give every vocabulary table and the head this rank's block of rows."""
    rank, size = group.rank(), group.size()
    wraps: list[Wrap] = []
    for path in _vocab_paths(vocab):
        module = _module(model, path)
        if not isinstance(module.get("weight"), mx.array):
            raise PlanFault(
                f"the parallel plan splits {path!r} by vocabulary, but the built "
                f"{type(module).__name__} has no weight table",
                fix=PLAN_FAULT_FIX,
            )
        rows = module["weight"].shape[0]
        block = -(-rows // size)
        start, stop = rank * block, min(rows, (rank + 1) * block)
        # Every array of a table or head (weight, scales, biases, bias) is indexed
        # by vocabulary row on its first axis.
        for name, value in list(module.items()):
            if isinstance(value, mx.array):
                setattr(module, name, reader.take(f"{path}.{name}", value, 0, [(start, stop)]))
        change = vocab_head if path == vocab.head else vocab_rows
        wraps.append((path, partial(change, group=group, start=start, block=block, total=rows)))
    return wraps

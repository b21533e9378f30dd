"""Adapter tensor names versus the graph's module paths.

An adapter names tensors by the module tree of the engine that trained it
(``model.layers.0.self_attn.q_proj.lora_a`` for mlx-lm's Llama). A family's
graph here uses the same names wherever it can, but a wrapper layout may nest
them differently: mlx-lm keeps Qwen3.5 under ``language_model.``, our graph
does not. Rather than have each family translate, one prefix rewrite is
inferred per adapter file:

* if every module the file names exists in the graph, names are used as-is;
* otherwise the rewrite ``trainer_prefix -> graph_prefix`` is sought that maps
  *every* named module onto an existing one, with ``trainer_prefix`` a leading
  part shared by all the file's names and ``graph_prefix`` a leading part of
  the graph's decoder-layer path. Exactly one such rewrite: used. None: names
  are used as-is and every tensor that does not fit is refused by name.
  Several: refused as ambiguous.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mlx_loom.errors import AdapterError

__all__ = ["NameMap", "infer_name_map"]


@dataclass(frozen=True)
class NameMap:
    """``trainer`` prefix in the adapter's names <-> ``graph`` prefix in the module tree."""

    trainer: str = ""
    graph: str = ""

    @property
    def is_identity(self) -> bool:
        return self.trainer == self.graph

    def to_graph(self, name: str) -> str:
        if self.trainer and name.startswith(self.trainer):
            return self.graph + name[len(self.trainer) :]
        if not self.trainer:
            return self.graph + name
        return name

    def to_trainer(self, path: str) -> str:
        if self.graph and path.startswith(self.graph):
            return self.trainer + path[len(self.graph) :]
        if not self.graph:
            return self.trainer + path
        return path


def _prefixes(parts: list[str]) -> list[str]:
    return ["".join(p + "." for p in parts[:k]) for k in range(len(parts) + 1)]


def _canonical(trainer: str, graph: str) -> NameMap:
    """Drop a common tail (``a.model.`` -> ``model.`` is ``a.`` -> ``""``)."""
    t, g = trainer.split(".")[:-1], graph.split(".")[:-1]
    while t and g and t[-1] == g[-1]:
        t, g = t[:-1], g[:-1]
    return NameMap("".join(p + "." for p in t), "".join(p + "." for p in g))


def infer_name_map(
    module_names: Iterable[str], graph_modules: set[str], layers_path: str
) -> NameMap:
    """The one prefix rewrite that places every module the adapter names (see module doc)."""
    names = sorted(set(module_names))
    if not names or all(n in graph_modules for n in names):
        return NameMap()
    split = [n.split(".") for n in names]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    common = common[: min(len(s) for s in split) - 1]  # keep at least the leaf module
    found: set[NameMap] = set()
    for trainer in _prefixes(common):
        for graph in _prefixes(layers_path.split(".")[:-1]):
            rewrite = NameMap(trainer, graph)
            if all(rewrite.to_graph(n) in graph_modules for n in names):
                found.add(_canonical(trainer, graph))
    found.discard(NameMap())
    if len(found) > 1:
        shown = ", ".join(f"{m.trainer or '<none>'} -> {m.graph or '<none>'}" for m in found)
        raise AdapterError(
            f"the adapter's tensor names fit this model under several prefix rewrites ({shown})",
            fix="rename the adapter's tensors to the model's module paths",
        )
    return found.pop() if found else NameMap()

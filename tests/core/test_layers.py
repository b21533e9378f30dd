"""The core's layers: every module imports only from its own layer and the layers below.

``LAYERS`` is the one place the layers are written down (``docs/architecture.md``
shows the same table). A module belongs to the longest entry that names it or a
package above it. Imports are read from the source with ``ast``: a module-level
import (also inside ``if``/``try`` at the top level, never under
``TYPE_CHECKING``) is an edge, and importing ``mlx_loom.a.b`` also runs
``mlx_loom.a``, so that is an edge too. The rules:

* every edge goes to the same layer or one below;
* the core's top-level subpackages and modules import each other without a
  cycle, and so do the entries of the table;
* an import inside a function is allowed only where it buys something (start-up
  time, an optional dependency, an upper layer reached at run time) and says why
  in a comment on its line or the line above; there are at most
  ``MAX_FUNCTION_LEVEL_IMPORTS`` of them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import mlx_loom

ROOT = Path(mlx_loom.__file__).parent
PACKAGE = "mlx_loom"

#: Bottom to top. An entry is a module or package under ``mlx_loom``; ``mlx_loom``
#: itself is the package's own ``__init__`` (which imports leaves only, the rest lazily).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "leaves",
        (
            "mlx_loom",
            "mlx_loom.errors",
            "mlx_loom.bounded_json",
            "mlx_loom.assets",
            "mlx_loom.capabilities",
            "mlx_loom.field_checks",
            "mlx_loom.backends",
            "mlx_loom.causal_lm",
            "mlx_loom.forward_hooks",
            "mlx_loom.streams",
            "mlx_loom.device",
        ),
    ),
    ("data", ("mlx_loom.artifacts", "mlx_loom.text")),
    ("shared", ("mlx_loom.cache", "mlx_loom.nn", "mlx_loom.parallel")),
    ("kernels", ("mlx_loom.cpu",)),
    ("host", ("mlx_loom.host",)),
    ("author API", ("mlx_loom.plugin",)),
    (
        "building",
        (
            "mlx_loom.parallel.build",
            "mlx_loom.parallel.tensor",
            "mlx_loom.parallel.layers",
            "mlx_loom.parallel.reading",
            "mlx_loom.model",
            "mlx_loom.adapters",
            "mlx_loom.loader",
        ),
    ),
    ("engine", ("mlx_loom.engine",)),
    (
        "clients",
        (
            "mlx_loom.generation",
            "mlx_loom.serve",
            "mlx_loom.cli",
            "mlx_loom.convert",
            "mlx_loom.testing",
        ),
    ),
)

MAX_FUNCTION_LEVEL_IMPORTS = 30

Edges = Mapping[str, Iterable[str]]


def _entries() -> dict[str, int]:
    return {entry: rank for rank, (_, entries) in enumerate(LAYERS) for entry in entries}


def entry_of(module: str) -> str | None:
    """The table entry ``module`` belongs to (the longest that names it or a package above)."""
    entries = _entries()
    if module == PACKAGE:
        return PACKAGE
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        candidate = ".".join(parts[:n])
        if candidate in entries:
            return candidate
    return None


def rank_of(module: str) -> int:
    entry = entry_of(module)
    assert entry is not None, f"{module} has no layer: add it to LAYERS"
    return _entries()[entry]


# --- reading the source ---------------------------------------------------------


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level(body: list[ast.stmt]) -> Iterable[ast.Import | ast.ImportFrom]:
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _module_level(block)
            for handler in node.handlers:
                yield from _module_level(handler.body)
        elif isinstance(node, ast.With | ast.ClassDef):
            yield from _module_level(node.body)


def _in_functions(tree: ast.Module) -> Iterable[ast.Import | ast.ImportFrom]:
    seen: set[int] = set()
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(func):
                if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in seen:
                    seen.add(id(node))
                    yield node


def _targets(
    module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: Mapping[str, Path]
) -> set[str]:
    """The core's modules ``node`` imports, with the packages importing them runs."""
    named: list[str] = []
    if isinstance(node, ast.Import):
        named = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            origin = ".".join([*base, node.module] if node.module else base)
        else:
            origin = node.module or ""
        named = [origin]
        named += [f"{origin}.{a.name}" for a in node.names if f"{origin}.{a.name}" in known]
    found = set()
    for name in named:
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            continue
        parts = name.split(".")
        for n in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
            found.add(".".join(parts[:n]))
    return {name for name in found if name in known}


def import_edges(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    known = modules(root, package)
    edges: dict[str, set[str]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        edges[module] = set()
        for node in _module_level(tree.body):
            edges[module] |= _targets(module, is_package, node, known) - {module}
    return edges


def function_level_imports(root: Path = ROOT) -> list[tuple[Path, int, bool]]:
    """Every import inside a function: (file, line, whether a comment says why)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in _in_functions(ast.parse("\n".join(lines))):
            own = lines[node.lineno - 1 : (node.end_lineno or node.lineno)]
            above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            said = any("#" in line for line in own) or above.startswith("#")
            found.append((path, node.lineno, said))
    return found


# --- the rules, as functions of an edge table (so they can be tested themselves) --


def upward(edges: Edges) -> list[str]:
    """Edges from a layer to one above it."""
    names = [name for name, _ in LAYERS]
    return sorted(
        f"{a} ({names[rank_of(a)]}) imports {b} ({names[rank_of(b)]})"
        for a, targets in edges.items()
        for b in targets
        if rank_of(b) > rank_of(a)
    )


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def collapsed(edges: Edges, key) -> dict[str, set[str]]:
    """``edges`` between the groups ``key`` puts modules in (edges inside a group dropped)."""
    graph: dict[str, set[str]] = {}
    for a, targets in edges.items():
        for b in targets:
            ka, kb = key(a), key(b)
            if ka != kb:
                graph.setdefault(ka, set()).add(kb)
    return graph


def subpackage(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


# --- the core as it is --------------------------------------------------------------


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    return import_edges()


def test_every_module_of_the_core_has_a_layer(edges):
    assert [m for m in edges if entry_of(m) is None] == []


def test_every_entry_of_the_table_names_a_module_of_the_core(edges):
    assert [entry for entry in _entries() if entry not in edges] == []


def test_imports_go_to_the_same_layer_or_below(edges):
    assert upward(edges) == []


def test_no_cycle_between_the_subpackages_of_the_core(edges):
    assert cycles(collapsed(edges, subpackage)) == []


def test_no_cycle_between_the_entries_of_the_table(edges):
    assert cycles(collapsed(edges, entry_of)) == []


def test_imports_inside_functions_are_few_and_each_says_why():
    found = function_level_imports()
    silent = [f"{path.relative_to(ROOT.parent)}:{line}" for path, line, said in found if not said]
    assert silent == [], "an import inside a function needs a comment saying why"
    assert len(found) <= MAX_FUNCTION_LEVEL_IMPORTS, [
        f"{path.relative_to(ROOT.parent)}:{line}" for path, line, _ in found
    ]


def test_the_shared_layers_load_nothing_above_them():
    import subprocess
    import sys

    above = ("host", "engine", "serve", "cli", "generation", "adapters", "plugin", "model", "cpu")
    for shared in ("mlx_loom.cache", "mlx_loom.nn"):
        loaded = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import sys, {shared}; print(' '.join(m for m in sys.modules "
                "if m.startswith('mlx_loom.')))",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert [m for m in loaded if m.split(".")[1] in above] == [], shared


# --- the rules catch what they are for --------------------------------------------------


def test_an_upward_import_is_caught():
    made_up = {"mlx_loom.cache.kv": {"mlx_loom.engine.core"}, "mlx_loom.engine.core": set()}
    assert upward(made_up) == ["mlx_loom.cache.kv (shared) imports mlx_loom.engine.core (engine)"]


def test_a_cycle_between_subpackages_is_caught_even_within_one_layer():
    made_up = {
        "mlx_loom.cache.kv": {"mlx_loom.nn.rope"},
        "mlx_loom.nn.rope": {"mlx_loom.cache.views"},
        "mlx_loom.cache.views": set(),
    }
    assert upward(made_up) == []  # cache and nn share a layer
    assert cycles(collapsed(made_up, subpackage)) == [["mlx_loom.cache", "mlx_loom.nn"]]


def test_the_source_reader_sees_module_level_imports_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "mlx_loom"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "core.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from .. import errors\n"
        "if TYPE_CHECKING:\n"
        "    from mlx_loom.cache import kv\n"
        "def later():\n"
        "    import mlx_loom.cache  # what for\n"
    )
    found = import_edges(pkg)
    assert found["mlx_loom.engine.core"] == {"mlx_loom", "mlx_loom.errors"}
    assert function_level_imports(pkg) == [(pkg / "engine" / "core.py", 6, True)]

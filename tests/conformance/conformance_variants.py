"""A real small family (the ``loom plugins new`` template, rendered as ``kitlm``) and
controlled ways to break it, so each conformance check can be shown to catch its fault.

``Variant`` wraps the rendered plugin module and changes one thing: a
model-type field, the factory, the capabilities, the caches the graph makes.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_loom.artifacts import load_weights
from mlx_loom.cache import KVCache
from mlx_loom.cli.plugins_new import write_plugin_package
from mlx_loom.plugin import BuildContext, Kernel, hookimpl

NAME = "kitlm"


def render_and_import(root: Path) -> Any:
    """Render the template as plugin ``kitlm`` under ``root`` and import its plugin module."""
    package = root / "mlx-loom-kitlm"
    if not package.exists():
        write_plugin_package(NAME, package)
    src = str(package / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return importlib.import_module(f"mlx_loom_{NAME}.plugin")


class Variant:
    """The rendered plugin with one registration changed.

    It registers what the template's ``FAMILY`` derives, through the four
    record-by-record hooks, so each registration can be altered on its own.
    """

    def __init__(
        self,
        base: Any,
        *,
        model_type: dict[str, Any] | None = None,
        factory: Callable[[Callable[[BuildContext], Any]], Callable[[BuildContext], Any]]
        | None = None,
        capabilities: frozenset[str] | None = None,
        kernels: tuple[str, ...] = (),
    ) -> None:
        self.base = base
        self.model_type_changes = model_type or {}
        self.factory = factory
        self.capabilities = capabilities
        self.kernel_names = kernels

    @hookimpl
    def loom_plugin_api_version(self) -> str:
        return self.base.loom_plugin_api_version()

    @property
    def derived(self):
        return self.base.FAMILY.registrations()

    @hookimpl
    def loom_model_types(self):
        return [dataclasses.replace(m, **self.model_type_changes) for m in self.derived.model_types]

    @hookimpl
    def loom_kernels(self):
        return [Kernel(k, "cpu", fn=lambda x: x) for k in self.kernel_names]

    @hookimpl
    def loom_implementations(self):
        out = []
        for impl in self.derived.implementations:
            changes: dict[str, Any] = {"kernels": self.kernel_names}
            if self.factory is not None:
                changes["factory"] = self.factory(impl.factory)
            if self.capabilities is not None:
                changes["capabilities"] = self.capabilities
            out.append(dataclasses.replace(impl, **changes))
        return out

    @hookimpl
    def loom_profiles(self):
        if self.capabilities is None:
            return list(self.derived.profiles)
        return [
            p.model_copy(update={"capabilities": self.capabilities}) for p in self.derived.profiles
        ]


# --- faults ------------------------------------------------------------------


def lenient_loader(build: Callable[[BuildContext], Any]) -> Callable[[BuildContext], Any]:
    """Loads whatever matches the graph and silently ignores the rest."""

    def factory(ctx: BuildContext) -> Any:
        model = _graph().Model(ctx.family_config)
        wanted = {k for k, _ in tree_flatten(model.parameters())}
        weights = {k: v for k, v in load_weights(ctx.model_dir).items() if k in wanted}
        model.load_weights(list(weights.items()), strict=False)
        return model

    return factory


def forgets_a_tensor(build: Callable[[BuildContext], Any]) -> Callable[[BuildContext], Any]:
    """Leaves the final norm at its initial value."""

    def factory(ctx: BuildContext) -> Any:
        model = _graph().Model(ctx.family_config)
        weights = load_weights(ctx.model_dir)
        weights.pop("model.norm.weight")
        model.load_weights(list(weights.items()), strict=False)
        return model

    return factory


Factory = Callable[[BuildContext], Any]


def with_caches(kind: type) -> Callable[[Factory], Factory]:
    """The graph's make_cache returns ``kind`` instead of KVCache."""

    def wrap(build: Callable[[BuildContext], Any]) -> Callable[[BuildContext], Any]:
        def factory(ctx: BuildContext) -> Any:
            model = build(ctx)
            n = len(model.make_cache())
            model.make_cache = lambda: [kind() for _ in range(n)]
            return model

        return factory

    return wrap


def noisy_logits(build: Callable[[BuildContext], Any]) -> Callable[[BuildContext], Any]:
    """Adds fresh random noise to every forward: not deterministic."""

    def factory(ctx: BuildContext) -> Any:
        model = build(ctx)
        inner = type(model).__call__

        class Noisy(type(model)):
            def __call__(self, inputs, cache=None):
                out = inner(self, inputs, cache)
                return out + mx.random.normal(out.shape) * 0.5

        model.__class__ = Noisy
        return model

    return factory


class NoMergeKVCache(KVCache):
    """A KV cache whose batch rows cannot be merged."""

    merge = None


class LyingTrimKVCache(KVCache):
    """Claims to trim but keeps every token."""

    def trim(self, n: int) -> int:
        return n


def _graph() -> Any:
    return importlib.import_module(f"mlx_loom_{NAME}.graph")

"""A toy model family used by the core's tests: tiny, explicit, no attention.

``ToyPlugin`` is an in-process plugin whose every registration can be varied
by a test (model type, implementation id, kernels and their backends, API
version, profiles), so each rule of the plugin host, registry and profiles
can be exercised in isolation. ``PLUGIN_SOURCE`` is the same family as an
installable package, for tests that discover plugins through real entry
points.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from pydantic import BaseModel

from mlx_loom.artifacts import load_weights
from mlx_loom.plugin import (
    PLUGIN_API_VERSION,
    BuildContext,
    Execution,
    Implementation,
    Kernel,
    ModelType,
    Profile,
    hookimpl,
)

#: The toy graph's id is its default implementation's id (the selection rule: a
#: family profile selects the implementation whose id is its graph).
GRAPH, LOADER = "toy.lm.v1", "toy-loader"


class ToyConfig(BaseModel):
    model_type: str
    vocab_size: int
    hidden_size: int


class ToyLM(nn.Module):
    """Embedding -> tanh -> linear head; each position sees only its own token."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        return self.head(mx.tanh(self.embed(inputs)))

    def make_cache(self) -> list:
        return []


def build_toy(ctx: BuildContext) -> ToyLM:
    cfg = ctx.family_config
    model = ToyLM(cfg.vocab_size, cfg.hidden_size)
    model.load_weights(list(load_weights(ctx.model_dir).items()))
    return model


def write_toy_checkpoint(
    path: Path, *, model_type: str = "toy_lm", vocab: int = 32, hidden: int = 8, seed: int = 0
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": model_type, "vocab_size": vocab, "hidden_size": hidden}
    (path / "config.json").write_text(json.dumps(config))
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    weights = {
        "embed.weight": mx.random.normal((vocab, hidden), key=k1),
        "head.weight": mx.random.normal((vocab, hidden), key=k2),
    }
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def family_profile(model_type: str = "toy_lm", **changes) -> Profile:
    fields = dict(
        id=f"toy/{model_type}",
        model_types=frozenset({model_type}),
        execution=Execution(graph=GRAPH, loader=LOADER),
        capabilities=frozenset({"generate"}),
    )
    fields.update(changes)
    return Profile(**fields)


class ToyPlugin:
    """An in-process plugin; pass it to ``PluginHost(plugins=[(name, ToyPlugin(...))])``."""

    def __init__(
        self,
        *,
        model_type: str = "toy_lm",
        impl_id: str = "toy.lm.v1",
        kernels: Sequence[str] = (),
        kernel_backends: Sequence[str] = ("cpu",),
        api_version: str = PLUGIN_API_VERSION,
        profiles: Sequence[Profile] | None = None,
        capabilities: Sequence[str] = ("generate",),
        factory=build_toy,
    ) -> None:
        self.model_type = model_type
        self.impl_id = impl_id
        self.kernel_names = tuple(kernels)
        self.kernel_backends = tuple(kernel_backends)
        self.api_version = api_version
        self.profile_list = (
            list(profiles)
            if profiles is not None
            else [family_profile(model_type, execution=Execution(graph=impl_id, loader=LOADER))]
        )
        self.capabilities = frozenset(capabilities)
        self.factory = factory

    @hookimpl
    def loom_plugin_api_version(self) -> str:
        return self.api_version

    @hookimpl
    def loom_model_types(self) -> list[ModelType]:
        return [ModelType(self.model_type, ToyConfig, ("vocab_size", "hidden_size"))]

    @hookimpl
    def loom_kernels(self) -> list[Kernel]:
        return [
            Kernel(name, backend, fn=lambda x: x)
            for name in self.kernel_names
            for backend in self.kernel_backends
        ]

    @hookimpl
    def loom_implementations(self) -> list[Implementation]:
        return [
            Implementation(
                id=self.impl_id,
                graph=self.impl_id,
                loader=LOADER,
                model_types=frozenset({self.model_type}),
                factory=self.factory,
                kernels=self.kernel_names,
                capabilities=self.capabilities,
            )
        ]

    @hookimpl
    def loom_profiles(self) -> list[Profile]:
        return self.profile_list


#: An installable toy family written with the four registration hooks of the
#: author API (plugin API 1.1): its implementation's id is its graph's id.
PLUGIN_SOURCE = '''
"""An installable toy family plugin, written by the core's tests against plugin API 1.1."""
from mlx_loom.plugin import Execution, Implementation, ModelType, Profile, hookimpl

{extra}

@hookimpl
def loom_plugin_api_version():
    return "{api_version}"


@hookimpl
def loom_model_types():
    from toyfamily_support import ToyConfig
    return [ModelType("{model_type}", ToyConfig, ("vocab_size", "hidden_size"))]


@hookimpl
def loom_implementations():
    from toyfamily_support import build_toy
    return [Implementation(id="{name}.lm", graph="{name}.lm", loader="{name}-loader",
                           model_types=frozenset({{"{model_type}"}}), factory=build_toy,
                           capabilities=frozenset({{"generate"}}))]


@hookimpl
def loom_profiles():
    return [Profile(id="{name}/family", model_types=frozenset({{"{model_type}"}}),
                    execution=Execution(graph="{name}.lm", loader="{name}-loader"),
                    capabilities=frozenset({{"generate"}}))]
'''

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "{version}"
dependencies = []

[project.entry-points.mlx_loom]
{name} = "{module}"

[tool.setuptools]
py-modules = ["{module}", "toyfamily_support"]
"""

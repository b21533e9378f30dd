"""An implementation-only plugin: a tuned implementation of minicpm5's graph for one artifact.

It claims no model type and no family profile; it registers one
implementation of graph ``minicpm5.llama`` and one exact-artifact profile
naming it. ``SOURCE`` is the plugin module (fingerprints filled in by the
test), ``PYPROJECT`` its packaging, so tests can install it for real or hand
it in as a module.
"""

from __future__ import annotations

import types

NAME = "tuned"
IMPLEMENTATION = "tuned.llama"
PROFILE = "tuned/artifact"

SOURCE = '''
"""A tuned implementation of minicpm5's Llama graph for one exact artifact."""

from mlx_loom.plugin import (
    GENERATE,
    PLUGIN_API_VERSION,
    Execution,
    Implementation,
    Profile,
    hookimpl,
)

GRAPH, LOADER = "minicpm5.llama", "minicpm5.hf-safetensors"


def build(ctx):
    from mlx_loom_minicpm5.loader import build as family_build

    model = family_build(ctx)
    model.tuned_for = ctx.profile.id
    return model


@hookimpl
def loom_plugin_api_version():
    return PLUGIN_API_VERSION


@hookimpl
def loom_implementations():
    return [
        Implementation(
            id="{implementation}",
            graph=GRAPH,
            loader=LOADER,
            model_types=frozenset({{"llama"}}),
            factory=build,
            capabilities=frozenset({{GENERATE}}),
            description="minicpm5's Llama graph, tuned for one artifact",
        )
    ]


@hookimpl
def loom_profiles():
    return [
        Profile(
            id="{profile}",
            model_types=frozenset({{"llama"}}),
            execution=Execution(
                graph=GRAPH,
                loader=LOADER,
                specialization="artifact",
                implementation="{implementation}",
            ),
            artifact_fingerprint="{artifact}",
            config_fingerprint="{config}",
            capabilities=frozenset({{GENERATE}}),
        )
    ]
'''

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "loom-tuned-llama"
version = "0.2.0"
dependencies = []

[project.entry-points.mlx_loom]
tuned = "loom_tuned_llama"

[tool.setuptools]
py-modules = ["loom_tuned_llama"]
"""


def source(*, artifact: str, config: str) -> str:
    return SOURCE.format(
        implementation=IMPLEMENTATION, profile=PROFILE, artifact=artifact, config=config
    )


def module(*, artifact: str = "sha256:tuned-artifact", config: str = "sha256:tuned-config"):
    """The plugin as an in-process module (nothing installed)."""
    mod = types.ModuleType("loom_tuned_llama")
    exec(
        compile(source(artifact=artifact, config=config), "loom_tuned_llama.py", "exec"), vars(mod)
    )
    return mod

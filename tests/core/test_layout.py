"""The public surfaces: what users, embedding hosts and family authors import, and from where."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import mlx_loom
import mlx_loom.host
import mlx_loom.plugin

REPO = Path(__file__).resolve().parents[2]

#: The plugin-API 1.0 module paths, removed: nothing in the core or the families used them.
REMOVED_PATHS = (
    "mlx_loom.hookspecs",
    "mlx_loom.registry",
    "mlx_loom.profiles",
    "mlx_loom.kernels",
    "mlx_loom.plugins",
    "mlx_loom.resolution",
    "mlx_loom.loading",
)


@pytest.mark.parametrize("path", REMOVED_PATHS)
def test_the_plugin_api_1_0_module_paths_are_gone(path):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(path)


def test_the_author_api_and_the_host_export_the_very_same_objects():
    assert mlx_loom.plugin.hookimpl is mlx_loom.host.hookimpl
    assert (mlx_loom.plugin.Implementation, mlx_loom.plugin.Profile, mlx_loom.plugin.Kernel) == (
        mlx_loom.host.Implementation,
        mlx_loom.host.Profile,
        mlx_loom.host.Kernel,
    )


def test_the_function_generate_is_never_shadowed_by_a_package():
    import mlx_loom.generation  # noqa: F401  (loading the client package sets no 'generate')

    assert callable(mlx_loom.generate) and not isinstance(mlx_loom.generate, type(mlx_loom))


def test_the_user_api_exports_what_a_user_needs_and_the_composition_names():
    for name in (
        "load",
        "generate",
        "stream_generate",
        "batch_generate",
        "PromptCache",
        "SamplingParams",
        "Model",
        "Tokenizer",
        "errors",
        "PluginHost",
        "PluginPolicy",
        "Registry",
        "default_host",
        "resolve_model",
    ):
        assert name in mlx_loom.__all__ and hasattr(mlx_loom, name), name
    assert "hookimpl" not in mlx_loom.__all__ and "Implementation" not in mlx_loom.__all__


def test_the_author_api_exports_what_a_family_author_needs():
    for name in (
        "hookimpl",
        "PLUGIN_API_VERSION",
        "Family",
        "Graph",
        "ModelType",
        "Implementation",
        "Profile",
        "Execution",
        "Kernel",
        "BuildContext",
        "CausalLM",
        "GENERATE",
        "ConfigError",
        "WeightsError",
    ):
        assert name in mlx_loom.plugin.__all__ and hasattr(mlx_loom.plugin, name), name


def test_the_host_is_one_package_of_private_modules():
    modules = sorted(p.stem for p in Path(mlx_loom.host.__file__).parent.glob("*.py"))
    assert modules[0] == "__init__"
    assert all(m.startswith("_") for m in modules)


@pytest.mark.parametrize("family", ["minicpm5", "qwen3_next", "gemma4"])
def test_a_family_plugin_module_imports_only_the_author_api_from_the_core(family):
    (source,) = (REPO / "plugins" / family / "src").glob("*/plugin.py")
    core_imports = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            core_imports.add(node.module)
        elif isinstance(node, ast.Import):
            core_imports.update(alias.name for alias in node.names)
    from_core = {m for m in core_imports if m == "mlx_loom" or m.startswith("mlx_loom.")}
    assert from_core <= {"mlx_loom.plugin", "mlx_loom.cache", "mlx_loom.nn"}, from_core

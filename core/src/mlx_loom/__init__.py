"""mlx-loom: LLM inference on MLX with model families as separately installed plugins.

The user API::

    import mlx_loom
    model, tokenizer = mlx_loom.load("path/or/org-repo")   # or "tiny", the bundled model
    print(mlx_loom.generate(model, tokenizer, "Hello", max_tokens=64))

Every generation runs on the model's continuous-batching engine
(``model.engine``; :mod:`mlx_loom.engine`), so the API may be called from
several threads at once: their requests are batched together.

``mlx_loom.BUNDLED_MODEL`` is the bundled tiny model's directory.

An application that embeds the engine and chooses its composition uses
:class:`PluginHost`, :class:`PluginPolicy` and :class:`Registry` (more in
:mod:`mlx_loom.host`). Family authors import from :mod:`mlx_loom.plugin`.
A host that uses several models keeps them in a :class:`ModelPool` (of
:meth:`PooledModel.from_ref` models, each loaded with the plugin policy the
host chose for it), which loads and unloads them under its bounds.
Every error is in :mod:`mlx_loom.errors`.

The names below are imported on first use (PEP 562): importing the package,
or a light submodule such as the CLI's argument parser, does not pull in
MLX, pydantic models, the tokenizer or the Hub client until something needs
them, so ``loom --help`` stays a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from .assets import BUNDLED_MODEL
from .errors import LoomError, Refusal

#: public name -> the submodule that defines it
_LAZY = {
    "BatchResponse": "generation",
    "BatchResult": "generation",
    "GenerationResponse": "generation",
    "PromptCache": "generation",
    "SamplingParams": "generation",
    "batch_generate": "generation",
    "generate": "generation",
    "stream_generate": "generation",
    "PluginHost": "host",
    "PluginPolicy": "host",
    "Registry": "host",
    "default_host": "host",
    "load": "loader",
    "resolve_model": "host",
    "Model": "model",
    "Tokenizer": "text",
    "Engine": "engine",
    "EngineSettings": "engine",
    "make_request": "engine",
    "ModelPool": "engine.pool",
    "PooledModel": "engine.pool",
}

__all__ = ["BUNDLED_MODEL", "LoomError", "Refusal", "__version__", "errors", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        # only for __version__: keeps `import mlx_loom` light
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("mlx-loom")
        except PackageNotFoundError:  # running from a source tree without installing
            value = "0.0.0+unknown"
    elif name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # the same names, for type checkers and editors
    from .engine import Engine, EngineSettings, make_request  # noqa: F401
    from .engine.pool import ModelPool, PooledModel  # noqa: F401
    from .generation import (  # noqa: F401
        BatchResponse,
        BatchResult,
        GenerationResponse,
        PromptCache,
        SamplingParams,
        batch_generate,
        generate,
        stream_generate,
    )
    from .host import PluginHost, PluginPolicy, Registry, default_host, resolve_model  # noqa: F401
    from .loader import load  # noqa: F401
    from .model import Model  # noqa: F401
    from .text import Tokenizer  # noqa: F401

"""mlx-loom: LLM inference on MLX with model families as separately installed plugins.

The public API::

    import mlx_loom
    model, tokenizer = mlx_loom.load("path/or/org-repo")
    print(mlx_loom.generate(model, tokenizer, "Hello", max_tokens=64))

Plugin authors import from :mod:`mlx_loom.hookspecs` (``hookimpl``),
:mod:`mlx_loom.registry`, :mod:`mlx_loom.profiles`, :mod:`mlx_loom.kernels`
and :mod:`mlx_loom.cache`.

The names below are imported on first use (PEP 562): importing the package,
or any light submodule such as the CLI's argument parser, does not pull in
MLX, pydantic models, the tokenizer or the Hub client until something needs
them. ``loom --help`` stays a fraction of a second that way.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from .errors import LoomError, Refusal

#: public name -> the submodule that defines it
_LAZY = {
    "BatchResult": "generate",
    "GenerationResponse": "generate",
    "PromptCache": "generate",
    "SamplingParams": "generate",
    "batch_generate": "generate",
    "generate": "generate",
    "stream_generate": "generate",
    "Kernel": "kernels",
    "default_host": "loading",
    "load": "loading",
    "resolve_model": "loading",
    "Model": "model",
    "PluginHost": "plugins",
    "PluginPolicy": "plugins",
    "Execution": "profiles",
    "Profile": "profiles",
    "Implementation": "registry",
    "ModelType": "registry",
    "Registry": "registry",
}

__all__ = ["LoomError", "Refusal", "__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name == "__version__":
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


class _Package(types.ModuleType):
    """Keeps ``mlx_loom.generate`` the function when the submodule of that name loads.

    Loading a submodule sets it as an attribute of its package; with eager
    imports the function then overwrote it again. Lazily, the submodule may
    load at any time, so the package declines to let it shadow the function
    (the submodule stays importable: ``from mlx_loom.generate import ...``).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "generate" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:  # the same names, for type checkers and editors
    from .generate import (  # noqa: F401
        BatchResult,
        GenerationResponse,
        PromptCache,
        SamplingParams,
        batch_generate,
        generate,
        stream_generate,
    )
    from .kernels import Kernel  # noqa: F401
    from .loading import default_host, load, resolve_model  # noqa: F401
    from .model import Model  # noqa: F401
    from .plugins import PluginHost, PluginPolicy  # noqa: F401
    from .profiles import Execution, Profile  # noqa: F401
    from .registry import Implementation, ModelType, Registry  # noqa: F401

"""mlx-loom: LLM inference on MLX with model families as separately installed plugins.

The user API::

    import mlx_loom
    model, tokenizer = mlx_loom.load("path/or/org-repo")   # or "tiny", the bundled model
    print(mlx_loom.generate(model, tokenizer, "Hello", max_tokens=64))

``mlx_loom.BUNDLED_MODEL`` is the bundled tiny model's directory.

An application that embeds the engine and chooses its composition uses
:class:`PluginHost`, :class:`PluginPolicy` and :class:`Registry` (more in
:mod:`mlx_loom.host`). Family authors import from :mod:`mlx_loom.plugin`.
Every error is in :mod:`mlx_loom.errors`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mlx-loom")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"

from . import errors  # noqa: E402
from .assets import BUNDLED_MODEL  # noqa: E402
from .errors import LoomError, Refusal  # noqa: E402
from .generate import (  # noqa: E402
    BatchResult,
    GenerationResponse,
    PromptCache,
    SamplingParams,
    batch_generate,
    generate,
    stream_generate,
)
from .host import (  # noqa: E402
    PluginHost,
    PluginPolicy,
    Registry,
    default_host,
    load,
    resolve_model,
)
from .model import Model  # noqa: E402
from .text import Tokenizer  # noqa: E402

__all__ = [
    "BUNDLED_MODEL",
    "BatchResult",
    "GenerationResponse",
    "LoomError",
    "Model",
    "PluginHost",
    "PluginPolicy",
    "PromptCache",
    "Refusal",
    "Registry",
    "SamplingParams",
    "Tokenizer",
    "__version__",
    "batch_generate",
    "default_host",
    "errors",
    "generate",
    "load",
    "resolve_model",
    "stream_generate",
]

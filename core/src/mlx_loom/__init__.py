"""mlx-loom: LLM inference on MLX with model families as separately installed plugins.

The public API::

    import mlx_loom
    model, tokenizer = mlx_loom.load("path/or/org-repo")   # or "tiny", the bundled model
    print(mlx_loom.generate(model, tokenizer, "Hello", max_tokens=64))

``mlx_loom.BUNDLED_MODEL`` is the bundled tiny model's directory.

Plugin authors import from :mod:`mlx_loom.hookspecs` (``hookimpl``),
:mod:`mlx_loom.registry`, :mod:`mlx_loom.profiles`, :mod:`mlx_loom.kernels`
and :mod:`mlx_loom.cache`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mlx-loom")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"

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
from .kernels import Kernel  # noqa: E402
from .loading import default_host, load, resolve_model  # noqa: E402
from .model import Model  # noqa: E402
from .plugins import PluginHost, PluginPolicy  # noqa: E402
from .profiles import Execution, Profile  # noqa: E402
from .registry import Implementation, ModelType, Registry  # noqa: E402

__all__ = [
    "BUNDLED_MODEL",
    "BatchResult",
    "Execution",
    "GenerationResponse",
    "Implementation",
    "Kernel",
    "LoomError",
    "Model",
    "ModelType",
    "PluginHost",
    "PluginPolicy",
    "Profile",
    "PromptCache",
    "Refusal",
    "Registry",
    "SamplingParams",
    "__version__",
    "batch_generate",
    "default_host",
    "generate",
    "load",
    "resolve_model",
    "stream_generate",
]

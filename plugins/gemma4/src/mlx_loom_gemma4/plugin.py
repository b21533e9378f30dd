"""The Gemma 4 plugin's registrations: model types, expert kernel, implementation, profile."""

from __future__ import annotations

from mlx_loom.hookspecs import PLUGIN_API_VERSION, hookimpl
from mlx_loom.kernels import Kernel
from mlx_loom.plugin import ADAPTERS
from mlx_loom.profiles import (
    BATCH,
    GENERATE,
    KV_QUANTIZATION,
    PROMPT_CACHE,
    SPECULATIVE,
    Execution,
    Profile,
)
from mlx_loom.registry import Implementation, ModelType
from mlx_loom_gemma4 import kernels as _kernels
from mlx_loom_gemma4.config import FINGERPRINT_FIELDS, Gemma4TextConfig
from mlx_loom_gemma4.loader import build
from mlx_loom_gemma4.manifest import TINY_TEXT_CONFIG, TINY_WRAPPER_CONFIG, checkpoint_tensors

MODEL_TYPES = frozenset({"gemma4_text", "gemma4"})
GRAPH = "gemma4.text"
LOADER = "gemma4.hf"
IMPLEMENTATION_ID = "gemma4.text.standard"
PROFILE_ID = "gemma4/text"

# Speculative decoding: sliding layers use a rotating cache, whose trim past a
# full window raises CacheNotTrimmable (mlx-lm silently trims nothing there and
# verifies against a wrong window). Refusing is correct behaviour; the loop
# surfaces it. Within the window, and on full-attention layers, trim is exact.
CAPABILITIES = frozenset({GENERATE, BATCH, PROMPT_CACHE, KV_QUANTIZATION, SPECULATIVE, ADAPTERS})


@hookimpl
def loom_plugin_api_version() -> str:
    return PLUGIN_API_VERSION


@hookimpl
def loom_model_types() -> list[ModelType]:
    return [
        ModelType(
            name="gemma4_text",
            schema=Gemma4TextConfig,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Gemma 4 text model (flat config)",
            tiny_config=TINY_TEXT_CONFIG,
            checkpoint_tensors=checkpoint_tensors,
        ),
        ModelType(
            name="gemma4",
            schema=Gemma4TextConfig,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Gemma 4 multimodal checkpoint; text tower only (vision/audio dropped)",
            tiny_config=TINY_WRAPPER_CONFIG,
            checkpoint_tensors=checkpoint_tensors,
        ),
    ]


@hookimpl
def loom_kernels() -> list[Kernel]:
    return _kernels.kernels()


@hookimpl
def loom_implementations() -> list[Implementation]:
    return [
        Implementation(
            id=IMPLEMENTATION_ID,
            graph=GRAPH,
            loader=LOADER,
            model_types=MODEL_TYPES,
            factory=build,
            kernels=(_kernels.SWITCH_GLU,),
            capabilities=CAPABILITIES,
            description="Gemma 4 text: sliding/global attention, KV sharing, per-layer inputs, MoE",
        )
    ]


@hookimpl
def loom_profiles() -> list[Profile]:
    return [
        Profile(
            id=PROFILE_ID,
            model_types=MODEL_TYPES,
            execution=Execution(graph=GRAPH, loader=LOADER),
            capabilities=CAPABILITIES,
            description="Every gemma4_text / gemma4 checkpoint",
        )
    ]

"""Gemma 4 for mlx-loom, declared once: the text model, flat or inside the multimodal wrapper.

The core derives implementation ``gemma4.text`` and family profile
``gemma4/text`` (claiming ``gemma4_text`` and ``gemma4``) from :data:`FAMILY`.
Both model types share one schema: the core hands the family the text view of
a wrapper config (``text_config``), so the family never re-nests it.
"""

from __future__ import annotations

from mlx_loom.plugin import (
    ADAPTERS,
    BATCH,
    GENERATE,
    KV_QUANTIZATION,
    PLUGIN_API_VERSION,
    PROMPT_CACHE,
    SPECULATIVE,
    Family,
    Graph,
    ModelType,
    hookimpl,
)

from . import kernels as _kernels
from .config import FINGERPRINT_FIELDS, Gemma4TextConfig
from .loader import build
from .manifest import TINY_TEXT_CONFIG, TINY_WRAPPER_CONFIG, checkpoint_tensors
from .parallel import plan

# Speculative decoding: sliding layers use a rotating cache, whose trim past a
# full window raises CacheNotTrimmable (mlx-lm silently trims nothing there and
# verifies against a wrong window). Refusing is correct behaviour; the loop
# surfaces it. Within the window, and on full-attention layers, trim is exact.
CAPABILITIES = frozenset({GENERATE, BATCH, PROMPT_CACHE, KV_QUANTIZATION, SPECULATIVE, ADAPTERS})

FAMILY = Family(
    name="gemma4",
    model_types=(
        ModelType(
            name="gemma4_text",
            schema=Gemma4TextConfig,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Gemma 4 text model (flat config)",
            tiny_config=TINY_TEXT_CONFIG,
            tool_parser="gemma4",
        ),
        ModelType(
            name="gemma4",
            schema=Gemma4TextConfig,
            fingerprint_fields=FINGERPRINT_FIELDS,
            description="Gemma 4 multimodal checkpoint; text tower only (vision/audio dropped)",
            tiny_config=TINY_WRAPPER_CONFIG,
            tool_parser="gemma4",
        ),
    ),
    graphs=(
        Graph(
            "gemma4.text",
            factory=build,
            kernels=(_kernels.SWITCH_GLU,),
            parallel=plan,
            description="Gemma 4 text: sliding/global attention, KV sharing, per-layer inputs, MoE",
        ),
    ),
    loader="gemma4.hf",
    capabilities=CAPABILITIES,
    kernels=tuple(_kernels.kernels()),
    checkpoint_tensors=checkpoint_tensors,
)


@hookimpl
def loom_plugin_api_version() -> str:
    return PLUGIN_API_VERSION


@hookimpl
def loom_families() -> list[Family]:
    return [FAMILY]

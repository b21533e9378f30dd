"""The family author's API: everything a model-family plugin imports from the core.

A plugin imports from here, from :mod:`mlx_loom.cache` (cache kinds, masks,
attention) and from :mod:`mlx_loom.nn` (layers families share) — nothing
else in the core is a contract for plugins. A whole plugin module reads::

    from mlx_loom.plugin import (
        BATCH, GENERATE, PLUGIN_API_VERSION, PROMPT_CACHE, Family, Graph, ModelType, hookimpl,
    )

    FAMILY = Family(
        name="mydecoder",
        model_types=(ModelType(name="mydecoder", schema=Config, fingerprint_fields=FIELDS,
                               tiny_config=TINY_CONFIG),),
        graphs=(Graph("mydecoder.decoder", factory=build),),
        loader="mydecoder.hf",
        capabilities=frozenset({GENERATE, BATCH, PROMPT_CACHE}),
        checkpoint_tensors=checkpoint_tensors,
    )

    @hookimpl
    def loom_plugin_api_version() -> str:
        return PLUGIN_API_VERSION

    @hookimpl
    def loom_families() -> list[Family]:
        return [FAMILY]

A family's config schema derives from :class:`FamilyConfig` (the config
dialect: bounded field types, ``derived()`` defaults filled once, cross-field
checks in one ``check`` that raises :class:`FieldError`).

The core derives the implementation (id = graph id) and the family profile
(``"mydecoder/decoder"``) from the declaration. :class:`Implementation` and
exact-artifact :class:`Profile` values tune one published artifact. A plugin
whose models write tool calls in markup the core does not know registers a
:class:`ToolParser` (``loom_tool_parsers``); a :class:`ModelType` names its
format with ``tool_parser``.
"""

from __future__ import annotations

from .artifacts.fields import (
    Count,
    FamilyConfig,
    FieldError,
    FiniteFloat,
    Flag,
    Given,
    LayerCount,
    PositiveFloat,
    Size,
    UnitFloat,
    derived,
)
from .causal_lm import CausalLM, MultiTokenPredictor
from .errors import (
    CacheError,
    CapabilityRefused,
    ConfigError,
    RequestError,
    WeightsError,
)
from .host import (
    ADAPTERS,
    BATCH,
    COMPILED_STEP,
    GENERATE,
    KV_QUANTIZATION,
    PLUGIN_API_VERSION,
    PROMPT_CACHE,
    SPECULATIVE,
    Backend,
    BuildContext,
    Execution,
    Family,
    Graph,
    Implementation,
    Kernel,
    ModelType,
    Profile,
    hookimpl,
)
from .text.tool_calls import MalformedToolCall, ToolCall, ToolParser

__all__ = [
    "ADAPTERS",
    "BATCH",
    "GENERATE",
    "KV_QUANTIZATION",
    "PLUGIN_API_VERSION",
    "PROMPT_CACHE",
    "SPECULATIVE",
    "COMPILED_STEP",
    "Backend",
    "BuildContext",
    "CacheError",
    "CapabilityRefused",
    "CausalLM",
    "ConfigError",
    "Count",
    "Execution",
    "Family",
    "FamilyConfig",
    "FieldError",
    "FiniteFloat",
    "Flag",
    "Given",
    "Graph",
    "Implementation",
    "Kernel",
    "LayerCount",
    "MalformedToolCall",
    "ModelType",
    "MultiTokenPredictor",
    "PositiveFloat",
    "Profile",
    "RequestError",
    "Size",
    "ToolCall",
    "ToolParser",
    "UnitFloat",
    "WeightsError",
    "derived",
    "hookimpl",
]

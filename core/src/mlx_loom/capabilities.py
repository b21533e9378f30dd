"""The capability names the core understands.

A profile and an implementation each declare capabilities; a model has the
ones both declare (:attr:`mlx_loom.model.Model.capabilities`), and a request
that needs one the model lacks is refused. Plugins may declare others; the
core checks these at request time. Their own module, below everything else,
so that the engine, the adapters and the host name them without importing
each other.
"""

from __future__ import annotations

__all__ = [
    "ADAPTERS",
    "BATCH",
    "COMPILED_STEP",
    "GENERATE",
    "KV_QUANTIZATION",
    "PROMPT_CACHE",
    "SPECULATIVE",
]

GENERATE = "generate"
BATCH = "batch"
PROMPT_CACHE = "prompt-cache"
KV_QUANTIZATION = "kv-quantization"
SPECULATIVE = "speculative"
#: The graph may be wrapped by the core's adapter transform (LoRA/DoRA, see
#: :mod:`mlx_loom.adapters`). A family that omits it refuses ``adapter_path``.
ADAPTERS = "adapters"
#: The graph reads a layer's cache only through ``offset``, ``make_mask(...)``
#: and ``append(keys, values)`` (the attention-cache protocol), so the core may
#: trace its one-token forward against caches whose offset is an array and
#: replay it compiled (:mod:`mlx_loom.cpu.compiled_step`).
COMPILED_STEP = "compiled-step"

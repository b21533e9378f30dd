"""Caches: the protocols every cache kind honours, and the standard kinds.

Graphs call :func:`create_attention_mask` and :func:`scaled_dot_product_attention`
with the cache of their layer; loops talk to caches only through the methods of
:mod:`mlx_loom.cache.protocol`.
"""

from __future__ import annotations

from collections.abc import Mapping

from mlx_loom.cache.attention import (
    quantized_scaled_dot_product_attention,
    scaled_dot_product_attention,
)
from mlx_loom.cache.batch import (
    BatchKVCache,
    BatchQuantizedKVCache,
    BatchRotatingKVCache,
    dynamic_roll,
)
from mlx_loom.cache.convert import maybe_quantize_kv_cache, validate_kv_quantization
from mlx_loom.cache.kv import KVCache
from mlx_loom.cache.masks import create_attention_mask, create_causal_mask
from mlx_loom.cache.persist import kind_table, load_prompt_cache, save_prompt_cache
from mlx_loom.cache.protocol import (
    AttentionCache,
    BatchRows,
    Cache,
    Mask,
    SpeculativeRounds,
    Stackable,
)
from mlx_loom.cache.quantized import QuantizedKVCache, QuantizedRotatingKVCache
from mlx_loom.cache.recurrent import RecurrentCache
from mlx_loom.cache.rotating import RotatingKVCache
from mlx_loom.cache.stacked import StackedQuantizedRotatingKVCache, StackedRotatingKVCache

#: The key/value cache kinds of this module, in a fixed order.
STANDARD_KINDS: tuple[type, ...] = (
    KVCache,
    RotatingKVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    BatchKVCache,
    BatchRotatingKVCache,
    BatchQuantizedKVCache,
    StackedRotatingKVCache,
    StackedQuantizedRotatingKVCache,
)

#: Every cache kind a saved prompt cache may name. A file naming anything
#: else is refused on load; nothing is looked up by class name.
CACHE_KINDS: Mapping[str, type] = kind_table(
    *STANDARD_KINDS,
    # --- recurrent / SSM state kinds are listed here (each needs a string
    # ``kind`` and ``from_state(state, meta_state)``): ---
    RecurrentCache,
)

__all__ = [
    "CACHE_KINDS",
    "STANDARD_KINDS",
    "AttentionCache",
    "BatchKVCache",
    "BatchQuantizedKVCache",
    "BatchRotatingKVCache",
    "BatchRows",
    "Cache",
    "KVCache",
    "Mask",
    "QuantizedKVCache",
    "QuantizedRotatingKVCache",
    "RecurrentCache",
    "RotatingKVCache",
    "SpeculativeRounds",
    "Stackable",
    "StackedQuantizedRotatingKVCache",
    "StackedRotatingKVCache",
    "create_attention_mask",
    "create_causal_mask",
    "dynamic_roll",
    "kind_table",
    "load_prompt_cache",
    "maybe_quantize_kv_cache",
    "quantized_scaled_dot_product_attention",
    "save_prompt_cache",
    "scaled_dot_product_attention",
    "validate_kv_quantization",
]

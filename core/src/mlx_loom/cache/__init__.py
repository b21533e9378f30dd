"""Caches: the protocols every cache kind honours, and the standard kinds.

Graphs call :func:`create_attention_mask` with the cache of their layer, then
:func:`append_kv` (``cache.append(keys, values)``), and attend through the
view it returns (``view.attend(q, scale=, mask=, sinks=)``, see
:mod:`mlx_loom.cache.views`): each storage codec — plain, affine,
TurboQuant, or one a plugin registers (:mod:`mlx_loom.cache.codecs`) — owns
its attention arithmetic. A KV cache is a layout (full, window, and their
batch and stacked forms) over a storage codec (:mod:`mlx_loom.cache.storage`).
Loops talk to caches only through the methods of :mod:`mlx_loom.cache.protocol`.
"""

from __future__ import annotations

from collections.abc import Mapping

from mlx_loom.cache.attention import quantized_scaled_dot_product_attention
from mlx_loom.cache._buffers import AffineCodec, PlainCodec
from mlx_loom.cache.batch import BatchKVCache, BatchRotatingKVCache, dynamic_roll
from mlx_loom.cache.checkpoint import Checkpoint
from mlx_loom.cache.codecs import (
    KV_DTYPES,
    KVCodec,
    codec_table,
    resolve_kv_codec,
    resolve_kv_dtype,
)
from mlx_loom.cache.convert import maybe_quantize_kv_cache, validate_kv_quantization
from mlx_loom.cache.forms import (
    BatchQuantizedKVCache,
    BatchTurboQuantKVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    StackedQuantizedRotatingKVCache,
    StackedTurboQuantRotatingKVCache,
    TurboQuantKVCache,
    TurboQuantRotatingKVCache,
)
from mlx_loom.cache.kv import KVCache
from mlx_loom.cache.masks import create_attention_mask, create_causal_mask
from mlx_loom.cache.persist import kind_table, load_prompt_cache, save_prompt_cache
from mlx_loom.cache.protocol import (
    AttentionCache,
    BatchRows,
    Boundable,
    Cache,
    Checkpointable,
    Mask,
    RowPlaces,
    SpeculativeRounds,
    Stackable,
)
from mlx_loom.cache.recurrent import RecurrentCache
from mlx_loom.cache.rotating import RotatingKVCache
from mlx_loom.cache.stacked import StackedRotatingKVCache
from mlx_loom.cache.storage import CODECS
from mlx_loom.cache.turboquant import TURBOQUANT_BITS, TurboQuantCodec, TurboQuantView
from mlx_loom.cache.views import (
    AffineView,
    DonorView,
    KVView,
    PlainView,
    RowsMask,
    RowsView,
    append_kv,
)

#: The key/value cache layouts of this module, in a fixed order; each takes a
#: storage codec (plain, affine, TurboQuant, a plugin's).
STANDARD_KINDS: tuple[type, ...] = (
    KVCache,
    RotatingKVCache,
    BatchKVCache,
    BatchRotatingKVCache,
    StackedRotatingKVCache,
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
    "CODECS",
    "KV_DTYPES",
    "STANDARD_KINDS",
    "TURBOQUANT_BITS",
    "AffineCodec",
    "AffineView",
    "AttentionCache",
    "BatchKVCache",
    "BatchQuantizedKVCache",
    "BatchRotatingKVCache",
    "BatchRows",
    "Boundable",
    "BatchTurboQuantKVCache",
    "Cache",
    "Checkpoint",
    "Checkpointable",
    "DonorView",
    "KVCache",
    "KVCodec",
    "KVView",
    "Mask",
    "PlainCodec",
    "PlainView",
    "QuantizedKVCache",
    "QuantizedRotatingKVCache",
    "RecurrentCache",
    "RotatingKVCache",
    "RowPlaces",
    "RowsMask",
    "RowsView",
    "SpeculativeRounds",
    "Stackable",
    "StackedQuantizedRotatingKVCache",
    "StackedRotatingKVCache",
    "StackedTurboQuantRotatingKVCache",
    "TurboQuantCodec",
    "TurboQuantKVCache",
    "TurboQuantRotatingKVCache",
    "TurboQuantView",
    "append_kv",
    "codec_table",
    "create_attention_mask",
    "create_causal_mask",
    "dynamic_roll",
    "kind_table",
    "load_prompt_cache",
    "maybe_quantize_kv_cache",
    "quantized_scaled_dot_product_attention",
    "resolve_kv_codec",
    "resolve_kv_dtype",
    "save_prompt_cache",
    "validate_kv_quantization",
]

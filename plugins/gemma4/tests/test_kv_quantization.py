"""Quantized KV caches: global layers vs mlx-lm, sliding and shared layers vs stated references.

mlx-lm quantizes only full caches (its ``RotatingKVCache.to_quantized`` raises
"NYI"), and its KV-shared layers hand quantized triples to the fused attention
without a cache, which fails. So:

* global layers: bit-equal to mlx-lm with its ``QuantizedKVCache``;
* sliding layers: the reference is mlx-lm's graph over mlx-lm's
  ``RotatingKVCache`` whose fetched keys/values are ``mx.quantize``-d on the
  way out, attended with mlx-lm's quantized attention. Quantization groups run
  along head_dim per token, so quantize-on-fetch equals quantize-on-write
  (the core tests this for the cache alone); the comparison is bit-exact;
* shared layers: the reference is mlx-lm's graph with its own quantized
  attention used wherever a shared layer receives quantized keys (a
  test-only patch of the attention function its module calls).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import base as lm_base
from mlx_lm.models import gemma4_text as lm_gemma4
from mlx_lm.models.cache import QuantizedKVCache as LmQuantizedKVCache
from mlx_lm.models.cache import RotatingKVCache as LmRotatingKVCache

from mlx_loom.cache import QuantizedKVCache, QuantizedRotatingKVCache

GROUP, BITS, STEPS = 32, 8, 64


class QuantizeOnFetch:
    """mlx-lm's rotating cache, returning ``mx.quantize`` of what it fetched (reference only)."""

    def __init__(self, max_size: int) -> None:
        self.inner = LmRotatingKVCache(max_size=max_size, keep=0)
        self.group_size, self.bits = GROUP, BITS

    @property
    def offset(self) -> int:
        return self.inner.offset

    def update_and_fetch(self, keys, values):
        k, v = self.inner.update_and_fetch(keys, values)
        q = lambda x: tuple(mx.quantize(x, group_size=GROUP, bits=BITS))  # noqa: E731
        return q(k), q(v)

    def make_mask(self, *args, **kwargs):
        return self.inner.make_mask(*args, **kwargs)


def _reference_caches(cfg):
    return [
        LmQuantizedKVCache(group_size=GROUP, bits=BITS)
        if k == "full_attention"
        else QuantizeOnFetch(cfg.sliding_window)
        for k in cfg.kinds[: cfg.first_shared_layer]
    ]


def test_quantized_kv_on_global_layers_matches_mlx_lm(kit, checkpoint):
    path = checkpoint(layer_types=[kit.F] * 5, **kit.PER_LAYER)
    ours, theirs = kit.load_ours(path), kit.load_theirs(path)
    our_caches = ours.make_cache(kv_bits=BITS, kv_group_size=GROUP)
    assert all(isinstance(c, QuantizedKVCache) for c in our_caches)
    their_caches = [LmQuantizedKVCache(group_size=GROUP, bits=BITS) for _ in range(5)]
    kit.greedy_compare(
        ours, theirs, kit.prompt_of(20), our_caches, their_caches, steps=STEPS, chunks=(13, 7)
    )


def test_quantized_kv_on_sliding_layers_matches_quantize_on_fetch_reference(kit, checkpoint):
    path = checkpoint(**kit.PER_LAYER, **kit.K_EQ_V)
    ours, theirs = kit.load_ours(path), kit.load_theirs(path)
    our_caches = ours.make_cache(kv_bits=BITS, kv_group_size=GROUP)
    assert isinstance(our_caches[0], QuantizedRotatingKVCache)
    kit.greedy_compare(
        ours,
        theirs,
        kit.prompt_of(20),
        our_caches,
        _reference_caches(ours.cfg),
        steps=STEPS,
        chunks=(13, 7),
    )


def test_quantized_kv_reaches_kv_shared_layers_through_donor_views(kit, checkpoint, monkeypatch):
    def attention_for_shared_layers(queries, keys, values, cache, scale, mask, sinks=None):
        if cache is None and isinstance(keys, tuple):  # a shared layer reading quantized donors
            return lm_base.quantized_scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask=mask, group_size=GROUP, bits=BITS
            )
        return lm_base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask)

    monkeypatch.setattr(lm_gemma4, "scaled_dot_product_attention", attention_for_shared_layers)
    path = checkpoint(**kit.SHARED, **kit.MOE)
    ours, theirs = kit.load_ours(path), kit.load_theirs(path)
    kit.greedy_compare(
        ours,
        theirs,
        kit.prompt_of(20),
        ours.make_cache(kv_bits=BITS, kv_group_size=GROUP),
        _reference_caches(ours.cfg),
        steps=STEPS,
        chunks=(13, 7),
    )


def test_plain_caches_convert_to_quantized_mid_generation(kit, checkpoint):
    """The loop's path: start plain, then ``to_quantized`` every cache (sliding ones too)."""
    path = checkpoint(**kit.SHARED)
    ours = kit.load_ours(path)
    caches = ours.make_cache()
    ours(kit.prompt_of(20), cache=caches)
    converted = [c.to_quantized(group_size=GROUP, bits=BITS) for c in caches]
    assert isinstance(converted[0], QuantizedRotatingKVCache)
    assert all(c.codec == "affine" for c in converted)
    logits = ours(mx.array([[3]]), cache=converted)
    assert logits.shape == (1, 1, 256) and bool(mx.all(mx.isfinite(logits)))

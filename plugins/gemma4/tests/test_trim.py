"""Trimming: exact inside the sliding window, refused (never skipped) once a window is full.

mlx-lm's rotating cache silently trims nothing once full, so its speculative
decoding verifies draft tokens against a wrong window on Gemma 4 as soon as
the prompt exceeds ``sliding_window``. Our model's sliding layers use the
core's rotating caches, which raise ``CacheNotTrimmable`` instead.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom.cache import KVCache, RotatingKVCache
from mlx_loom.errors import CacheNotTrimmable


def test_trimming_a_full_sliding_window_through_the_models_caches_is_refused(kit, checkpoint):
    ours = kit.load_ours(checkpoint(**kit.SHARED))
    caches = ours.make_cache()
    ours(kit.prompt_of(20), cache=caches)  # 20 tokens > window of 8
    sliding = [c for c in caches if isinstance(c, RotatingKVCache)]
    assert sliding and not any(c.is_trimmable() for c in sliding)
    with pytest.raises(CacheNotTrimmable, match="window is full"):
        sliding[0].trim(1)
    assert sliding[0].offset == 20  # nothing was silently dropped


def test_quantized_sliding_window_refuses_trim_when_full(kit, checkpoint):
    ours = kit.load_ours(checkpoint())
    caches = ours.make_cache(kv_bits=8, kv_group_size=32)
    ours(kit.prompt_of(12), cache=caches)
    with pytest.raises(CacheNotTrimmable):
        caches[0].trim(2)


def test_trim_inside_the_window_is_exact(kit, checkpoint):
    """Trim 2 tokens then re-feed others: logits equal a fresh run of the edited sequence."""
    ours = kit.load_ours(checkpoint(**kit.SHARED, **kit.PER_LAYER))
    prompt = kit.prompt_of(6)
    caches = ours.make_cache()
    ours(prompt, cache=caches)
    assert all(c.is_trimmable() for c in caches)
    assert [c.trim(2) for c in caches] == [2, 2, 2]
    tail = mx.array([[7, 9]], dtype=mx.int32)
    after_trim = ours(tail, cache=caches)
    fresh = ours(mx.concatenate([prompt[:, :4], tail], axis=1), cache=ours.make_cache())
    assert mx.allclose(after_trim, fresh[:, 4:], atol=1e-5).item()


def test_global_layers_stay_trimmable_past_the_window(kit, checkpoint):
    ours = kit.load_ours(checkpoint())
    caches = ours.make_cache()
    ours(kit.prompt_of(20), cache=caches)
    full = [c for c in caches if isinstance(c, KVCache)]
    assert full and full[0].trim(3) == 3 and full[0].offset == 17

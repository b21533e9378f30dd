"""RecurrentCache: padding that never touches the state, row operations, state, speculative rounds.

A toy linear-attention layer (depthwise causal conv + SiLU, then the gated
delta rule through ``mx.fast.gated_delta_update``) drives the cache through the
same calls a family graph makes: ``make_mask``, ``conv_tail``, ``tail_ends``,
``record``, ``update``.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom.cache.recurrent import RecurrentCache
from mlx_loom.errors import CacheError, CacheNotTrimmable

C, K = 8, 4  # channels, conv width


def _weights():
    key = mx.random.key(7)
    k1, k2 = mx.random.split(key)
    return mx.random.normal((C, K, 1), key=k1) * 0.5, mx.random.normal((C, 2), key=k2) * 0.5


W_CONV, W_GATE = _weights()


def replay(q, k, v, g, beta, state, mask=None, lengths=None):
    if lengths is not None:
        kept = mx.arange(q.shape[1])[None] < lengths[:, None]
        mask = kept if mask is None else mask & kept
    return mx.fast.gated_delta_update(q, k, v, g, beta, state, mask)[1]


def toy_layer(x: mx.array, cache: RecurrentCache | None) -> mx.array:
    """x: [B, S, C] -> y: [B, S, C], updating ``cache`` like a gated delta net."""
    B, S, _ = x.shape
    mask = cache.make_mask(S) if cache is not None else None
    if mask is not None:
        x = mx.where(mask[..., None], x, 0)
    tail = cache.conv_tail(B, K - 1, C, x.dtype) if cache else mx.zeros((B, K - 1, C))
    full = mx.concatenate([tail, x], axis=1)
    ends = cache.tail_ends(S) if cache else None
    if ends is None:
        new_tail = full[:, -(K - 1) :]
    else:
        new_tail = mx.take_along_axis(full, (ends[:, None] + mx.arange(K - 1))[..., None], axis=1)
    h = mx.conv1d(full, W_CONV, groups=C)
    h = h * mx.sigmoid(h)
    qk = (h / mx.linalg.norm(h, axis=-1, keepdims=True))[:, :, None, :]
    v = h[:, :, None, :]
    gb = mx.sigmoid(x @ W_GATE)
    g, beta = gb[..., :1], gb[..., 1:]
    state = cache.recurrent_state if cache is not None else None
    if state is None:
        state = mx.zeros((B, 1, C, C))
    if cache is not None:
        cache.record(conv_input=x, inputs=(qk, qk, v, g, beta), mask=mask, replay=replay)
    y, state = mx.fast.gated_delta_update(qk, qk, v, g, beta, state, mask)
    if cache is not None:
        cache.update(conv_state=new_tail, recurrent_state=state, n=S)
    return y[:, :, 0]


def tokens(B: int, S: int, seed: int = 0) -> mx.array:
    return mx.random.normal((B, S, C), key=mx.random.key(seed))


def run(x: mx.array, cache: RecurrentCache) -> RecurrentCache:
    mx.eval(toy_layer(x, cache))
    return cache


def assert_same_state(a: RecurrentCache, b: RecurrentCache) -> None:
    assert mx.array_equal(a.conv_state, b.conv_state)
    assert mx.array_equal(a.recurrent_state, b.recurrent_state)


# --- trim ------------------------------------------------------------------------


def test_trim_is_refused_with_a_typed_error_naming_the_fix():
    cache = run(tokens(1, 5), RecurrentCache())
    assert cache.is_trimmable() is False
    with pytest.raises(CacheNotTrimmable, match="cannot drop the last 2") as err:
        cache.trim(2)
    assert "begin_round" in err.value.fix


def test_trimming_nothing_is_exact_and_allowed():
    cache = run(tokens(1, 5), RecurrentCache())
    assert cache.trim(0) == 0
    assert cache.offset == 5


# --- padding -------------------------------------------------------------------------


def test_left_padding_mask_hides_each_rows_pads():
    cache = RecurrentCache(left_padding=[0, 2])
    assert cache.make_mask(4).tolist() == [[True] * 4, [False, False, True, True]]


def test_left_padded_rows_end_in_the_state_of_the_row_alone():
    a, b = tokens(1, 6, seed=1), tokens(1, 4, seed=2)
    batch = mx.concatenate([a, mx.concatenate([mx.zeros((1, 2, C)), b], axis=1)])
    cache = run(batch, RecurrentCache(left_padding=[0, 2]))
    assert_same_state(cache.extract(0), run(a, RecurrentCache()))
    assert_same_state(cache.extract(1), run(b, RecurrentCache()))
    assert cache.offset.tolist() == [6, 4]


def test_right_padded_prefill_keeps_pads_out_of_state_and_tail():
    a, b = tokens(1, 6, seed=3), tokens(1, 3, seed=4)
    batch = mx.concatenate([a, mx.concatenate([b, mx.full((1, 3, C), 9.0)], axis=1)])
    cache = RecurrentCache()
    cache.prepare(lengths=[6, 3], right_padding=[0, 3])
    run(batch, cache)
    cache.finalize()
    assert_same_state(cache.extract(1), run(b, RecurrentCache()))
    assert_same_state(cache.extract(0), run(a, RecurrentCache()))


def test_right_padding_without_lengths_is_refused():
    with pytest.raises(CacheError, match="without lengths"):
        RecurrentCache().prepare(right_padding=[0, 2])


def test_padded_prefill_in_chunks_matches_one_chunk():
    x = tokens(2, 6, seed=5)
    whole = run(x, RecurrentCache(left_padding=[0, 3]))
    chunked = RecurrentCache(left_padding=[0, 3])
    run(x[:, :2], chunked)
    run(x[:, 2:], chunked)
    assert_same_state(whole, chunked)


def test_left_padding_is_dropped_once_every_row_is_past_it():
    cache = run(tokens(2, 3), RecurrentCache(left_padding=[0, 2]))
    assert cache.make_mask(1) is None


# --- rows -----------------------------------------------------------------------------


def test_filter_keeps_the_named_rows_in_order():
    x = tokens(3, 4, seed=6)
    cache = run(x, RecurrentCache())
    cache.filter([2, 0])
    alone = run(x[2:3], RecurrentCache())
    assert mx.array_equal(cache.recurrent_state[0], alone.recurrent_state[0])
    assert cache.batch_size == 2


def test_a_row_put_in_a_rows_place_continues_exactly_as_alone():
    a = run(tokens(1, 5, seed=7), RecurrentCache())
    b = run(tokens(1, 2, seed=8), RecurrentCache())
    c = run(tokens(1, 3, seed=9), RecurrentCache())
    batch = RecurrentCache.stack([a, b])
    assert batch.takes_row(c) and not batch.takes_row(RecurrentCache())  # nothing written
    batch.put_row(0, c)
    assert batch.offset.tolist() == [3, 2]
    step = tokens(2, 1, seed=10)
    run(step, batch)
    alone_c, alone_b = run(step[0:1], c), run(step[1:2], b)
    assert mx.array_equal(batch.recurrent_state[0], alone_c.recurrent_state[0])
    assert mx.array_equal(batch.recurrent_state[1], alone_b.recurrent_state[0])
    assert mx.array_equal(batch.conv_state[0], alone_c.conv_state[0])
    with pytest.raises(CacheError, match="put_row"):
        batch.put_row(5, c)


def test_extend_then_extract_round_trips_each_row():
    a = run(tokens(1, 5, seed=7), RecurrentCache())
    b = run(tokens(1, 2, seed=8), RecurrentCache())
    merged = RecurrentCache.merge([a, b])
    assert merged.offset.tolist() == [5, 2]
    assert_same_state(merged.extract(0), a)
    assert_same_state(merged.extract(1), b)
    assert merged.extract(1).offset == 2


def test_extending_with_an_empty_cache_adds_zero_state_rows():
    a = run(tokens(1, 5, seed=9), RecurrentCache())
    a.extend(RecurrentCache())
    assert a.batch_size == 2
    assert mx.array_equal(a.recurrent_state[1], mx.zeros_like(a.recurrent_state[1]))
    assert a.offset.tolist() == [5, 0]


def test_batch_decode_after_merge_equals_each_row_decoding_alone():
    a = run(tokens(1, 5, seed=10), RecurrentCache())
    b = run(tokens(1, 3, seed=11), RecurrentCache())
    merged = RecurrentCache.merge([a, b])
    step = tokens(2, 1, seed=12)
    run(step, merged)
    run(step[:1], a)
    run(step[1:], b)
    assert_same_state(merged.extract(0), a)
    assert_same_state(merged.extract(1), b)


def test_empty_batch_has_one_padded_row_per_entry():
    batch = RecurrentCache().empty_batch([2, 0, 1])
    assert batch.empty() and batch.batch_size == 3
    assert batch.make_mask(3).tolist()[0] == [False, False, True]


# --- state ---------------------------------------------------------------------------


def test_state_round_trips_through_from_state():
    cache = run(tokens(1, 5), RecurrentCache())
    again = RecurrentCache.from_state(cache.state, cache.meta_state)
    assert_same_state(again, cache)
    assert again.offset == 5


def test_per_row_offsets_survive_from_state():
    cache = run(tokens(2, 4), RecurrentCache(left_padding=[1, 0]))
    again = RecurrentCache.from_state(cache.state, cache.meta_state)
    assert again.offset.tolist() == [3, 4]


def test_from_state_refuses_a_malformed_state():
    with pytest.raises(CacheError, match="from_state"):
        RecurrentCache.from_state([mx.zeros((1, 3, C))], ("1",))


# --- speculative rounds ---------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 2, 5])
def test_commit_equals_a_fresh_forward_over_the_kept_tokens(keep):
    prompt, window = tokens(1, 6, seed=13), tokens(1, 5, seed=14)
    spec = run(prompt, RecurrentCache())
    spec.begin_round()
    run(window, spec)
    spec.commit(keep)
    fresh = run(prompt, RecurrentCache())
    if keep:
        run(window[:, :keep], fresh)
    assert_same_state(spec, fresh)
    assert spec.offset == 6 + keep


def test_per_row_commit_equals_each_row_kept_alone():
    prompt, window = tokens(2, 6, seed=15), tokens(2, 4, seed=16)
    spec = run(prompt, RecurrentCache())
    spec.begin_round()
    run(window, spec)
    spec.commit([1, 3])
    for row, keep in ((0, 1), (1, 3)):
        fresh = run(prompt[row : row + 1], RecurrentCache())
        run(window[row : row + 1, :keep], fresh)
        assert_same_state(spec.extract(row), fresh)
    assert spec.offset.tolist() == [7, 9]


def test_decoding_after_a_commit_continues_the_kept_sequence():
    prompt, window, nxt = tokens(1, 4, seed=17), tokens(1, 3, seed=18), tokens(1, 1, seed=19)
    spec = run(prompt, RecurrentCache())
    spec.begin_round()
    run(window, spec)
    spec.commit(1)
    y_spec = toy_layer(nxt, spec)
    fresh = run(prompt, RecurrentCache())
    run(window[:, :1], fresh)
    assert mx.array_equal(y_spec, toy_layer(nxt, fresh))


def test_a_round_may_span_several_forwards():
    prompt, window = tokens(1, 4, seed=20), tokens(1, 4, seed=21)
    spec = run(prompt, RecurrentCache())
    spec.begin_round()
    run(window[:, :2], spec)
    run(window[:, 2:], spec)
    spec.commit(3)
    fresh = run(prompt, RecurrentCache())
    run(window[:, :3], fresh)
    assert_same_state(spec, fresh)


def test_commit_beyond_the_window_is_refused():
    spec = run(tokens(1, 4), RecurrentCache())
    spec.begin_round()
    run(tokens(1, 2, seed=1), spec)
    with pytest.raises(CacheError, match="outside the verified window of 2"):
        spec.commit(3)


def test_commit_without_a_round_is_refused():
    with pytest.raises(CacheError, match="no open round"):
        run(tokens(1, 2), RecurrentCache()).commit(1)


def test_a_second_begin_round_is_refused():
    spec = run(tokens(1, 2), RecurrentCache())
    spec.begin_round()
    with pytest.raises(CacheError, match="round is open"):
        spec.begin_round()


def test_nothing_is_recorded_outside_a_round():
    cache = run(tokens(1, 3), RecurrentCache())
    assert cache.in_round is False and cache._round is None


def test_row_operations_are_refused_during_a_round():
    spec = run(tokens(2, 2), RecurrentCache())
    spec.begin_round()
    with pytest.raises(CacheError, match="filter"):
        spec.filter([0])

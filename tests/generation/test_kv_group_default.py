"""One default KV group size for every door, checked before any forward.

The bundled model's heads are 32 wide, so mlx-lm's default group of 64 cannot
quantize them. ``loom generate --kv-bits`` used to pick 32 while the Python
API kept 64 and failed during prefill (a ``CacheError`` from the cache); every
door now leaves ``kv_group_size`` unset and the engine picks the size that
fits, and a given size that cannot fit is a ``RequestError`` naming it before
any work is queued.
"""

from __future__ import annotations

import pytest

import mlx_loom
from mlx_loom.engine import make_request
from mlx_loom.errors import RequestError
from mlx_loom.generation import batch_generate, stream_generate
from mlx_loom.serve.app import ServeApp

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def bundled():
    return mlx_loom.load(mlx_loom.BUNDLED_MODEL)


def tokens(model, tokenizer, **options):
    return [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=8, **options)]


@pytest.mark.parametrize("bits", [4, 8])
def test_the_api_picks_the_group_that_fits_the_heads(bundled, bits):
    model, tokenizer = bundled
    assert tokens(model, tokenizer, kv_bits=bits) == tokens(
        model, tokenizer, kv_bits=bits, kv_group_size=32
    )
    assert make_request(model, tokenizer, PROMPT, kv_bits=bits).kv.group_size == 32


def test_batch_generate_picks_it_too(bundled):
    model, tokenizer = bundled
    got = batch_generate(model, tokenizer, [PROMPT, "The cat"], max_tokens=6, kv_bits=4)
    want = batch_generate(
        model, tokenizer, [PROMPT, "The cat"], max_tokens=6, kv_bits=4, kv_group_size=32
    )
    assert got.texts == want.texts


def test_without_kv_bits_the_group_is_mlx_lms_default(bundled):
    model, tokenizer = bundled
    assert make_request(model, tokenizer, PROMPT).kv.group_size == 64


def test_a_given_group_that_does_not_divide_the_heads_is_refused_before_any_forward(bundled):
    model, tokenizer = bundled
    with pytest.raises(RequestError) as info:
        make_request(model, tokenizer, PROMPT, kv_bits=4, kv_group_size=64)
    assert "kv_group_size=64 does not divide this model's head dimension (32)" in info.value.message
    assert "kv_group_size=32" in info.value.fix
    with pytest.raises(RequestError, match="kv_group_size=64"):
        mlx_loom.generate(model, tokenizer, PROMPT, max_tokens=2, kv_bits=4, kv_group_size=64)


def test_the_server_picks_the_same_group_at_start_and_refuses_a_bad_one(bundled):
    model, tokenizer = bundled
    app = ServeApp(model, tokenizer, kv_bits=8)
    try:
        assert app.kv["kv_group_size"] == 32
    finally:
        app.close()
    with pytest.raises(RequestError, match="kv_group_size=64"):
        ServeApp(model, tokenizer, kv_bits=8, kv_group_size=64)

"""``kv_dtype``: attention caches stored in float16 / bfloat16 instead of the compute dtype.

The option is the model's (``load(kv_dtype=)``, ``--kv-dtype`` on every
command): one cast where every family's attention appends its keys/values
(:func:`mlx_loom.cache.append_kv`) stores full, sliding-window and KV-shared
caches alike; recurrent state stays in its own dtype. The engine's guarantees
hold with it on: batched rows equal their solo runs, a reused prefix equals a
cold prefill. Quantizing codecs are refused beside it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.cache import RecurrentCache
from mlx_loom.cli import generate_cmd
from mlx_loom.cli.main import build_parser, main
from mlx_loom.engine import Engine, EngineSettings
from mlx_loom.errors import RequestError

from .conftest import alone, assert_same_run, drive, ids, request

HALF = {"float16": mx.float16, "bfloat16": mx.bfloat16}


@pytest.fixture(scope="module")
def half(checkpoints):
    """``half(name, dtype)``: the tiny checkpoint loaded with ``kv_dtype=dtype``."""
    models: dict[tuple[str, str], object] = {}

    def get(name: str, dtype: str = "float16"):
        if (name, dtype) not in models:
            models[name, dtype] = mlx_loom.load(checkpoints(name), kv_dtype=dtype)[0]
        return models[name, dtype]

    return get


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("name", ["llama-sliding", "qwen3_next", "gemma4_text"])
def test_attention_caches_are_stored_in_the_asked_dtype_and_recurrent_state_is_not(
    name, dtype, half
):
    model = half(name, dtype)
    caches = model.make_cache()
    mx.eval(model.forward(mx.array([ids(9, 1)]), caches))
    attention = [c for c in caches if getattr(c, "keys", None) is not None]
    assert attention, name
    assert {c.keys.dtype for c in attention} == {HALF[dtype]}
    assert {c.values.dtype for c in attention} == {HALF[dtype]}
    for c in caches:
        if isinstance(c, RecurrentCache):
            assert all(a.dtype == mx.float32 for a in c.state if isinstance(a, mx.array))


def test_half_keys_move_the_logits_by_a_small_bounded_amount(loaded, half):
    """float16 keys/values change the tiny Llama's logits (the cast happened), by ~1e-4
    of their scale (measured; docs/cpu.md has every family's figure)."""
    plain, _ = loaded("llama")
    prompt = mx.array([ids(24, 2)])
    ref = plain.forward(prompt, plain.make_cache())
    model = half("llama")
    got = model.forward(prompt, model.make_cache())
    diff = mx.abs(got - ref).max().item()
    assert 0 < diff <= 1e-3 * mx.abs(ref).max().item()


@pytest.mark.parametrize("name", ["llama-sliding", "qwen3_next", "gemma4_text"])
def test_batched_rows_with_half_kv_equal_their_solo_runs(name, half):
    model = half(name)
    reqs = {
        k: request(model, prompt=ids(4 + 5 * i, 20 + i), max_tokens=9) for i, k in enumerate("abc")
    }
    settings = EngineSettings(prefill_step_size=4)
    engine = Engine(model, settings)
    runs = drive(engine, {0: [("a", reqs["a"]), ("b", reqs["b"])], 2: [("c", reqs["c"])]})
    for k, req in reqs.items():
        assert runs[k].done.outcome == "finished"
        assert_same_run(runs[k], alone(model, req, settings), f"{name} {k}")


@pytest.mark.parametrize("dtype", list(HALF))
def test_a_reused_conversation_with_half_kv_equals_a_cold_prefill(dtype, half):
    """The reused caches hold decoded tokens (one-row attention) where the cold run
    prefills them (blocked attention): equal bit for bit, in either half dtype."""
    name = "llama"
    model = half(name, dtype)
    engine = Engine(model, EngineSettings(prompt_cache_size=4))
    first = drive(engine, {0: [("r", request(model, prompt=ids(9, 1), max_tokens=6))]})["r"]
    follow_up = ids(9, 1) + first.tokens + ids(5, 2)
    run = drive(engine, {0: [("r", request(model, prompt=follow_up, max_tokens=8))]})["r"]
    assert run.events[0].cached_tokens == len(ids(9, 1)) + len(first.tokens) - 1
    assert_same_run(run, alone(model, request(model, prompt=follow_up, max_tokens=8)), name)


def test_a_bad_kv_dtype_and_kv_quantization_beside_it_are_refused(checkpoints, half):
    with pytest.raises(RequestError, match="float8.*float16, bfloat16") as err:
        mlx_loom.load(checkpoints("llama"), kv_dtype="float8")
    assert err.value.param == "kv_dtype"
    model = half("llama")
    for options in ({"kv_bits": 4}, {"kv_codec": "turboquant"}):
        with pytest.raises(RequestError, match="kv_dtype") as err:
            request(model, prompt=ids(4, 3), max_tokens=2, **options)
        assert err.value.param in ("kv_bits", "kv_codec")


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_every_command_loads_the_model_with_its_kv_dtype(command, monkeypatch):
    seen = {}

    def fake_load(ref, **options):
        seen.update(options)
        raise SystemExit(0)

    monkeypatch.setattr(generate_cmd, "load", fake_load)
    args = build_parser().parse_args([command, "--kv-dtype", "bfloat16"])
    with pytest.raises(SystemExit):
        generate_cmd.load_from_args(args)
    assert seen["kv_dtype"] == "bfloat16"


def test_the_cli_refuses_kv_dtype_with_kv_bits_in_flags(capsys):
    assert main(["generate", "hi", "-m", "2", "--kv-dtype", "float16", "--kv-bits", "4"]) == 2
    err = capsys.readouterr().err
    assert "--kv-bits" in err and "--kv-dtype" in err
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "-m", "2", "--kv-dtype", "float8"])
    assert exit_.value.code == 2 and "invalid choice: 'float8'" in capsys.readouterr().err
    assert main(["generate", "hi", "-m", "3", "--kv-dtype", "bfloat16"]) == 0

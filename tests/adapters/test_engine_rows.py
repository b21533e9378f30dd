"""Per-request adapters on the continuous-batching engine.

Requests naming different registered adapters (LoRA, DoRA, and none) are
prefilled and decoded in shared forwards, and each request's tokens and
log-probability vectors equal, bit for bit, the same request run alone on a
model loaded with only its adapter (or with none).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.adapters import AdapterSet
from mlx_loom.engine import Engine, make_request
from mlx_loom.errors import AdapterError, RequestError

from . import adapterkit as kit
from .test_rows import _pair


def _ids(n: int, seed: int) -> list[int]:
    return mx.random.randint(4, 256, (n,), key=mx.random.key(seed)).tolist()


def _run(engine: Engine, schedule: dict[int, list[tuple[str, Any]]]) -> dict[str, Any]:
    """Step ``engine``, inserting ``schedule[k]`` at step ``k``; each request's
    ``(tokens, logprob vectors)``, and the most decode groups seen in one step."""
    names: dict[int, str] = {}
    out: dict[str, tuple[list[int], list[mx.array]]] = {}
    step, groups = 0, []
    while step in schedule or engine.has_work or any(k > step for k in schedule):
        for name, req in schedule.get(step, []):
            (uid,) = engine.insert([req])
            names[uid] = name
            out[name] = ([], [])
        for event in engine.step() if engine.has_work else []:
            if hasattr(event, "token"):
                tokens, vectors = out[names[event.uid]]
                tokens.append(event.token)
                vectors.append(event.logprobs)
        groups.append(engine.stats().groups)
        step += 1
        assert step < 500, "the engine did not finish"
    return {"runs": out, "groups": max(groups)}


def _request(model, prompt, adapter=None, max_tokens=6):
    return make_request(
        model, None, prompt, max_tokens=max_tokens, logprobs_vector=True, adapter=adapter
    )


def _assert_solo(path, adapters, name, prompt, batched, max_tokens=6):
    solo_model = mlx_loom.load(path, adapter_path=adapters.get(name))[0]
    solo = _run(Engine(solo_model), {0: [("solo", _request(solo_model, prompt, None, max_tokens))]})
    tokens, vectors = solo["runs"]["solo"]
    assert batched[0] == tokens, name
    for step, (a, b) in enumerate(zip(batched[1], vectors, strict=True)):
        assert mx.array_equal(a, b).item(), f"{name}: log-probabilities differ at token {step}"


#: name -> (adapter, prompt length, step it arrives at)
SCHEDULE = {
    "a": ("lora", 9, 0),
    "b": (None, 8, 0),
    "c": ("dora", 9, 0),
    "d": ("lora", 5, 2),  # joins the running batch mid-decode
}


@pytest.mark.parametrize("model_type", kit.FAMILIES)
def test_rows_with_different_adapters_share_the_engine_and_equal_their_solo_runs(
    base, tmp_path, model_type
):
    path, adapters = _pair(base, tmp_path, model_type)
    model = mlx_loom.load(path)[0]
    AdapterSet(model, adapters)
    prompts = {k: _ids(n, seed=i) for i, (k, (_, n, _)) in enumerate(SCHEDULE.items())}
    schedule: dict[int, list[tuple[str, Any]]] = {}
    for key, (adapter, _, at) in SCHEDULE.items():
        schedule.setdefault(at, []).append((key, _request(model, prompts[key], adapter)))
    got = _run(Engine(model), schedule)
    assert got["groups"] == 1  # one decode batch held every row
    for key, (adapter, _, _) in SCHEDULE.items():
        _assert_solo(path, adapters, adapter, prompts[key], got["runs"][key])


def test_a_prefix_kept_for_one_adapter_is_not_reused_by_another(base, tmp_path):
    from mlx_loom.engine import EngineSettings

    path, adapters = _pair(base, tmp_path, "llama")
    model = mlx_loom.load(path)[0]
    AdapterSet(model, adapters)
    engine = Engine(model, EngineSettings(prompt_cache_size=4))
    prompt = _ids(10, seed=7)
    first = _run(engine, {0: [("lora", _request(model, prompt, "lora"))]})["runs"]["lora"]
    again = _run(engine, {0: [("dora", _request(model, prompt, "dora"))]})["runs"]["dora"]
    assert engine.stats().prefix_hits == 0
    _assert_solo(path, adapters, "lora", prompt, first)
    _assert_solo(path, adapters, "dora", prompt, again)


def test_rows_of_an_adapter_that_batches_alone_get_their_own_group(base, tmp_path, monkeypatch):
    path, adapters = _pair(base, tmp_path, "llama")
    model = mlx_loom.load(path)[0]
    registered = AdapterSet(model, adapters)
    # As an adapter of a family's own routed-expert layer reports itself.
    monkeypatch.setattr(registered, "batch_key", lambda name: name if name == "dora" else None)
    prompts = [_ids(6, seed=i) for i in range(3)]
    names = ["dora", "lora", None]
    reqs = [
        (str(i), _request(model, p, n)) for i, (p, n) in enumerate(zip(prompts, names, strict=True))
    ]
    got = _run(Engine(model), {0: reqs})
    assert got["groups"] == 2
    for i, name in enumerate(names):
        _assert_solo(path, adapters, name, prompts[i], got["runs"][str(i)])


def test_a_request_naming_an_unregistered_adapter_is_refused_before_it_queues(base, tmp_path):
    path, adapters = _pair(base, tmp_path, "llama")
    model = mlx_loom.load(path)[0]
    AdapterSet(model, adapters)
    with pytest.raises(AdapterError, match="no adapter named 'sql'.*registered: lora, dora"):
        _request(model, [5, 6, 7], "sql")


def test_a_request_naming_an_adapter_on_a_model_without_a_set_is_refused(base):
    model = mlx_loom.load(base("llama"))[0]
    with pytest.raises(AdapterError, match="no adapters registered"):
        _request(model, [5, 6, 7], "lora")


def test_a_per_request_adapter_does_not_combine_with_speculative_decoding(base, tmp_path):
    from mlx_loom.engine import Speculation

    path, adapters = _pair(base, tmp_path, "llama")
    model = mlx_loom.load(path)[0]
    AdapterSet(model, adapters)
    draft = mlx_loom.load(path)[0]
    with pytest.raises(RequestError, match="Speculative decoding does not combine"):
        make_request(model, None, [5, 6, 7], adapter="lora", speculation=Speculation(draft))


@pytest.mark.parametrize("model_type", ["llama", "gemma4_text"])
def test_generate_and_batch_generate_take_per_request_adapters(base, tmp_path, model_type):
    path, adapters = _pair(base, tmp_path, model_type)
    model, tokenizer = mlx_loom.load(path)
    AdapterSet(model, adapters)
    prompts, names = ["the cat", "hello world", "a b c"], ["lora", None, "dora"]
    solos = []
    for prompt, name in zip(prompts, names, strict=True):
        alone = mlx_loom.load(path, adapter_path=adapters.get(name))[0]
        solos.append(mlx_loom.generate(alone, tokenizer, prompt, max_tokens=8))
    assert mlx_loom.generate(model, tokenizer, prompts[0], max_tokens=8, adapter="lora") == solos[0]
    batch = mlx_loom.batch_generate(model, tokenizer, prompts, max_tokens=8, adapters=names)
    assert batch.texts == solos


def test_batch_generate_needs_one_adapter_choice_per_prompt(base, tmp_path):
    path, adapters = _pair(base, tmp_path, "llama")
    model, tokenizer = mlx_loom.load(path)
    AdapterSet(model, adapters)
    with pytest.raises(RequestError, match="adapters has 1 entries for 2 prompts"):
        mlx_loom.batch_generate(model, tokenizer, ["a", "b"], max_tokens=2, adapters=["lora"])

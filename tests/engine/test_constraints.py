"""Structured output in the engine: each row's grammar masks its own logits.

On the bundled tiny model (random-ish weights, sampled at temperature 1.0)
every constrained output parses and validates; rows with different
constraints (and none) in one batch equal their solo runs bit for bit;
speculative rows never keep a token the grammar rejects; EOS is legal
exactly when the grammar is complete; bad, unenforceable and over-budget
constraints are refused before any work.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.engine import Engine
from mlx_loom.engine.constraints import (
    MAX_CHOICES,
    MAX_SOURCE_BYTES,
    compile_constraint,
    from_options,
)
from mlx_loom.engine.request import Speculation
from mlx_loom.errors import RequestError
from mlx_loom.generation import SamplingParams, stream_generate

from .conftest import alone, assert_same_run, drive, request

TINY = Path(mlx_loom.__file__).parent / "assets" / "tiny-minicpm5"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}


def valid(value: object) -> bool:
    """``value`` satisfies :data:`SCHEMA` (checked by hand: no validator library needed)."""
    if not isinstance(value, dict) or set(value) != {"name", "age", "pet", "ok"}:
        return False
    age = value["age"]
    return (
        isinstance(value["name"], str)
        and len(value["name"]) <= 12
        and isinstance(age, int)
        and not isinstance(age, bool)
        and 0 <= age <= 120
        and value["pet"] in ("cat", "dog", "fish")
        and isinstance(value["ok"], bool)
    )


@pytest.fixture(scope="module")
def tiny():
    return mlx_loom.load(TINY)


def text_of(model, tokenizer, prompt, **options) -> tuple[str, str | None]:
    out = list(stream_generate(model, tokenizer, prompt, **options))
    return "".join(r.text for r in out), out[-1].finish_reason


@pytest.mark.parametrize("seed", range(4))
def test_sampled_json_schema_outputs_parse_and_validate(tiny, seed):
    model, tok = tiny
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    text, finish = text_of(
        model, tok, "Tell me", max_tokens=120, temperature=1.0, seed=seed, response_format=fmt
    )
    assert finish == "stop", text
    assert valid(json.loads(text)), text


def test_choice_regex_and_gbnf_grammar_outputs_match_at_temperature_one(tiny):
    model, tok = tiny
    for seed in range(3):
        c = compile_constraint("choice", ["yes", "no", "maybe"], tok)
        req = request(model, tok, "Answer", max_tokens=20, constraint=c,
                      params=SamplingParams(temperature=1.0, seed=seed))
        assert alone(model, req).text in ("yes", "no", "maybe")
        text, finish = text_of(
            model, tok, "Code", max_tokens=20, temperature=1.0, seed=seed,
            grammar='root ::= [0-9]{3} "-" [a-z]{2}',
        )
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text) and finish == "stop", text


def test_eos_is_allowed_exactly_when_the_grammar_is_complete(tiny):
    model, tok = tiny
    eos = sorted(tok.eos_token_ids)
    push_eos = {e: 100.0 for e in eos}  # EOS is what the model wants most, always
    c = compile_constraint("regex", "[a-z]{4}", tok)
    run = alone(model, request(model, tok, "Hi", max_tokens=20, constraint=c,
                               params=SamplingParams(logit_bias=push_eos)))
    assert re.fullmatch("[a-z]{4}", run.text) and run.tokens[-1] in eos
    # Out of tokens before completion: "length", never a forced early end.
    short = alone(model, request(model, tok, "Hi", max_tokens=2, constraint=c,
                                 params=SamplingParams(logit_bias=push_eos)))
    assert short.events[-1].finish_reason == "length" and not set(short.tokens) & set(eos)


def test_penalties_bias_and_logprobs_see_only_legal_tokens(tiny):
    model, tok = tiny
    c = compile_constraint("choice", ["cat", "dog"], tok)
    allowed = {tok.encode(w, add_special_tokens=False)[0] for w in ("cat", "dog")}
    dog = tok.encode("dog", add_special_tokens=False)
    params = SamplingParams(
        temperature=1.0, seed=1, logprobs=5, repetition_penalty=1.3, frequency_penalty=0.5,
        logit_bias={tok.encode("fish", add_special_tokens=False)[0]: 100.0},  # illegal: no effect
    )
    run = alone(model, request(model, tok, "Pet", max_tokens=10, constraint=c, params=params))
    assert run.text in ("cat", "dog")
    first = run.events[0]
    finite = [t for t, lp in first.top_logprobs if lp > -float("inf")]
    assert set(finite) <= allowed | set(dog)
    assert mx.isfinite(mx.array(first.logprob)).item()
    # The log-probability vector is the constrained distribution: illegal tokens are -inf.
    vec = run.logprobs[0]
    assert mx.sum(mx.isfinite(vec)).item() == len(allowed)


def test_rows_with_different_constraints_batched_equal_their_solo_runs(tiny):
    model, tok = tiny
    sampled = SamplingParams(temperature=1.0, seed=7)
    reqs = {
        "schema": request(model, tok, "One", max_tokens=60,
                          constraint=compile_constraint("json_schema", SCHEMA, tok),
                          params=sampled),
        "regex": request(model, tok, "Two two", max_tokens=30,
                         constraint=compile_constraint("regex", "[0-9]{2,6}", tok)),
        "free": request(model, tok, "Three", max_tokens=25, params=sampled),
        "choice": request(model, tok, "Four", max_tokens=10,
                          constraint=compile_constraint("choice", ["alpha", "beta"], tok),
                          params=SamplingParams(temperature=1.0, seed=3)),
    }
    widest = []
    engine = Engine(model)
    runs = drive(
        engine,
        {0: [("schema", reqs["schema"]), ("free", reqs["free"])],
         2: [("regex", reqs["regex"]), ("choice", reqs["choice"])]},
        on_step=lambda step, events: widest.append(engine.stats().decoding),
    )
    assert max(widest) >= 3
    for name, req in reqs.items():
        assert_same_run(runs[name], alone(model, req), name)
    assert valid(json.loads(runs["schema"].text))


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_speculative_rows_keep_only_legal_drafts(tiny, greedy, drafter):
    model, tok = tiny
    draft = None if drafter == "ngram" else mlx_loom.load(TINY)[0]
    params = SamplingParams() if greedy else SamplingParams(temperature=1.0, seed=5)
    c = compile_constraint("json_schema", SCHEMA, tok)
    # A prompt full of JSON-ish text gives prompt lookup drafts the grammar often rejects.
    prompt = 'x {"name":"a","age":1 and {"name":"b","pet":"cow","age":999} {"name":'
    spec = request(model, tok, prompt, max_tokens=80, constraint=c, params=params,
                   speculation=Speculation(draft, 4))
    run = alone(model, spec)
    assert valid(json.loads(run.text)), run.text
    assert any(e.from_draft for e in run.events)  # drafts were kept, and all were legal
    if greedy:  # greedy speculative output is the plain greedy output
        plain = alone(model, request(model, tok, prompt, max_tokens=80, constraint=c))
        assert run.tokens == plain.tokens


def test_bad_and_unenforceable_constraints_are_refused_naming_the_problem(tiny):
    _, tok = tiny
    with pytest.raises(RequestError, match="uniqueItems"):
        compile_constraint("json_schema", {"type": "array", "uniqueItems": True}, tok)
    with pytest.raises(RequestError, match="not valid JSON"):
        compile_constraint("json_schema", "{nope", tok)
    with pytest.raises(RequestError, match="unclosed group"):
        compile_constraint("regex", "a(b", tok)
    with pytest.raises(RequestError, match="grammar"):
        compile_constraint("grammar", "root ::= (", tok)
    with pytest.raises(RequestError, match="at most"):
        compile_constraint("choice", [str(i) for i in range(MAX_CHOICES + 1)], tok)
    with pytest.raises(RequestError, match="bytes"):
        compile_constraint("regex", "a" * (MAX_SOURCE_BYTES + 1), tok)
    with pytest.raises(RequestError, match="one constraint"):
        from_options(tok, response_format={"type": "json_object"}, grammar="start: /a/")
    with pytest.raises(RequestError, match="not supported"):
        from_options(tok, response_format={"type": "xml"})


def test_a_grammar_over_the_compile_budget_is_refused(tiny, monkeypatch):
    _, tok = tiny
    from mlx_loom.engine import constraints

    # A large (uncached) grammar against a tiny wall-clock budget.
    monkeypatch.setattr(constraints, "COMPILE_SECONDS", 0.001)
    words = " | ".join(f'"w{i}x"' for i in range(4000))
    with pytest.raises(RequestError, match="budget"):
        compile_constraint("grammar", f"start: {words}", tok)
    # Past the parser's limits: nesting deeper than the compiler allows.
    deep = '{"type":"array","items":' * 500 + "{}" + "}" * 500
    with pytest.raises(RequestError, match="recursion limit"):
        compile_constraint("json_schema", deep, tok)


def test_compiled_constraints_are_cached_per_spec(tiny):
    _, tok = tiny
    a = compile_constraint("json_schema", {"type": "object", "properties": {"a": {}}}, tok)
    b = compile_constraint("json_schema", '{"properties": {"a": {}}, "type": "object"}', tok)
    assert a is b


FAMILIES = ["llama", "qwen3_next", "qwen3_5", "gemma4_text", "gemma4"]
#: A schema the test tokenizers (lower-case letters, digits, JSON punctuation) can write.
SMALL = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "w": {"enum": ["red", "blue"]}},
    "required": ["n", "w"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    from mlx_loom.testing.checkpoints import write_checkpoint

    claim = mlx_loom.default_host().registry.model_types[request.param]
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    cfg = claim.tiny_config
    write_checkpoint(path, cfg, claim.checkpoint_tensors(cfg), tokenizer=True)
    return mlx_loom.load(path)


def test_every_family_holds_sampled_rows_to_their_constraints_batched_as_alone(family):
    model, tok = family
    small = compile_constraint("json_schema", SMALL, tok)
    digits = compile_constraint("regex", "[0-9]{3,5}", tok)
    reqs = {
        f"s{seed}": request(model, tok, "the cat", max_tokens=40, constraint=small,
                            params=SamplingParams(temperature=1.0, seed=seed))
        for seed in range(3)
    }
    reqs["d"] = request(model, tok, "a dog ran", max_tokens=12, constraint=digits,
                        params=SamplingParams(temperature=1.0, seed=9))
    reqs["free"] = request(model, tok, "the sun", max_tokens=8)
    runs = drive(Engine(model), {0: list(reqs.items())})
    for name, req in reqs.items():
        assert_same_run(runs[name], alone(model, req), name)
    for seed in range(3):
        value = json.loads(runs[f"s{seed}"].text)
        assert set(value) == {"n", "w"} and 0 <= value["n"] <= 99 and value["w"] in ("red", "blue")
    assert re.fullmatch("[0-9]{3,5}", runs["d"].text)


def test_a_grammar_the_tokenizer_cannot_write_is_refused_or_fails_its_row_alone(family):
    """The test tokenizers have no token for '<': text the grammar forces from the start
    is refused before any work; a dead end met later fails that row, not the batch."""
    model, tok = family
    with pytest.raises(RequestError, match="cannot write"):
        compile_constraint("regex", "ab<cd>", tok)
    late = compile_constraint("regex", "[ab]<c>", tok)
    runs = drive(Engine(model), {0: [
        ("late", request(model, tok, "the cat", max_tokens=8, constraint=late)),
        ("free", request(model, tok, "the dog", max_tokens=6)),
    ]})
    assert runs["late"].done.outcome == "failed"
    assert "broke the regex constraint" in str(runs["late"].done.error)
    assert runs["free"].done.outcome == "finished" and len(runs["free"].tokens) == 6

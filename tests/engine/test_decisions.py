"""One place per decision: the request validator, a row's token picking, the service's turns.

``make_request`` is the one validator every door uses: its errors name the
request field (``param``) and a reason (``code``), which is all a front end
needs to answer in its own format. A row's logits processing and sampling
(:class:`~mlx_loom.engine.next_token.TokenPicker`) are the same code for
plain and speculative steps. How the engine thread takes its turns is a
policy object, which is how a split model's service differs.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom.engine import EngineService, Speculation, make_request, request
from mlx_loom.engine.next_token import TokenPicker
from mlx_loom.engine.service import Turns
from mlx_loom.errors import RequestError
from mlx_loom.generation import SamplingParams
from mlx_loom.engine.lockstep_service import LockstepService


@pytest.fixture
def llama(loaded):
    return loaded("llama")


def _error(model, tokenizer, prompt, **options) -> RequestError:
    with pytest.raises(RequestError) as info:
        make_request(model, tokenizer, prompt, **options)
    return info.value


@pytest.mark.parametrize(
    ("prompt", "options", "param", "code"),
    [
        ("", {}, "prompt", "empty_prompt"),
        ([1, 10**6], {}, "prompt", "invalid_token"),
        ([1, 2], {"max_tokens": 0}, "max_tokens", None),
        ([1, 2], {"stop": ["ok", ""]}, "stop", None),
        ([1, 2], {"params": SamplingParams(logit_bias={10**6: 1.0})}, "logit_bias", None),
        ([1, 2], {"speculation": Speculation(None, 0)}, "num_draft_tokens", None),
        ([1, 2], {"speculation": Speculation(None, 3, 1, 2)}, "ngram_min", None),
    ],
)
def test_a_bad_request_names_its_field_and_reason(llama, prompt, options, param, code):
    model, tokenizer = llama
    err = _error(model, tokenizer, prompt, **options)
    assert (err.param, err.code) == (param, code)


def test_a_prompt_that_fills_the_context_is_refused_by_name(llama):
    model, tokenizer = llama
    err = _error(model, tokenizer, [1] * model.context_length)
    assert (err.param, err.code) == ("prompt", "context_length_exceeded")
    assert "leaves no room" in err.message


def test_sampling_errors_name_the_option():
    with pytest.raises(RequestError) as bad:
        SamplingParams.parse(top_p=0)
    with pytest.raises(RequestError) as unknown:
        SamplingParams.parse(temp=0.5)
    assert bad.value.param == "top_p"
    assert (unknown.value.param, unknown.value.code) == ("temp", "unknown_parameter")


def test_an_integer_options_bounds_are_the_ones_its_table_declares(llama, monkeypatch):
    model, tokenizer = llama
    make_request(model, tokenizer, [1, 2], max_tokens=6)
    monkeypatch.setitem(request.INT_BOUNDS, "max_tokens", (1, 5))
    err = _error(model, tokenizer, [1, 2], max_tokens=6)
    assert err.param == "max_tokens" and "from 1 to 5" in err.message


def test_a_rows_processors_see_its_history_then_each_drafts_prefix(llama):
    model, tokenizer = llama
    seen: list[tuple[str, list[int]]] = []

    def recorder(name):
        def processor(tokens: mx.array, logits: mx.array) -> mx.array:
            seen.append((name, tokens.tolist()))
            return logits + 1.0

        return processor

    req = make_request(model, tokenizer, [3, 4], logits_processors=[recorder("request")])
    picker = TokenPicker(req, extra=[recorder("row")])
    out = picker.process(mx.zeros((3, model.vocab_size)), drafts=[7, 8])
    mx.eval(out)
    assert seen == [
        ("request", [3, 4]),
        ("row", [3, 4]),
        ("request", [3, 4, 7]),
        ("row", [3, 4, 7]),
        ("request", [3, 4, 7, 8]),
        ("row", [3, 4, 7, 8]),
    ]
    assert mx.array_equal(out, mx.full((3, model.vocab_size), 2.0)).item()
    picker.note([9])
    picker.note(mx.array([10], mx.uint32))
    assert picker.history is not None and picker.history.tolist() == [3, 4, 9, 10]


def test_a_row_without_processors_keeps_no_history(llama):
    model, tokenizer = llama
    picker = TokenPicker(make_request(model, tokenizer, [3, 4]))
    picker.note([5])
    assert picker.history is None and picker.greedy


class _Counting(Turns):
    def __init__(self) -> None:
        self.engines = 0
        self.posted: list[str] = []

    def new_engine(self):
        self.engines += 1
        return super().new_engine()

    def admit(self, command) -> bool:
        self.posted.append(command[0])
        return command[0] != "configure"


def test_a_service_runs_the_turn_policy_it_is_given(llama):
    model, tokenizer = llama
    turns = _Counting()
    service = EngineService(model, turns=turns)
    try:
        service.configure(prompt_cache_size=3)  # posted, and this policy drops it
        handle = service.submit(make_request(model, tokenizer, [1, 2, 3], max_tokens=4))
        tokens = [event.token for event in handle]
    finally:
        service.close(timeout=10)
    plain = model.engine.submit(make_request(model, tokenizer, [1, 2, 3], max_tokens=4))
    assert tokens == [event.token for event in plain]
    assert turns.engines == 1 and turns.posted == ["configure"]


def test_the_lock_step_service_overrides_no_private_method_of_the_engine_service():
    overridden = [
        name
        for name in vars(LockstepService)
        if name.startswith("_") and not name.startswith("__") and hasattr(EngineService, name)
    ]
    assert overridden == []

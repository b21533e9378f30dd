"""Request values a remote client chooses: each costs linear work and gets a typed 400.

Before these bounds, a tool list with one duplicate name took minutes of CPU
to refuse (a ``names.count`` per name), and integers and floats that Python
holds exactly but the engine cannot (``penalty_context_size: 10**18``,
``temperature: 1e308``, ``logit_bias: 1e39``) were a 500 or a body holding
bare ``NaN``/``-Infinity``, which strict JSON parsers reject.
"""

from __future__ import annotations

import json
import math

import pytest

from .bounded import run_bounded
from .test_server_prompts import SERVER_IN_CHILD

#: The request body limit of ``loom serve`` (``MAX_BODY_BYTES``).
BODY_LIMIT = 8 * 1024 * 1024


@pytest.mark.slow
def test_preparing_the_largest_tool_list_the_body_limit_admits_is_linear(family_dirs):
    # ~150,000 tools fill the 8 MiB body; one duplicate name makes the check
    # find it. Quadratic, this took about 6 minutes of CPU; linear, seconds.
    code = (
        SERVER_IN_CHILD
        + """
n = ARGS["limit"] // 56
tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]
tools.append({"type": "function", "function": {"name": "f7"}})
body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
size = len(json.dumps(body))
assert ARGS["limit"] * 0.9 < size <= ARGS["limit"], size
RESULT = {"reply": post("/v1/chat/completions", body), "size": size}
server.stop()
"""
    )
    outcome = run_bounded(
        code,
        args={"path": str(family_dirs["llama"]), "limit": BODY_LIMIT},
        timeout_s=120,
        memory_mb=3072,
    )
    result = outcome.expect_ok()
    reply = result["reply"]
    assert reply["status"] == 400, reply
    error = reply["body"]["error"]
    assert error["code"] == "invalid_parameter" and error["param"] == "tools"
    assert "'f7'" in error["message"]
    # A generous bound for a shared, loaded machine: linear work is ~10 s here.
    assert reply["seconds"] < 60, reply["seconds"]


# --- numbers: bounded where they are validated, in the engine's float32 -------------------

#: ``(request fields, the parameter named)``: each was a 500, or a body with bare
#: ``NaN``/``-Infinity``, or degenerate text, before the bounds.
HOSTILE_VALUES = [
    ({"penalty_context_size": 10**18, "repetition_penalty": 1.1}, "penalty_context_size"),
    ({"penalty_context_size": 2**31, "presence_penalty": 0.5}, "penalty_context_size"),
    ({"top_k": 10**18}, "top_k"),
    ({"min_tokens_to_keep": 10**18, "min_p": 0.1}, "min_tokens_to_keep"),
    ({"presence_penalty": -1e308}, "presence_penalty"),
    ({"frequency_penalty": 1e39}, "frequency_penalty"),
    ({"repetition_penalty": 1e-45}, "repetition_penalty"),
    ({"logit_bias": {"5": 1e39}}, "logit_bias"),
    ({"temperature": 1e308}, "temperature"),
    ({"temperature": 1e-45}, "temperature"),
]


@pytest.fixture(scope="module")
def loaded(family_dirs):
    import mlx_loom

    return mlx_loom.load(family_dirs["llama"])


@pytest.fixture(scope="module")
def served(loaded):
    from ..server.conftest import serve

    model, tokenizer = loaded
    yield from serve(model, tokenizer)


@pytest.mark.parametrize(("fields", "param"), HOSTILE_VALUES)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_value_past_the_engines_range_is_a_400_naming_it(served, fields, param, path):
    body = {"max_tokens": 4, **fields}
    if path == "/v1/completions":
        body["prompt"] = "hello"
    else:
        body["messages"] = [{"role": "user", "content": "hello"}]
    reply = served.post(path, body)
    assert reply.status == 400, reply.text
    assert reply.error["param"] == param, reply.error
    assert param in reply.error["message"] and reply.error["fix"]


@pytest.mark.parametrize(("fields", "param"), HOSTILE_VALUES)
def test_the_python_api_raises_the_same_typed_error(loaded, fields, param):
    import mlx_loom
    from mlx_loom.errors import RequestError

    model, tokenizer = loaded
    options = dict(fields)
    if "logit_bias" in options:
        options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
    with pytest.raises(RequestError) as info:
        mlx_loom.generate(model, tokenizer, "hello", max_tokens=2, **options)
    assert param in info.value.message and info.value.fix


@pytest.mark.parametrize("name", ["max_tokens", "prefill_step_size", "max_kv_size"])
def test_python_api_counts_are_bounded_too(loaded, name):
    import mlx_loom
    from mlx_loom.errors import RequestError

    model, tokenizer = loaded
    with pytest.raises(RequestError, match=name):
        mlx_loom.generate(model, tokenizer, "hello", **{"max_tokens": 2, name: 10**18})


def test_the_largest_values_allowed_still_generate_finite_logprobs(served):
    body = {
        "prompt": "hello",
        "max_tokens": 3,
        "logprobs": 5,
        "temperature": 2.0**-64,
        "penalty_context_size": 2**31 - 1,
        "repetition_penalty": 2.0**64,
        "presence_penalty": -(2.0**64),
        "logit_bias": {"5": 2.0**64},
    }
    reply = served.post("/v1/completions", body)
    assert reply.status == 200, reply.text
    strict = json.loads(reply.text, parse_constant=_refuse_constant)
    logprobs = strict["choices"][0]["logprobs"]
    assert all(math.isfinite(v) for v in logprobs["token_logprobs"])


def _refuse_constant(name: str):
    raise AssertionError(f"the body holds a bare {name}, which is not JSON")


class _NonFiniteWorker:
    """Answers every job with one token whose log-probabilities are not finite."""

    alive = True
    busy = False
    queued = 0

    def submit(self, job) -> None:
        from mlx_loom.serve.worker import END, Piece

        job.events.put(
            Piece(
                text="x",
                token=5,
                logprob=float("-inf"),
                top_logprobs=[(5, float("-inf")), (6, float("nan"))],
                prompt_tokens=len(job.prompt),
                generation_tokens=1,
                cached_tokens=0,
                finish_reason="stop",
            )
        )
        job.events.put(END)

    def close(self) -> None:
        self.alive = False


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_finite_logprobs_are_sent_as_the_documented_floor(loaded, path, stream):
    from mlx_loom.serve import make_server
    from mlx_loom.serve.wire import LOGPROB_FLOOR

    from ..server.conftest import Client

    model, tokenizer = loaded
    server = make_server(model, tokenizer, port=0)
    server.app.worker.close()
    server.app.worker = _NonFiniteWorker()
    server.start_in_background()
    try:
        if path == "/v1/completions":
            body = {"prompt": "hi", "logprobs": 2}
        else:
            body = {
                "messages": [{"role": "user", "content": "hi"}],
                "logprobs": True,
                "top_logprobs": 2,
            }
        reply = Client(server).post(path, {**body, "max_tokens": 2, "stream": stream})
        assert reply.status == 200, reply.text
        text = reply.text
        for line in text.splitlines() if stream else [text]:
            data = line.removeprefix("data: ") if stream else line
            if not data or data == "[DONE]":
                continue
            json.loads(data, parse_constant=_refuse_constant)
        assert str(LOGPROB_FLOOR) in text
    finally:
        server.stop()


# --- the size of an answer ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_answer_past_the_entry_bound_is_refused_before_generating(served, path):
    # 16 choices x 4,000 tokens x 21 entries: a 38 MB answer from a 110-byte request.
    if path == "/v1/completions":
        body = {"prompt": "hi", "logprobs": 20}
        field = "logprobs"
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
        body["top_logprobs"] = 20
        field = "top_logprobs"
    reply = served.post(path, {**body, "n": 16, "max_tokens": 4000})
    assert reply.status == 400, reply.text
    error = reply.error
    assert error["code"] == "response_too_large" and error["param"] == "max_tokens"
    assert "131072" in error["message"] and field in error["message"] and error["fix"]


def test_the_entry_bound_is_exact_and_configurable(loaded):
    from ..server.conftest import serve

    model, tokenizer = loaded
    for client in serve(model, tokenizer, max_response_entries=60):
        base = {"prompt": "hi", "logprobs": 2, "n": 2}
        assert client.post("/v1/completions", {**base, "max_tokens": 10}).status == 200
        reply = client.post("/v1/completions", {**base, "max_tokens": 11})
        assert reply.status == 400 and reply.error["code"] == "response_too_large"

"""CORS for allowed origins (preflight included) and the optional API key."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

import mlx_loom
from mlx_loom.cli.main import build_parser
from mlx_loom.serve import ServerStartError, make_server

from .conftest import Client, serve

KEY = "s3cret-key"
ORIGIN = "http://localhost:3000"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def guarded(checkpoint) -> Iterator[Client]:
    model, tokenizer = mlx_loom.load(checkpoint)
    yield from serve(model, tokenizer, model_id="m", api_key=KEY, allowed_origins=[ORIGIN])


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/m"])
def test_without_the_key_the_api_answers_401_with_a_json_body(guarded, path):
    reply = guarded.get(path)
    assert reply.status == 401
    assert reply.headers["Content-Type"] == "application/json"
    assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    error = reply.error
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert "sent none" in error["message"] and "--api-key" in error["fix"]


def test_a_wrong_key_is_a_401_that_says_so(guarded):
    reply = guarded.request("POST", "/v1/chat/completions", CHAT, headers=bearer("nope"))
    assert reply.status == 401 and "different one" in reply.error["message"]


def test_the_right_key_is_served_as_bearer_or_x_api_key(guarded):
    assert guarded.request("POST", "/v1/chat/completions", CHAT, headers=bearer(KEY)).status == 200
    assert guarded.request("GET", "/v1/models", headers={"x-api-key": KEY}).status == 200


def test_the_openai_and_anthropic_clients_authenticate_with_the_key(guarded):
    url = guarded.server.url
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert ok.models.list().data[0].id == "m"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="bad", max_retries=0).models.list()
    message = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.type == "message"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="bad", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )


def test_a_401_on_messages_has_anthropics_error_shape(guarded):
    reply = guarded.post("/v1/messages", {"max_tokens": 2, "messages": []})
    assert reply.status == 401
    assert reply.json["type"] == "error" and reply.json["error"]["type"] == "authentication_error"


def test_the_chat_page_and_health_need_no_key(guarded):
    assert guarded.get("/").status == 200
    assert guarded.get("/health").status == 200


def test_an_allowed_origin_gets_cors_headers(guarded):
    reply = guarded.request("GET", "/health", headers={"Origin": ORIGIN})
    assert reply.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert reply.headers["Vary"] == "Origin"


def test_another_origin_gets_none(guarded):
    reply = guarded.request("GET", "/health", headers={"Origin": "http://evil.example"})
    assert reply.status == 200 and "Access-Control-Allow-Origin" not in reply.headers


def test_a_preflight_from_an_allowed_origin_needs_no_key_and_lists_what_may_follow(guarded):
    reply = guarded.request(
        "OPTIONS",
        "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert reply.status == 204 and reply.text == ""
    assert reply.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in reply.headers["Access-Control-Allow-Methods"]
    assert reply.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert int(reply.headers["Access-Control-Max-Age"]) > 0


def test_a_preflight_from_another_origin_is_a_403(guarded):
    reply = guarded.request("OPTIONS", "/v1/models", headers={"Origin": "http://evil.example"})
    assert reply.status == 403 and reply.error["code"] == "origin_not_allowed"


def test_a_preflight_for_an_unknown_path_is_a_404(guarded):
    reply = guarded.request("OPTIONS", "/v1/nothing", headers={"Origin": ORIGIN})
    assert reply.status == 404


def test_streams_carry_the_cors_header_too(guarded):
    reply = guarded.request(
        "POST",
        "/v1/chat/completions",
        {**CHAT, "stream": True},
        headers={"Origin": ORIGIN, **bearer(KEY)},
    )
    assert reply.headers["Content-Type"] == "text/event-stream"
    assert reply.headers["Access-Control-Allow-Origin"] == ORIGIN


def test_any_origin_with_a_star(checkpoint):
    model, tokenizer = mlx_loom.load(checkpoint)
    for c in serve(model, tokenizer, allowed_origins=["*"]):
        reply = c.request("GET", "/v1/models", headers={"Origin": "http://anywhere.example"})
        assert reply.headers["Access-Control-Allow-Origin"] == "*"


def test_by_default_no_origin_is_allowed(client):
    reply = client.request("GET", "/v1/models", headers={"Origin": ORIGIN})
    assert "Access-Control-Allow-Origin" not in reply.headers


def test_an_empty_api_key_is_refused_at_start(checkpoint):
    model, tokenizer = mlx_loom.load(checkpoint)
    with pytest.raises(ServerStartError):
        make_server(model, tokenizer, port=0, api_key=" ")


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_an_out_of_range_port_is_a_usage_error(port, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--port", port])
    assert info.value.code == 2
    assert "--port" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--allowed-origins", "http://a.example", "http://b.example"], 2),
        (["--allowed-origins", "http://a.example,http://b.example"], 2),
        (["--allowed-origins", "*"], 1),
        ([], 0),
    ],
)
def test_allowed_origins_are_listed_by_spaces_or_commas(argv, expected):
    assert len(build_parser().parse_args(["serve", *argv]).allowed_origins) == expected


@pytest.mark.parametrize("value", ["{not json", "[1, 2]"])
def test_chat_template_args_must_be_a_json_object(value, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--chat-template-args", value])
    assert info.value.code == 2
    assert "--chat-template-args" in capsys.readouterr().err


def test_the_api_key_can_come_from_the_environment(checkpoint, monkeypatch):
    from mlx_loom.cli import serve_cmd

    monkeypatch.setenv(serve_cmd.API_KEY_ENV, KEY)
    seen = {}

    def fake_make_server(**options):
        seen.update(options)
        raise ServerStartError("stop here", fix="none")

    monkeypatch.setattr(serve_cmd, "make_server", fake_make_server)
    from mlx_loom.cli.main import main

    assert main(["serve", "--model", str(checkpoint), "--port", "0"]) == 1
    assert seen["api_key"] == KEY

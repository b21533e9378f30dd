"""Bad requests get a 4xx with an OpenAI-style error body; the server keeps serving."""

from __future__ import annotations

import json
import shutil
import socket

import pytest

import mlx_loom
from mlx_loom.errors import CapabilityRefused, RequestError
from mlx_loom.generation import SamplingParams
from mlx_loom.serve import MAX_BODY_BYTES

from .conftest import CONTEXT, MODEL_ID, serve

PROMPT = "the model reads a token"
CHAT = [{"role": "user", "content": "hello"}]


def assert_error_body(reply, status: int, *, param: str | None = None) -> dict:
    assert reply.status == status, reply.text
    assert reply.headers["Content-Type"] == "application/json"
    error = reply.error
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def test_malformed_json_is_a_400(client):
    reply = client.request("POST", "/v1/completions", raw=b'{"prompt": "x",')
    error = assert_error_body(reply, 400)
    assert error["code"] == "invalid_json" and "not valid JSON" in error["message"]


def test_a_json_body_that_is_not_an_object_is_a_400(client):
    reply = client.post("/v1/completions", ["prompt"])
    assert "must be a JSON object" in assert_error_body(reply, 400)["message"]


def test_unknown_parameter_is_named_with_a_suggestion(client):
    reply = client.post("/v1/completions", {"prompt": PROMPT, "temp": 0.5})
    error = assert_error_body(reply, 400, param="temp")
    assert "'temperature'" in error["message"] and error["code"] == "unknown_parameter"


def test_invalid_sampling_value_carries_sampling_params_message(client):
    with pytest.raises(RequestError) as expected:
        SamplingParams.parse(temperature=-1)
    reply = client.post("/v1/completions", {"prompt": PROMPT, "temperature": -1})
    error = assert_error_body(reply, 400, param="temperature")
    assert error["message"].startswith(expected.value.message)
    assert error["fix"] == expected.value.fix


def test_invalid_top_p_names_top_p(client):
    reply = client.post("/v1/chat/completions", {"messages": CHAT, "top_p": 0, "seed": 1})
    assert "top_p" in assert_error_body(reply, 400, param="top_p")["message"]


def test_mistyped_structural_field_is_a_400(client):
    reply = client.post("/v1/completions", {"prompt": PROMPT, "max_tokens": "5"})
    assert_error_body(reply, 400, param="max_tokens")


def test_max_tokens_above_the_server_limit_is_a_400(client):
    reply = client.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**6})
    assert "max-tokens-limit" in assert_error_body(reply, 400, param="max_tokens")["message"]


def test_missing_prompt_is_a_400(client):
    reply = client.post("/v1/completions", {"max_tokens": 3})
    assert assert_error_body(reply, 400, param="prompt")["code"] == "missing_parameter"


def test_empty_prompt_is_a_400(client):
    reply = client.post("/v1/completions", {"prompt": ""})
    assert assert_error_body(reply, 400, param="prompt")["code"] == "empty_prompt"


def test_empty_token_list_prompt_is_a_400(client):
    assert_error_body(client.post("/v1/completions", {"prompt": []}), 400, param="prompt")


def test_empty_messages_is_a_400(client):
    assert_error_body(client.post("/v1/chat/completions", {"messages": []}), 400, param="messages")


def test_prompt_longer_than_the_context_is_a_400(client):
    reply = client.post("/v1/completions", {"prompt": [5] * (CONTEXT + 1), "max_tokens": 1})
    error = assert_error_body(reply, 400, param="prompt")
    assert error["code"] == "context_length_exceeded" and str(CONTEXT) in error["message"]


def test_token_outside_the_vocabulary_is_a_400(client):
    reply = client.post("/v1/completions", {"prompt": [1, 10**6]})
    assert assert_error_body(reply, 400, param="prompt")["code"] == "invalid_token"


def test_logit_bias_key_that_is_not_a_token_id_is_a_400(client):
    reply = client.post("/v1/completions", {"prompt": PROMPT, "logit_bias": {"abc": 1}})
    assert_error_body(reply, 400, param="logit_bias")


def test_logit_bias_outside_the_vocabulary_is_a_400(client):
    reply = client.post("/v1/completions", {"prompt": PROMPT, "logit_bias": {"99999": 1}})
    assert "vocabulary" in assert_error_body(reply, 400, param="logit_bias")["message"]


def test_empty_stop_string_is_a_400(client):
    reply = client.post("/v1/completions", {"prompt": PROMPT, "stop": ["ok", ""]})
    assert_error_body(reply, 400, param="stop")


@pytest.mark.parametrize("n", [0, 17])
def test_a_choice_count_outside_1_to_16_is_a_400(client, n):
    reply = client.post("/v1/completions", {"prompt": PROMPT, "n": n})
    assert "[1, 16]" in assert_error_body(reply, 400, param="n")["message"]


def test_top_logprobs_without_logprobs_is_a_400(client):
    body = {"messages": CHAT, "top_logprobs": 2}
    assert_error_body(client.post("/v1/chat/completions", body), 400, param="top_logprobs")


def test_stream_options_without_stream_is_a_400(client):
    body = {"prompt": PROMPT, "stream_options": {"include_usage": True}}
    assert_error_body(client.post("/v1/completions", body), 400, param="stream_options")


def test_image_content_is_refused_with_a_400(client):
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    body = {"messages": [{"role": "user", "content": [image]}]}
    reply = client.post("/v1/chat/completions", body)
    assert assert_error_body(reply, 400, param="messages[0].content")["code"] == (
        "unsupported_content"
    )


def test_another_model_name_is_a_404(client):
    reply = client.post("/v1/completions", {"model": "gpt-4o", "prompt": PROMPT})
    error = assert_error_body(reply, 404, param="model")
    assert error["code"] == "model_not_found" and MODEL_ID in error["message"]


def test_unknown_route_is_a_404(client):
    reply = client.get("/v1/embeddings")
    assert assert_error_body(reply, 404)["type"] == "not_found_error"


def test_get_on_a_post_endpoint_is_a_405(client):
    reply = client.get("/v1/completions")
    assert_error_body(reply, 405)
    assert reply.headers["Allow"] == "POST"


def test_post_on_a_get_endpoint_is_a_405(client):
    reply = client.post("/v1/models", {})
    assert_error_body(reply, 405)
    assert reply.headers["Allow"] == "GET"


def test_oversized_body_is_a_413_without_reading_it(client):
    conn = client.connect()
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
        conn.endheaders()
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 413 and body["error"]["code"] == "body_too_large"


def test_missing_content_length_is_a_411(client):
    with socket.create_connection(("127.0.0.1", client.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 411")
    assert b'"length_required"' in data


def test_capability_refusal_is_a_422_with_the_refusal(client, monkeypatch):
    refusal = CapabilityRefused("text generation needs capability 'generate'.", fix="use X")

    def refuse(capability, *, asked):
        raise refusal

    monkeypatch.setattr(client.server.app.model, "require", refuse)
    reply = client.post("/v1/completions", {"prompt": PROMPT})
    error = assert_error_body(reply, 422)
    assert error["type"] == "refusal" and error["code"] == "CapabilityRefused"
    assert error["message"].startswith(refusal.message) and error["fix"] == "use X"


def test_chat_with_a_model_without_a_template_is_a_400_with_the_fix(checkpoint, tmp_path):
    plain = shutil.copytree(checkpoint, tmp_path / "plain")
    config_path = plain / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    model, tokenizer = mlx_loom.load(plain)
    assert not tokenizer.has_chat_template
    for other in serve(model, tokenizer):
        reply = other.post("/v1/chat/completions", {"messages": CHAT})
        error = assert_error_body(reply, 400, param="messages")
        assert error["code"] == "no_chat_template"
        assert "chat_template" in error["fix"] and "/v1/completions" in error["fix"]
        # The raw-prompt endpoint still serves it.
        assert other.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status == 200


def test_the_server_still_serves_after_every_bad_request(client):
    reply = client.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert reply.status == 200 and reply.json["usage"]["completion_tokens"] == 3
    assert client.server.app.worker.alive

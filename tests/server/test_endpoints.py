"""The OpenAI-compatible endpoints: models, health, completions, chat, streaming."""

from __future__ import annotations

import mlx_loom
from mlx_loom.generation import stream_generate

from .conftest import MODEL_ID

PROMPT = "the model reads a token"
CHAT = [{"role": "user", "content": "hello world"}]


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_models_lists_the_served_model(client):
    reply = client.get("/v1/models")
    assert reply.status == 200
    assert reply.json["object"] == "list"
    assert [m["id"] for m in reply.json["data"]] == [MODEL_ID]
    assert reply.json["data"][0]["object"] == "model"


def test_model_card_answers_for_the_served_id(client):
    reply = client.get(f"/v1/models/{MODEL_ID}")
    assert reply.status == 200 and reply.json["id"] == MODEL_ID


def test_health_reports_ok_and_the_model(client):
    reply = client.get("/health")
    assert reply.status == 200
    assert reply.json["status"] == "ok" and reply.json["model"] == MODEL_ID


def test_completion_has_the_openai_shape_and_usage(client, oracle):
    reply = client.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
    assert reply.status == 200
    body = reply.json
    assert body["object"] == "text_completion" and body["model"] == MODEL_ID
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    prompt_tokens = len(oracle[1].encode_prompt(PROMPT))
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["total_tokens"] == prompt_tokens + 8


def test_greedy_completion_equals_mlx_loom_generate(client, oracle):
    model, tokenizer = oracle
    expected = mlx_loom.generate(model, tokenizer, PROMPT, max_tokens=16)
    reply = client.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 16})
    assert reply.json["choices"][0]["text"] == expected


def test_completion_accepts_a_token_list_prompt(client, oracle):
    model, tokenizer = oracle
    ids = tokenizer.encode_prompt(PROMPT)
    reply = client.post("/v1/completions", {"prompt": ids, "max_tokens": 10})
    assert reply.status == 200
    assert reply.json["choices"][0]["text"] == mlx_loom.generate(
        model, tokenizer, ids, max_tokens=10
    )
    assert reply.json["usage"]["prompt_tokens"] == len(ids)


def test_chat_completion_renders_the_chat_template(client, oracle):
    model, tokenizer = oracle
    ids = tokenizer.encode_chat(CHAT)
    expected = mlx_loom.generate(model, tokenizer, ids, max_tokens=12)
    reply = client.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 12})
    assert reply.status == 200
    body = reply.json
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": expected}
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_chat_content_given_as_text_parts_is_joined(client):
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
    as_parts = client.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 6}
    )
    as_text = client.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6})
    assert as_parts.status == 200
    assert as_parts.json["choices"][0]["message"] == as_text.json["choices"][0]["message"]


def test_streamed_chat_deltas_concatenate_to_the_unstreamed_text(client):
    request = {"messages": CHAT, "max_tokens": 20}
    whole = client.post("/v1/chat/completions", request).json["choices"][0]["message"]["content"]
    reply = client.post("/v1/chat/completions", {**request, "stream": True})
    assert reply.status == 200
    assert reply.headers["Content-Type"] == "text/event-stream"
    events = reply.events()
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all("usage" not in c for c in chunks)


def test_streamed_completion_texts_concatenate_to_the_unstreamed_text(client):
    request = {"prompt": PROMPT, "max_tokens": 20}
    whole = client.post("/v1/completions", request).json["choices"][0]["text"]
    events = client.post("/v1/completions", {**request, "stream": True}).events()
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stream_include_usage_ends_with_a_usage_chunk(client):
    body = {
        "prompt": PROMPT,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = client.post("/v1/completions", body).events()
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert all(c["usage"] is None for c in events[:-2])


def test_stop_string_ends_the_completion_without_it(client):
    whole = client.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 30}).json
    text = whole["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    reply = client.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 30, "stop": stop})
    choice = reply.json["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == text[: text.index(stop)]


def test_stop_list_in_a_stream_never_streams_the_stop(client):
    text = client.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 30}).json
    text = text["choices"][0]["text"]
    stop = text[10:13]
    assert stop.strip()
    body = {"prompt": PROMPT, "max_tokens": 30, "stop": ["never-there", stop], "stream": True}
    chunks = client.post("/v1/completions", body).events()[:-1]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == text[: text.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_eos_finishes_with_stop_and_counts_the_token(client, oracle):
    eos = next(iter(oracle[1].eos_token_ids))
    body = {"prompt": PROMPT, "max_tokens": 10, "logit_bias": {str(eos): 100}}
    reply = client.post("/v1/completions", body).json
    assert reply["choices"][0] == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert reply["usage"]["completion_tokens"] == 1


def test_chat_logprobs_report_the_chosen_token_and_alternatives(client, oracle):
    model, tokenizer = oracle
    ids = tokenizer.encode_chat(CHAT)
    expected = list(stream_generate(model, tokenizer, ids, max_tokens=4, logprobs=3))
    body = {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 3}
    content = client.post("/v1/chat/completions", body).json["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry, want in zip(content, expected, strict=True):
        assert entry["token"] == tokenizer.decode([want.token])
        assert abs(entry["logprob"] - want.logprob) < 1e-6
        assert [t["token"] for t in entry["top_logprobs"]] == [
            tokenizer.decode([t]) for t, _ in want.top_logprobs
        ]
        # Greedy: the chosen token is the most likely alternative.
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]


def test_completion_logprobs_use_the_legacy_parallel_lists(client):
    body = {"prompt": PROMPT, "max_tokens": 5, "logprobs": 2}
    logprobs = client.post("/v1/completions", body).json["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 5
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"][1] == len(logprobs["tokens"][0])


def test_seeded_sampling_is_reproducible(client):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 7}
    first = client.post("/v1/completions", body).json["choices"][0]["text"]
    second = client.post("/v1/completions", body).json["choices"][0]["text"]
    assert first == second


def test_a_follow_up_chat_turn_reuses_the_prompt_cache(client, oracle):
    model, tokenizer = oracle
    first = client.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6}).json
    reply = first["choices"][0]["message"]["content"]
    turn2 = [*CHAT, {"role": "assistant", "content": reply}, {"role": "user", "content": "the"}]
    second = client.post("/v1/chat/completions", {"messages": turn2, "max_tokens": 6}).json
    ids1, ids2 = tokenizer.encode_chat(CHAT), tokenizer.encode_chat(turn2)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= _common_prefix(ids1, ids2) > 0
    # Reuse changes the cost, never the tokens.
    fresh = mlx_loom.generate(model, tokenizer, ids2, max_tokens=6)
    assert second["choices"][0]["message"]["content"] == fresh


def test_an_unrelated_prompt_after_a_chat_is_still_exact(client, oracle):
    model, tokenizer = oracle
    client.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6})
    reply = client.post("/v1/completions", {"prompt": "Question: what", "max_tokens": 9}).json
    expected = mlx_loom.generate(model, tokenizer, "Question: what", max_tokens=9)
    assert reply["choices"][0]["text"] == expected


def test_request_may_name_the_served_model(client):
    reply = client.post("/v1/completions", {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 2})
    assert reply.status == 200 and reply.json["model"] == MODEL_ID


def test_max_completion_tokens_is_accepted(client):
    body = {"messages": CHAT, "max_completion_tokens": 3}
    reply = client.post("/v1/chat/completions", body)
    assert reply.json["usage"]["completion_tokens"] == 3


def test_responses_keep_the_connection_alive(client):
    conn = client.connect()
    try:
        for _ in range(2):
            conn.request("GET", "/health")
            resp = conn.getresponse()
            assert resp.status == 200
            resp.read()
    finally:
        conn.close()

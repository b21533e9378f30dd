"""/tokenize, /detokenize, Anthropic's count_tokens and /metrics, through real HTTP.

Each count is checked against what the generating endpoint feeds the model
(the prompt tokens it reports), and /metrics is read with the Prometheus
client's own parser.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import anthropic
import pytest
from prometheus_client.parser import text_string_to_metric_families

import mlx_loom
from mlx_loom.serve.metrics import ServerMetrics
from mlx_loom.serve.server import MAX_BODY_BYTES

from .conftest import Client, serve
from .formats import FORMATS, WEATHER_TOOL, write_format_checkpoint

MODEL = "tools"
USER = {"role": "user", "content": "weather in Paris?"}
WEATHER = {
    "name": "get_weather",
    "description": "The weather forecast for a city.",
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[Client]:
    path = write_format_checkpoint(tmp_path_factory.mktemp("util") / "ckpt", FORMATS["json_tools"])
    model, tokenizer = mlx_loom.load(path)
    yield from serve(model, tokenizer, model_id=MODEL, max_prompt_chars=4000)


def metrics(client: Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = client.get("/metrics")
    assert reply.status == 200, reply.text
    assert reply.headers["Content-Type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_tokenize_a_prompt_counts_what_a_completion_is_fed(client):
    reply = client.post("/tokenize", {"prompt": "hello world"})
    assert reply.status == 200, reply.text
    answer = reply.json
    assert answer["count"] == len(answer["tokens"]) > 0
    assert answer["max_model_len"] == 4096
    done = client.post("/v1/completions", {"prompt": "hello world", "max_tokens": 1})
    assert done.json["usage"]["prompt_tokens"] == answer["count"]
    # llama.cpp's field name gives the same ids; without special tokens, no BOS.
    assert client.post("/tokenize", {"content": "hello world"}).json["tokens"] == answer["tokens"]
    bare = client.post("/tokenize", {"prompt": "hello world", "add_special_tokens": False}).json
    assert bare["tokens"] == client.server.app.tokenizer.encode("hello world", False)


def test_tokenize_messages_counts_what_a_chat_completion_is_fed(client):
    body = {"messages": [USER], "tools": [WEATHER_TOOL]}
    answer = client.post("/tokenize", body).json
    done = client.post("/v1/chat/completions", {**body, "max_tokens": 1})
    assert done.status == 200, done.text
    assert done.json["usage"]["prompt_tokens"] == answer["count"]
    # Without the generation prompt the assistant's turn is not opened: fewer tokens,
    # and those that remain are the same conversation.
    closed = client.post("/tokenize", {**body, "add_generation_prompt": False}).json
    assert 0 < closed["count"] < answer["count"]
    assert answer["tokens"][: closed["count"]] == closed["tokens"]


def test_detokenize_inverts_tokenize(client):
    ids = client.post("/tokenize", {"prompt": "hello world", "add_special_tokens": False}).json
    reply = client.post("/detokenize", {"tokens": ids["tokens"]})
    assert reply.status == 200, reply.text
    assert reply.json == {"prompt": "hello world", "content": "hello world"}


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/tokenize", {}, "prompt", "invalid_parameter"),
        ("/tokenize", {"prompt": "a", "messages": [USER]}, "messages", "invalid_parameter"),
        ("/tokenize", {"prompt": "a", "tools": [WEATHER_TOOL]}, "tools", "invalid_parameter"),
        ("/tokenize", {"prompt": "x" * 4001}, "prompt", "prompt_too_long"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model", None),
        ("/tokenize", {"prompt": "a", "prompts": "b"}, "prompts", None),
        ("/detokenize", {"tokens": [1, -1]}, "tokens[1]", "invalid_token"),
        ("/detokenize", {"tokens": [10**9]}, "tokens[0]", "invalid_token"),
        ("/detokenize", {"tokens": [0] * 4097}, "tokens", "too_many_tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens", None),
    ],
)
def test_bad_utility_requests_name_the_field(client, path, body, param, code):
    reply = client.post(path, body)
    assert reply.status in (400, 404), reply.text
    error = reply.error
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_an_oversized_tokenize_body_is_refused_unread(client):
    reply = client.request(
        "POST",
        "/tokenize",
        raw=b"{}",
        headers={"Content-Length": str(MAX_BODY_BYTES + 1)},
    )
    assert reply.status == 413 and reply.error["code"] == "body_too_large"


def test_count_tokens_matches_what_messages_feeds_the_model(client):
    api = anthropic.Anthropic(base_url=client.server.url, api_key="unused", max_retries=0)
    for kwargs in (
        {"messages": [USER]},
        {"messages": [USER], "system": "Be brief.", "tools": [WEATHER]},
    ):
        counted = api.messages.count_tokens(model=MODEL, **kwargs)
        message = api.messages.create(model=MODEL, max_tokens=1, **kwargs)
        # Anthropic's usage splits the prompt into uncached and cache-read tokens.
        usage = message.usage
        assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens > 0
    # The system prompt and the tools are part of the count.
    bare = api.messages.count_tokens(model=MODEL, messages=[USER]).input_tokens
    full = api.messages.count_tokens(model=MODEL, messages=[USER], system="Be brief.")
    assert full.input_tokens > bare
    with pytest.raises(anthropic.BadRequestError) as caught:
        api.messages.count_tokens(model=MODEL, messages=[])
    assert caught.value.body["type"] == "error"  # Anthropic's error shape


def test_metrics_count_requests_tokens_and_latency(client):
    before = metrics(client)
    done = client.post("/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert done.status == 200, done.text
    usage = done.json["usage"]
    assert client.get("/v1/nothing-here").status == 404
    # The reply can reach the client a moment before the engine retires its row
    # and records its figures; /health (not counted below) shows when it has.
    deadline = time.monotonic() + 10
    while client.get("/health").json["active_rows"] and time.monotonic() < deadline:
        time.sleep(0.01)
    after = metrics(client)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("loom_requests_total", endpoint="/v1/completions", status="200") == 1
    assert moved("loom_requests_total", endpoint="unmatched", status="404") == 1
    assert moved("loom_requests_total", endpoint="/metrics", status="200") == 1
    assert moved("loom_prompt_tokens_total") == usage["prompt_tokens"]
    assert moved("loom_generation_tokens_total") == usage["completion_tokens"]
    assert moved("loom_time_to_first_token_seconds_count") == 1
    assert moved("loom_time_per_output_token_seconds_count") == usage["completion_tokens"] - 1
    # The engine's own figures are there, read at the scrape.
    assert value(after, "loom_queued_requests") == 0
    assert value(after, "loom_active_rows") == 0
    assert ("loom_prefix_cache_hits_total", ()) in after
    assert ("loom_spec_draft_tokens_total", ()) in after
    # The prefix store's figures are the ones /health shows.
    cache = client.get("/health").json["prompt_cache"]
    again = metrics(client)
    assert value(again, "loom_prefix_cache_hits_total") == cache["hits"]
    assert value(again, "loom_prefix_cache_misses_total") == cache["misses"] > 0
    assert value(again, "loom_prefix_cache_bytes") == cache["bytes"]


def test_two_servers_in_one_process_keep_their_own_metrics(client):
    # With the process-wide registry, the second would raise "Duplicated timeseries".
    stats = client.server.app.worker.stats
    first, second = ServerMetrics(stats, lambda: 0), ServerMetrics(stats, lambda: 0)
    first.request("/health", 200)
    parsed = [
        {
            sample.name: sample.value
            for family in text_string_to_metric_families(m.render().decode())
            for sample in family.samples
        }
        for m in (first, second)
    ]
    assert parsed[0]["loom_requests_total"] == 1
    assert "loom_requests_total" not in parsed[1]


def test_metrics_count_speculative_drafts_and_streamed_generations(client):
    before = metrics(client)
    # A repetitive prompt gives the n-gram drafter something to propose.
    body = {
        "prompt": "a b c a b c a b c a b c a b c",
        "max_tokens": 12,
        "draft": "ngram",
        "stream": True,
    }
    reply = client.post("/v1/completions", body)
    assert reply.status == 200 and reply.events()[-1] == "[DONE]"
    after = metrics(client)
    drafted = value(after, "loom_spec_draft_tokens_total")
    accepted = value(after, "loom_spec_accepted_tokens_total")
    assert drafted > value(before, "loom_spec_draft_tokens_total")
    assert 0 <= accepted - value(before, "loom_spec_accepted_tokens_total") <= drafted
    assert value(after, "loom_spec_accepted_tokens_total") == (
        client.server.app.worker.stats().engine.accepted_drafts
    )
    generated = value(after, "loom_generation_tokens_total") - value(
        before, "loom_generation_tokens_total"
    )
    ttft = value(after, "loom_time_to_first_token_seconds_count") - value(
        before, "loom_time_to_first_token_seconds_count"
    )
    assert generated > 0 and ttft == 1

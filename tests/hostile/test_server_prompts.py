"""Prompts too big to prepare, or too long for the context: bounded, typed, and off the
connection threads.

Before the prompt bounds and the preparation pool, a 7 MB prompt was
tokenized on its connection's thread for 9 s at 1.8 GB (as many at once as
there were clients), and prompt + ``max_tokens`` past the model's context
was generated anyway. Now prompt text past ``--max-prompt-chars`` is refused
before the tokenizer sees it, prompts past ``--max-prompt-tokens`` (default:
the context) after; preparation runs on a small pool while ``/health`` and
small requests are answered; and a generation stops at the context with
``finish_reason: "length"`` — the rule ``loom chat`` and the engine follow.
"""

from __future__ import annotations

import pytest

import mlx_loom

from ..server.conftest import Client, serve
from .bounded import run_bounded
from .conftest import FAMILIES, variant

#: The context of the served variants: short, so a prompt can nearly fill it cheaply.
CONTEXT = 64
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/messages")


def body_for(endpoint: str, text: str, **extra) -> dict:
    if endpoint == "/v1/completions":
        return {"prompt": text, **extra}
    messages = [{"role": "user", "content": text}]
    if endpoint == "/v1/messages":
        return {"messages": messages, "max_tokens": extra.pop("max_tokens", 4), **extra}
    return {"messages": messages, **extra}


def error_of(reply, endpoint: str) -> dict:
    """The error object, from either API's error shape."""
    assert reply.status == 400, reply.text
    if endpoint == "/v1/messages":
        return reply.json["error"]
    return reply.error


@pytest.fixture(scope="module", params=FAMILIES)
def short_context(request, family_dirs, tmp_path_factory):
    """Each family's tiny model with a 64-token context, loaded once."""
    path = variant(
        family_dirs[request.param],
        tmp_path_factory.mktemp(f"short-{request.param}") / "m",
        config=lambda c: c.update(max_position_embeddings=CONTEXT),
    )
    return mlx_loom.load(path)


@pytest.fixture(scope="module")
def served(short_context) -> Client:
    model, tokenizer = short_context
    yield from serve(model, tokenizer, max_prompt_chars=2000, max_prompt_tokens=48)


# --- the bounds, through each endpoint and family ---------------------------------------


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_prompt_text_past_max_prompt_chars_is_refused_naming_the_flag(served, endpoint):
    reply = served.post(endpoint, body_for(endpoint, "a" * 2001))
    message = error_of(reply, endpoint)["message"]
    assert "--max-prompt-chars" in message and "2000 characters" in message
    if endpoint != "/v1/messages":
        assert reply.error["code"] == "prompt_too_long" and reply.error["fix"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_prompt_past_max_prompt_tokens_is_refused_naming_the_flag(served, endpoint):
    reply = served.post(endpoint, body_for(endpoint, "a b " * 100))
    message = error_of(reply, endpoint)["message"]
    assert "--max-prompt-tokens" in message and "at most 48 tokens" in message


def test_a_token_id_prompt_past_max_prompt_tokens_is_refused(served):
    reply = served.post("/v1/completions", {"prompt": [1] * 49})
    assert reply.status == 400 and reply.error["code"] == "prompt_too_long"


def test_a_prompt_that_fills_the_context_is_refused(short_context):
    model, tokenizer = short_context
    for client in serve(model, tokenizer):
        reply = client.post("/v1/completions", {"prompt": [1] * CONTEXT})
        assert reply.status == 400 and reply.error["code"] == "context_length_exceeded"
        assert "leaves no room" in reply.error["message"]
        assert f"fewer than {CONTEXT} tokens" in reply.error["fix"]


# --- prompt + max_tokens past the context ----------------------------------------------------


def test_a_completion_stops_at_the_context_with_finish_reason_length(short_context):
    model, tokenizer = short_context
    prompt = list(range(3, 3 + CONTEXT - 5))  # leaves room for 5 tokens
    no_eos = {str(t): -100 for t in tokenizer.eos_token_ids}
    expected = mlx_loom.generate(
        model, tokenizer, prompt, max_tokens=5, logit_bias={int(k): v for k, v in no_eos.items()}
    )
    for client in serve(model, tokenizer):
        reply = client.post(
            "/v1/completions", {"prompt": prompt, "max_tokens": 40, "logit_bias": no_eos}
        )
        assert reply.status == 200, reply.text
        choice, usage = reply.json["choices"][0], reply.json["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (CONTEXT - 5, 5)
        assert choice["finish_reason"] == "length"
        assert choice["text"] == expected  # what the API gives with max_tokens at the room


def test_a_chat_stops_at_the_context_with_finish_reason_length(short_context):
    model, tokenizer = short_context
    messages = [{"role": "user", "content": "hi"}]
    room = CONTEXT - len(tokenizer.encode_chat(messages))
    assert room > 0
    no_eos = {str(t): -100 for t in tokenizer.eos_token_ids}
    for client in serve(model, tokenizer):
        body = {"messages": messages, "max_tokens": CONTEXT, "logit_bias": no_eos}
        reply = client.post("/v1/chat/completions", body)
        assert reply.status == 200, reply.text
        assert reply.json["usage"]["completion_tokens"] == room
        assert reply.json["choices"][0]["finish_reason"] == "length"
        # Streamed, the same cut and the same reason.
        streamed = client.post("/v1/chat/completions", {**body, "stream": True}).events()
        reasons = [c["choices"][0]["finish_reason"] for c in streamed[:-1] if c["choices"]]
        assert reasons[-1] == "length"


def test_a_message_stops_at_the_context_and_never_passes_it(short_context):
    model, tokenizer = short_context
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT}
    for client in serve(model, tokenizer):
        reply = client.post("/v1/messages", body)
        assert reply.status == 200, reply.text
        usage = reply.json["usage"]
        total = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["output_tokens"]
        assert total <= CONTEXT
        if total == CONTEXT:
            assert reply.json["stop_reason"] == "max_tokens"


# --- huge prompts: bounded in time and memory, and others are served meanwhile ----------------

SERVER_IN_CHILD = """
import http.client, json, threading, time
import mlx_loom
from mlx_loom.serve import make_server

def status_mb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024

def growth_mb():  # the peak resident memory since the baseline (VmHWM reset there), above it
    return status_mb("VmHWM") - baseline

model, tokenizer = mlx_loom.load(ARGS["path"])
server = make_server(model, tokenizer, port=0, **ARGS.get("options", {}))
server.start_in_background()

def post(path, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    started = time.monotonic()
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    data = json.loads(reply.read())
    return {"status": reply.status, "body": data, "seconds": time.monotonic() - started,
            "ended": time.monotonic()}

def health():
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    started = time.monotonic()
    conn.request("GET", "/health")
    reply = conn.getresponse()
    body = json.loads(reply.read())
    return reply.status, time.monotonic() - started, body["preparing"], body["waiting_to_prepare"]

# Reset the peak (VmHWM) here: loading peaks above what stays resident, and
# under memory pressure the resident set shrinks, so the process's lifetime
# peak minus the resident set now would count memory this test never used.
open("/proc/self/clear_refs", "w").write("5")
baseline = status_mb("VmRSS")
"""


def test_a_7_mb_prompt_is_refused_before_tokenizing_in_bounded_time_and_memory(family_dirs):
    code = (
        SERVER_IN_CHILD
        + """
text = "the quick brown fox " * 350_000  # 7 MB
RESULT = {
    path: post(path, body)
    for path, body in [
        ("/v1/completions", {"prompt": text}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": text}]}),
    ]
}
RESULT["growth_mb"] = growth_mb()
server.stop()
"""
    )
    result = run_bounded(code, args={"path": str(family_dirs["llama"])}, timeout_s=60).expect_ok()
    completions = result["/v1/completions"]
    assert completions["status"] == 400
    assert completions["body"]["error"]["code"] == "prompt_too_long"
    # A chat this long is stopped by the template's output budget first.
    assert result["/v1/chat/completions"]["body"]["error"]["code"] == "template_budget_exceeded"
    assert result["/v1/messages"]["status"] == 400
    for path in ENDPOINTS:
        assert result[path]["seconds"] < 10, result[path]["seconds"]
    # Tokenizing it took 1.8 GB; refusing it costs a few copies of the body.
    assert result["growth_mb"] < 300, result["growth_mb"]


@pytest.mark.slow  # ~15 s: huge prompts tokenized while small requests are answered
def test_health_and_small_requests_are_answered_while_huge_prompts_are_tokenized(family_dirs):
    code = (
        SERVER_IN_CHILD
        + """
text = "ab " * (1024 * 1024 // 3)  # the default limit; 700k tokens here: seconds of work
big = []
threads = [threading.Thread(target=lambda: big.append(post("/v1/completions", {"prompt": text})))
           for _ in range(2)]
for t in threads:
    t.start()
time.sleep(0.3)  # both bodies are in; the first is being tokenized
healths, small = [], None
while not big and len(healths) < 2000:
    healths.append(health() + (time.monotonic(),))
    if small is None:
        small = post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    time.sleep(0.02)
for t in threads:
    t.join(120)
RESULT = {"big": big, "healths": healths, "small": small,
          "growth_mb": growth_mb()}
server.stop()
"""
    )
    # The tokenizer's 700k-token encoding needs ~0.3 GB resident and more
    # address space; out of memory, the tokenizer library aborts the process.
    outcome = run_bounded(
        code, args={"path": str(family_dirs["llama"])}, timeout_s=120, memory_mb=2560
    )
    result = outcome.expect_ok()
    big, healths, small = result["big"], result["healths"], result["small"]
    assert [b["body"]["error"]["code"] for b in big] == ["context_length_exceeded"] * 2
    first_done = min(b["ended"] for b in big)
    during = [h for h in healths if h[4] < first_done]
    assert len(during) >= 3, (healths, first_done)
    assert all(status == 200 and seconds < 1.0 for status, seconds, *_ in during), during
    # A small request is prepared on the thread kept for small work, not after the big ones.
    assert small["status"] == 200 and small["ended"] < first_done, (small, first_done)
    # One large preparation at a time (two threads, one kept back), the other waiting.
    assert max(h[2] for h in during) == 1 and max(h[3] for h in during) >= 1, during
    # One such prompt costs ~0.3 GB here (the peak varies with the allocator, up to
    # ~0.5 GB); two tokenized at once would be twice that, 1.8 GB took the 7 MB one.
    assert result["growth_mb"] < 800, result["growth_mb"]

"""Prefix reuse through the server, for families whose caches cannot trim.

A conversation with a long system prompt on Qwen3-Next and Gemma 4 (window
smaller than the prompt): a regenerate, an edited last message, a follow-up
turn and the first request after a restart each reuse most of what they
share, report it in ``usage``, and answer exactly (text and log-probabilities)
as a server with no prompt cache.
"""

from __future__ import annotations

import pytest

import mlx_loom
from mlx_loom.testing.checkpoints import write_checkpoint

from .conftest import serve

SYSTEM = "You are a careful assistant who answers in short sentences. " * 8


@pytest.fixture(scope="module", params=["qwen3_next", "gemma4_text"])
def family(request, tmp_path_factory):
    claim = mlx_loom.default_host().registry.model_types[request.param]
    cfg = {**claim.tiny_config, "max_position_embeddings": 4096}
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    return mlx_loom.load(write_checkpoint(path, cfg, claim.checkpoint_tensors(cfg)))


def chat(client, messages):
    body = {"messages": messages, "max_tokens": 6, "logprobs": True, "temperature": 0}
    reply = client.post("/v1/chat/completions", body)
    assert reply.status == 200, reply.json
    data = reply.json
    usage = data["usage"]
    choice = data["choices"][0]
    answer = (choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]])
    return answer, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def assistant(answer):
    return {"role": "assistant", "content": answer[0]}


def conversation():
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi there"}]
    edited = [first[0], {"role": "user", "content": "hello again"}]
    return first, edited


@pytest.fixture
def servers(family, tmp_path):
    model, tokenizer = family
    from mlx_loom.serve.app import server_engine_settings

    def make(**settings):
        return serve(model, tokenizer, engine=server_engine_settings(**settings))

    return make


def test_a_conversation_reuses_its_prefix_and_answers_as_with_no_cache(servers, tmp_path):
    first, edited = conversation()
    cold_gen = servers(prompt_cache_size=0)
    cold = next(cold_gen)
    try:
        want_first, total, _ = chat(cold, first)
        want_edit, edit_total, _ = chat(cold, edited)
        follow = [*first, assistant(want_first), {"role": "user", "content": "why?"}]
        want_follow, follow_total, _ = chat(cold, follow)
    finally:
        cold_gen.close()

    warm_gen = servers(prompt_cache_dir=str(tmp_path))
    warm = next(warm_gen)
    try:
        got, _, cached = chat(warm, first)
        assert cached == 0 and got == want_first
        got, _, cached = chat(warm, first)  # regenerate
        assert got == want_first and cached == total - 1
        got, _, cached = chat(warm, edited)
        assert got == want_edit and cached >= 0.8 * edit_total
        got, _, cached = chat(warm, follow)
        assert got == want_follow and cached >= 0.8 * total
        # Anthropic's door reports the same reuse as cache_read_input_tokens.
        served = warm.get("/v1/models").json["data"][0]["id"]
        body = {"model": served, "system": SYSTEM, "max_tokens": 6, "messages": first[1:]}
        usage = warm.post("/v1/messages", body).json["usage"]
        assert usage["cache_read_input_tokens"] >= 0.8 * usage["input_tokens"]
        health = warm.get("/health").json["prompt_cache"]
        assert health["hits"] == 4 and health["checkpoint_bytes"] > 0
    finally:
        warm_gen.close()  # stops the server: its caches go to disk

    again_gen = servers(prompt_cache_dir=str(tmp_path))
    again = next(again_gen)
    try:
        follow_up = [*follow, assistant(want_follow), {"role": "user", "content": "ok"}]
        got, total_after, cached = chat(again, follow_up)
        assert cached >= 0.8 * follow_total
        assert again.get("/health").json["prompt_cache"]["disk_hits"] == 1
    finally:
        again_gen.close()
    cold_gen = servers(prompt_cache_size=0)
    cold = next(cold_gen)
    try:
        assert chat(cold, follow_up)[0] == got
    finally:
        cold_gen.close()

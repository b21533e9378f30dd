"""Routine client fields, reasoning_effort and assistant prefill, through the real clients."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import anthropic
import openai
import pytest

import mlx_loom
from mlx_loom.serve import make_server
from mlx_loom.serve.prefill import continues_final_message
from mlx_loom.serve.schemas import ChatCompletionRequest, nearest_field

from .formats import FORMATS, WEATHER_TOOL, scripted, write_format_checkpoint

USER = {"role": "user", "content": "hello"}
#: What SDKs and agent clients send that means nothing to a local server.
ROUTINE = {
    "store": True,
    "metadata": {"run": "7"},
    "user": "someone",
    "service_tier": "auto",
    "prompt_cache_key": "conversation-1",
    "safety_identifier": "hashed-id",
}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[object, object]]:
    """A ``<think>`` model whose template reads ``enable_thinking``, with a scripted worker."""
    path = tmp_path_factory.mktemp("fields") / "ckpt"
    path = write_format_checkpoint(path, FORMATS["json_tools"])
    model, tokenizer = mlx_loom.load(path)
    server = make_server(model, tokenizer, port=0, model_id="tools")
    worker = scripted(server)
    server.start_in_background()
    try:
        yield server, worker
    finally:
        server.stop()


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


# --- routine fields -----------------------------------------------------------------


def test_routine_chat_fields_are_accepted_ignored_and_logged(served, caplog):
    server, worker = served
    worker.script("Hi!")
    with caplog.at_level(logging.DEBUG, logger="mlx_loom.serve"):
        reply = openai_client(server).chat.completions.create(
            model="tools",
            messages=[USER],
            parallel_tool_calls=True,
            modalities=["text"],
            **ROUTINE,
        )
    assert reply.choices[0].message.content == "Hi!"
    # Nothing of them reaches the prompt.
    assert worker.jobs[-1].prompt == server.app.tokenizer.encode_chat([USER])
    logged = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    assert logged == [
        "/v1/chat/completions: accepted and ignored metadata, modalities, prompt_cache_key, "
        "safety_identifier, service_tier, store, user"
    ]


def test_routine_completion_fields_are_accepted(served):
    server, worker = served
    worker.script(" there")
    reply = openai_client(server).completions.create(
        model="tools", prompt="hello", max_tokens=4, extra_body=ROUTINE
    )
    assert reply.choices[0].text == " there"


def test_routine_anthropic_fields_are_accepted(served):
    server, worker = served
    worker.script("Hi!")
    message = anthropic_client(server).messages.create(
        model="tools",
        max_tokens=8,
        messages=[USER],
        metadata={"user_id": "someone"},
        service_tier="auto",
    )
    assert message.content[0].text == "Hi!"


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("store", "yes", "store"),
        ("metadata", ["a"], "metadata"),
        ("modalities", ["text", "audio"], "modalities[1]"),
    ],
)
def test_a_routine_field_of_the_wrong_type_is_still_refused(served, field, value, param):
    server, worker = served
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(server).chat.completions.create(
            model="tools", messages=[USER], extra_body={field: value}
        )
    assert info.value.body["param"] == param


# --- reasoning_effort -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("effort", "thinking"), [("none", False), ("minimal", False), ("low", True), ("high", True)]
)
def test_reasoning_effort_sets_the_templates_thinking_switch(served, effort, thinking):
    server, worker = served
    worker.script("\nweighing\n</think>\n\nYes." if thinking else "Yes.")
    reply = openai_client(server).chat.completions.create(
        model="tools", messages=[USER], reasoning_effort=effort
    )
    tokenizer = server.app.tokenizer
    assert worker.jobs[-1].prompt == tokenizer.encode_chat([USER], enable_thinking=thinking)
    message = reply.choices[0].message
    assert message.content == "Yes."
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert reasoning == ("weighing" if thinking else None)


def test_chat_template_kwargs_override_reasoning_effort(served):
    server, worker = served
    worker.script("Yes.")
    openai_client(server).chat.completions.create(
        model="tools",
        messages=[USER],
        reasoning_effort="high",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    tokenizer = server.app.tokenizer
    assert worker.jobs[-1].prompt == tokenizer.encode_chat([USER], enable_thinking=False)


def test_an_unknown_reasoning_effort_is_refused_with_the_values(served):
    server, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(server).chat.completions.create(
            model="tools", messages=[USER], extra_body={"reasoning_effort": "max"}
        )
    assert info.value.body["param"] == "reasoning_effort"
    assert '"minimal"' in info.value.body["message"]


# --- unknown fields and their suggestion ---------------------------------------------


def test_an_unknown_field_suggests_only_a_near_real_field(served):
    server, _ = served
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tools", messages=[USER], extra_body={"reasoning_efort": "low"}
        )
    assert "did you mean 'reasoning_effort'" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tools", messages=[USER], extra_body={"verbosity": "low"}
        )
    body = info.value.body
    assert "did you mean" not in body["message"] and body["param"] == "verbosity"
    # On /v1/completions reasoning_effort is not a field (there is no template),
    # and it is no typo of response_format.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="tools", prompt="hi", extra_body={"reasoning_effort": "low"}
        )
    assert "did you mean" not in info.value.body["message"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("temprature", "temperature"),
        ("max-tokens", "max_tokens"),
        ("Top_P", "top_p"),
        ("response_fromat", "response_format"),
        ("temp", "temperature"),
        ("reasoning_efort", "reasoning_effort"),
        ("reasoning_effort_level", None),
        ("prompt_cache_retention", None),
        ("audio", None),
        ("x" * 100_000, None),
    ],
)
def test_nearest_field(name, expected):
    assert nearest_field(name, list(ChatCompletionRequest.model_fields)) == expected


# --- assistant prefill ----------------------------------------------------------------

PREFILL = [USER, {"role": "assistant", "content": '{"answer":'}]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_final_assistant_message_is_continued_on_chat_completions(served, stream):
    server, worker = served
    worker.script(' "yes"}')
    client = openai_client(server)
    if stream:
        chunks = client.chat.completions.create(model="tools", messages=PREFILL, stream=True)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        reply = client.chat.completions.create(model="tools", messages=PREFILL)
        content = reply.choices[0].message.content
    assert content == ' "yes"}'  # the continuation only
    tokenizer = server.app.tokenizer
    prompt = worker.jobs[-1].prompt
    assert prompt == tokenizer.encode_chat(
        PREFILL, add_generation_prompt=False, continue_final_message=True
    )
    # The assistant's turn is left open, right after the prefilled text.
    assert tokenizer.decode(prompt).endswith('{"answer":')
    assert prompt != tokenizer.encode_chat(PREFILL)


def test_a_final_assistant_message_is_continued_on_messages(served):
    server, worker = served
    worker.script(' "yes"}')
    message = anthropic_client(server).messages.create(
        model="tools", max_tokens=8, messages=PREFILL
    )
    assert [b.text for b in message.content] == [' "yes"}']
    tokenizer = server.app.tokenizer
    assert worker.jobs[-1].prompt == tokenizer.encode_chat(
        PREFILL, add_generation_prompt=False, continue_final_message=True
    )


def test_a_final_assistant_message_is_continued_on_responses(served):
    server, worker = served
    worker.script(' "yes"}')
    items = [{"role": m["role"], "content": m["content"]} for m in PREFILL]
    response = openai_client(server).responses.create(model="tools", input=items)
    assert response.output_text == ' "yes"}'  # the continuation only
    tokenizer = server.app.tokenizer
    assert worker.jobs[-1].prompt == tokenizer.encode_chat(
        PREFILL, add_generation_prompt=False, continue_final_message=True
    )


def test_prefill_with_a_forced_tool_call_is_refused(served):
    server, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(server).chat.completions.create(
            model="tools", messages=PREFILL, tools=[WEATHER_TOOL], tool_choice="required"
        )
    assert info.value.body["param"] == "tool_choice"


def test_which_conversations_are_continued():
    assert continues_final_message(PREFILL)
    assert not continues_final_message([USER])
    assert not continues_final_message([USER, {"role": "assistant", "content": ""}])
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert not continues_final_message(
        [USER, {"role": "assistant", "content": "x", "tool_calls": [call]}]
    )
    assert not continues_final_message([])


def test_a_prefill_inside_a_thinking_section_is_continued_as_reasoning(served):
    server, worker = served
    worker.script(" about it</think>\n\nYes.")
    messages = [USER, {"role": "assistant", "content": "<think>\nI think"}]
    reply = openai_client(server).chat.completions.create(model="tools", messages=messages)
    message = reply.choices[0].message
    assert message.content == "Yes."
    assert (message.model_extra or {}).get("reasoning_content") == "about it"


def test_a_prefill_inside_a_thinking_section_is_a_thinking_block_on_messages(served):
    server, worker = served
    worker.script(" about it</think>\n\nYes.")
    messages = [USER, {"role": "assistant", "content": "<think>\nI think"}]
    message = anthropic_client(server).messages.create(
        model="tools", max_tokens=16, messages=messages
    )
    blocks = [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
        for b in message.content
    ]
    assert blocks == [("thinking", "about it"), ("text", "Yes.")]

"""gpt-oss on ``loom serve``: Harmony's channels and calls through the real clients.

The checkpoint is a tiny gpt-oss whose tokenizer holds Harmony's special
tokens and whose chat template is a compact Harmony template written for
these tests (system/developer/user turns as ``<|start|>ROLE<|message|>...<|end|>``,
earlier reasoning in the ``analysis`` channel, answers in ``final``, calls as
``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>...<|call|>``,
the generation prompt ``<|start|>assistant``). The published template renders
the same messages, with more system text around them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from tokenizers import AddedToken, Tokenizer

import mlx_loom
from mlx_loom.serve import make_server
from mlx_loom.serve.tools import ChatFormat
from mlx_loom.testing.checkpoints import write_checkpoint
from mlx_loom.testing.tokenizer import write_tokenizer
from mlx_loom.text.output_parser import Content, Reasoning

from .formats import WEATHER_TOOL, scripted
from .test_tools import ask

HARMONY_TOKENS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)

TEMPLATE = r"""
{%- if tools -%}
{{ '<|start|>developer<|message|>Tools\n' + (tools | tojson) + '<|end|>' }}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- if m.reasoning_content -%}
{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|>' }}
{%- endif -%}
{%- if m.content -%}
{{ '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}
{%- endif -%}
{%- for tool_call in m.tool_calls or [] -%}
{%- if tool_call.function -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
{{ '<|start|>assistant to=functions.' + tool_call.name + '<|channel|>commentary json<|message|>' }}
{{- tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson }}
{{- '<|call|>' }}
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{{ '<|start|>functions.tool to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}
{%- else -%}
{{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|start|>assistant' }}{%- endif -%}
"""

USER = {"role": "user", "content": "hello"}
ANSWER = (
    "<|channel|>analysis<|message|>The user greets me.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there!"
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": 2}'
)


def write_harmony_checkpoint(path: Path) -> Path:
    claim = mlx_loom.default_host().registry.model_types["gpt_oss"]
    config = {**claim.tiny_config, "max_position_embeddings": 4096}
    write_checkpoint(path, config, claim.checkpoint_tensors(config), tokenizer=True)
    write_tokenizer(path, 224)  # room in the 256-entry vocabulary for Harmony's tokens
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    tok.add_tokens([AddedToken("_", normalized=False)])  # function names hold it
    tok.save(str(path / "tokenizer.json"))
    config_path = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.update(chat_template=TEMPLATE, eos_token="<|return|>")
    config_path.write_text(json.dumps(tokenizer_config, indent=2))
    ids = [tok.token_to_id(t) for t in ("<|return|>", "<|call|>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return path


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_loom.load(write_harmony_checkpoint(tmp_path_factory.mktemp("harmony") / "ckpt"))


@pytest.fixture(scope="module")
def served(loaded) -> Iterator[tuple[object, object]]:
    model, tokenizer = loaded
    server = make_server(model, tokenizer, port=0, model_id="tools")
    worker = scripted(server)
    server.start_in_background()
    try:
        yield server, worker
    finally:
        server.stop()


def test_the_model_speaks_harmony(loaded):
    fmt = ChatFormat.for_model(*loaded)
    assert fmt.tool_parser is not None and fmt.tool_parser.name == "harmony"
    assert fmt.reasoning is not None and fmt.reasoning.name == "harmony"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_analysis_is_reasoning_content_and_final_is_the_answer(served, stream):
    server, worker = served
    worker.script(ANSWER)
    assert ask(server, [USER], stream=stream) == (
        "Hello there!",
        "The user greets me.",
        [],
        "stop",
    )
    assert worker.jobs[-1].prompt == server.app.tokenizer.encode(
        "<|start|>user<|message|>hello<|end|><|start|>assistant", add_special_tokens=False
    )


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_commentary_call_comes_back_as_a_tool_call_and_round_trips(served, stream):
    server, worker = served
    worker.script(CALL)
    content, reasoning, calls, finish = ask(server, [USER], stream=stream, tools=[WEATHER_TOOL])
    assert (content, reasoning, finish) == (None, "Need the weather.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    history = [
        USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": calls[0]["id"], "type": "function", "function": {
                "name": "get_weather", "arguments": calls[0]["arguments"]}}],
        },
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"},
    ]
    worker.script("<|channel|>final<|message|>Sunny.")
    assert ask(server, history, stream=stream, tools=[WEATHER_TOOL])[0] == "Sunny."
    prompt = server.app.tokenizer.decode(worker.jobs[-1].prompt)
    header = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    assert header in prompt
    assert prompt.endswith("commentary<|message|>sunny<|end|><|start|>assistant")


def test_anthropic_and_responses_clients_get_thinking_and_reasoning_items(served):
    server, worker = served
    worker.script(ANSWER)
    message = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.create(
        model="tools", max_tokens=16, messages=[USER]
    )
    blocks = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
              for b in message.content]
    assert blocks == [("thinking", "The user greets me."), ("text", "Hello there!")]
    worker.script(ANSWER)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    response = client.responses.create(model="tools", input="hello", max_output_tokens=16)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == "Hello there!"


def test_a_named_tool_choice_opens_the_call_in_the_prompt(served):
    server, worker = served
    worker.script('{"city": "Paris"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, _, calls, finish = ask(server, [USER], stream=False, tools=[WEATHER_TOOL], tool_choice=named)
    assert finish == "tool_calls" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    prompt = server.app.tokenizer.decode(worker.jobs[-1].prompt)
    assert prompt.endswith(
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    )


def test_a_real_reply_reads_as_the_engines_own_greedy_generation(loaded):
    model, tokenizer = loaded
    server = make_server(model, tokenizer, port=0, model_id="tools")
    server.start_in_background()
    try:
        content, reasoning, _, _ = ask(server, [USER], stream=True, max_tokens=12, temperature=0)
    finally:
        server.stop()
    prompt = tokenizer.apply_chat_template([USER])
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    text = mlx_loom.generate(model, tokenizer, ids, max_tokens=12)
    parser = ChatFormat.for_model(model, tokenizer).output_parser(prompt=prompt)
    events = parser.feed(text) + parser.finish()
    assert content == ("".join(e.text for e in events if isinstance(e, Content)) or None)
    assert reasoning == ("".join(e.text for e in events if isinstance(e, Reasoning)) or None)

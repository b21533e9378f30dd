"""Qwen3 through every door: the Python API, ``loom generate``, ``loom chat``, and the server
with the real ``openai`` client — a forced tool call in Qwen3's ``<tool_call>{json}</tool_call>``
format and a ``<think>`` section returned as ``reasoning_content``.

The checkpoint's chat template is written here in Qwen3's shape (ChatML turns, tools listed in
the system turn, calls as JSON between ``<tool_call>`` markers, tool results in
``<tool_response>``, ``enable_thinking`` opening or closing a ``<think>`` section); its markers
are single tokens, as in the published tokenizer.
"""

from __future__ import annotations

import io
import json

import openai
import pytest
from qwen3_testkit import write_checkpoint
from tokenizers import AddedToken, Tokenizer

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.serve import make_server
from mlx_loom.testing.tokenizer import write_tokenizer
from mlx_loom.text.output_parser import Content, Reasoning

TEMPLATE = r"""
{%- if tools -%}
{{ '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' -%}{{ messages[0].content + '\n\n' }}{%- endif -%}
{{ '# Tools\n<tools>' }}{%- for tool in tools -%}{{ '\n' + (tool | tojson) }}{%- endfor -%}
{{ '\n</tools>\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' -%}
{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{ '<|im_start|>assistant\n' + (m.content or '') }}
{%- for call in m.tool_calls or [] -%}
{%- if call.function -%}{%- set call = call.function -%}{%- endif -%}
{{ '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) }}
{{- '}\n</tool_call>' }}
{%- endfor -%}
{{ '<|im_end|>\n' }}
{%- elif m.role == 'tool' -%}
{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- elif m.role != 'system' -%}
{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking -%}{{ '<think>\n' }}
{%- else -%}{{ '<think>\n\n</think>\n\n' }}{%- endif -%}
{%- endif -%}
"""
MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
           "</think>", "_")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["paris", "rome"]}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def checkpoint(request, tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param, "hf")
    write_tokenizer(path, 224)  # room for the markers as whole tokens
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def served(checkpoint):
    model, tokenizer = mlx_loom.load(checkpoint)
    server = make_server(model, tokenizer, host="127.0.0.1", port=0, model_id="qwen3")
    server.start_in_background()
    try:
        yield server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    finally:
        server.stop()


def test_python_api_batch_equals_each_prompt_alone(checkpoint):
    model, tokenizer = mlx_loom.load(checkpoint)
    prompts = ["the model reads a token", "hello world"]
    alone = [mlx_loom.generate(model, tokenizer, p, max_tokens=8) for p in prompts]
    batched = mlx_loom.batch_generate(model, tokenizer, prompts, max_tokens=8).texts
    assert alone[0] and batched == alone


def test_loom_generate_speculating_gives_the_plain_text(checkpoint, capsys):
    def run(*extra: str) -> str:
        code = main(["generate", "--model", str(checkpoint), "-p", "hello", "-m", "12", *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "Generation:" in err
        return out

    plain = run()
    assert plain.strip()
    assert run("--draft-model", str(checkpoint), "--num-draft-tokens", "3") == plain


def test_loom_chat_two_turns(checkpoint, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nand then?\n"))
    code = main(["chat", "--model", str(checkpoint), "-m", "6", "--stats"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count("Generation:") == 2


def test_the_server_reads_qwen3s_tool_and_thinking_formats(served):
    fmt = served[0].app.chat_format
    assert fmt.tool_parser is not None and fmt.tool_parser.name == "json_tools"
    assert fmt.reasoning is not None and fmt.reasoning.name == "think"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_named_tool_call_comes_back_through_the_openai_client(served, stream):
    _, client = served
    kwargs = dict(
        model="qwen3",
        messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        temperature=0,
    )
    if stream:
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for d in choice.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    call["name"] += (d.function and d.function.name) or ""
                    call["arguments"] += (d.function and d.function.arguments) or ""
        (name, arguments), = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish = choice.finish_reason
        (call,) = choice.message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    assert finish == "tool_calls"
    assert name == "get_weather"
    assert json.loads(arguments)["city"] in ("paris", "rome")


def test_thinking_comes_back_as_reasoning_content(served, checkpoint):
    server, client = served
    messages = [{"role": "user", "content": "hello"}]
    reply = client.chat.completions.create(
        model="qwen3",
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    message = reply.choices[0].message
    # The engine's own greedy reply to the same prompt, split by the think format: the
    # template opens <think>, so the reply starts inside it. A model of its own: two
    # threads generating on one MLX model can abort the process.
    model, tokenizer = mlx_loom.load(checkpoint)
    prompt = tokenizer.apply_chat_template(messages, enable_thinking=True)
    assert server.app.chat_format.reasoning.opens_inside(prompt)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    parser = server.app.chat_format.output_parser(prompt=prompt)
    events = parser.feed(mlx_loom.generate(model, tokenizer, ids, max_tokens=6)) + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning)) or None
    content = "".join(e.text for e in events if isinstance(e, Content))
    assert (message.model_extra or {}).get("reasoning_content") == reasoning
    assert (message.content or "") == content

"""``loom serve`` for a Mistral 3 checkpoint (Ministral 3 text) with Mistral's tool-call format.

The checkpoint ships a chat template that writes calls as ``[TOOL_CALLS]name[ARGS]{...}``
(``formats.py``); the server picks the ``mistral`` parser and the real ``openai``
client gets a forced call back as structured ``tool_calls``.
"""

from __future__ import annotations

import json

import openai

import mlx_loom
from mlx_loom.serve import make_server

from .formats import FORMATS, write_format_checkpoint

#: A short city bounds what random weights can write into the forced call.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}


def test_a_mistral3_checkpoint_serves_text_and_mistral_tool_calls(tmp_path):
    path = write_format_checkpoint(tmp_path / "ckpt", FORMATS["mistral"], model_type="mistral3")
    model, tokenizer = mlx_loom.load(path)
    server = make_server(model, tokenizer, port=0, model_id="m")
    server.start_in_background()
    try:
        assert server.app.chat_format.tool_parser.name == "mistral"
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        text = client.chat.completions.create(model="m", messages=messages, max_tokens=6)
        assert text.choices[0].finish_reason in ("stop", "length")
        reply = client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=160,
            tools=[WEATHER],
            tool_choice="required",
            seed=0,
        ).choices[0]
        assert reply.finish_reason == "tool_calls"
        (call,) = reply.message.tool_calls
        assert call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments).get("city"), str)
    finally:
        server.stop()

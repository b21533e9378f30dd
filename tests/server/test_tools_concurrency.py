"""Concurrent tool requests each get their own answer: one output parser per choice."""

from __future__ import annotations

import json
import threading

import mlx_loom
from mlx_loom.serve import make_server

from .formats import FORMATS, WEATHER_TOOL, write_format_checkpoint
from .test_tools import ask

NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_concurrent_streamed_and_plain_tool_requests_equal_a_lone_one(tmp_path):
    path = write_format_checkpoint(tmp_path / "ckpt", FORMATS["json_tools"])
    model, tokenizer = mlx_loom.load(path)
    server = make_server(model, tokenizer, port=0, model_id="tools")
    server.start_in_background()
    try:
        messages = [{"role": "user", "content": "weather?"}]
        options = dict(tools=[WEATHER_TOOL], tool_choice=NAMED, max_tokens=8)
        alone = ask(server, messages, stream=False, **options)
        answers: list = [None] * 6
        failures: list = []

        def run(i: int) -> None:
            try:
                answers[i] = ask(server, messages, stream=bool(i % 2), **options)
            except Exception as err:  # reported on the test's thread
                failures.append(err)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(answers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures

        def comparable(answer):
            content, reasoning, calls, finish = answer
            return (
                content,
                reasoning,
                [(c["name"], json.loads(c["arguments"])) for c in calls],
                finish,
            )

        assert all(comparable(a) == comparable(alone) for a in answers)
    finally:
        server.stop()

"""The chat's conversation window, its file format, and Ctrl-C handling (in-process units)."""

from __future__ import annotations

import io
import json
import os
import signal
import sys

import pytest

from mlx_loom.cli.chat_session import StopOnInterrupt
from mlx_loom.cli.conversation import MAX_CONVERSATION_BYTES, Conversation
from mlx_loom.cli.repl import EndOfInput, LineReader
from mlx_loom.errors import RequestError


def encode(messages: list[dict[str, str]]) -> list[int]:
    """A stand-in tokenizer: one token per character of each message, plus two per message."""
    return [0] * sum(len(m["content"]) + 2 for m in messages)


def talk(turns: int, size: int = 10) -> Conversation:
    chat = Conversation(system="S" * 8)
    for i in range(turns):
        chat.add("user", f"{i}" * size)
        chat.add("assistant", "a" * size)
    return chat


def test_a_conversation_that_fits_is_sent_whole():
    chat = talk(2)
    chat.add("user", "now")
    plan = chat.plan(encode, budget=1000, max_tokens=100)
    assert plan.dropped == 0 and len(plan.prompt) == len(encode(chat.window()))
    assert plan.max_tokens == 100


def test_the_oldest_turns_are_dropped_and_the_system_message_kept():
    chat = talk(4)  # system 10 tokens, each turn 24
    chat.add("user", "now")  # 5 tokens
    plan = chat.plan(encode, budget=80, max_tokens=30)
    window = chat.window()
    assert window[0] == {"role": "system", "content": "S" * 8}
    assert window[1]["role"] == "user" and window[-1]["content"] == "now"
    assert plan.dropped == 3  # 10 + 24 + 5 + 30 reserve <= 80
    assert len(plan.prompt) + plan.max_tokens <= 80
    assert len(chat.messages) == 9  # the transcript keeps everything


def test_the_reply_room_reserved_is_at_most_half_the_budget():
    chat = talk(1)
    chat.add("user", "now")
    plan = chat.plan(encode, budget=80, max_tokens=1000)
    assert plan.dropped == 0  # 39 tokens of prompt leave 41 >= 40 for the reply
    assert plan.max_tokens == 80 - len(plan.prompt)


def test_the_window_only_moves_forward():
    chat = talk(4)
    chat.add("user", "now")
    chat.plan(encode, budget=80, max_tokens=30)
    start = chat.window_start
    chat.add("assistant", "ok")
    chat.add("user", "?")
    chat.plan(encode, budget=10_000, max_tokens=30)  # would fit whole again
    assert chat.window_start == start


def test_a_message_alone_too_long_for_the_budget_is_refused():
    chat = Conversation(system="S" * 8)
    chat.add("user", "x" * 100)
    with pytest.raises(RequestError, match="too long for the chat") as info:
        chat.plan(encode, budget=50, max_tokens=10)
    assert "--max-kv-size" in info.value.fix


def test_no_budget_means_nothing_is_dropped():
    chat = talk(50)
    chat.add("user", "now")
    assert chat.plan(encode, budget=None, max_tokens=7).dropped == 0


def test_save_and_load_round_trip(tmp_path):
    chat = talk(3)
    chat.save(tmp_path / "c.json", model="tiny")
    loaded = Conversation.load(tmp_path / "c.json")
    assert loaded.system == chat.system and loaded.messages == chat.messages
    assert json.loads((tmp_path / "c.json").read_text())["model"] == "tiny"


def test_load_accepts_a_bare_list_of_openai_style_messages(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps(
            [
                {"role": "user", "content": "hi", "name": "me"},
                {"role": "assistant", "content": "hello"},
            ]
        )
    )
    assert [m.content for m in Conversation.load(path).messages] == ["hi", "hello"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not json", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "deeper than the limit"),
        (
            '{"messages": [{"role": "user", "content": "'
            + "9" * 5000
            + '"}], "n": '
            + "9" * 5000
            + "}",
            "5000 digits",
        ),
        ('[{"role": "user", "content": "a \\ud800"}]', "lone UTF-16 surrogate"),
        ('"a string"', "holds a JSON str"),
        ('{"messages": [{"role": "user"}]}', "messages.0.content"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "message 1"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no reply"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}',
            "only the first message may be a system message",
        ),
        ('{"version": 7, "messages": []}', "version"),
    ],
)
def test_a_bad_conversation_file_is_a_request_error_naming_the_problem(tmp_path, text, match):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(RequestError, match=match):
        Conversation.load(path)


def test_an_oversized_conversation_file_is_refused_before_parsing(tmp_path):
    path = tmp_path / "c.json"
    with path.open("wb") as f:
        f.truncate(MAX_CONVERSATION_BYTES + 1)
    with pytest.raises(RequestError, match="limit for this file"):
        Conversation.load(path)


def test_saving_into_a_missing_directory_is_a_request_error(tmp_path):
    with pytest.raises(RequestError, match="Cannot save"):
        talk(1).save(tmp_path / "no" / "such" / "dir.json")


def test_first_ctrl_c_asks_to_stop_and_a_second_interrupts_at_once():
    with StopOnInterrupt() as interrupt:
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupt.requested
        with pytest.raises(KeyboardInterrupt):  # the handler runs before the next bytecode
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def read_all(text: str) -> list[str]:
    reader = LineReader(interactive=False)
    messages = []
    with reader, pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.stdin", io.StringIO(text))
        while True:
            try:
                messages.append(reader.read())
            except EndOfInput as end:
                messages.append(f"<end unfinished={end.unfinished}>")
                return messages


def test_piped_multi_line_messages_and_an_unfinished_block():
    text = 'one \\\ntwo\n"""\nthree\n\nfour"""\n"""inline"""\n"""never closed\n'
    assert read_all(text) == ["one \ntwo", "three\n\nfour", "inline", "<end unfinished=True>"]


def test_the_history_file_follows_the_environment(tmp_path, monkeypatch):
    from mlx_loom.cli.repl import HISTORY_ENV, default_history_path

    monkeypatch.setenv(HISTORY_ENV, str(tmp_path / "mine"))
    assert default_history_path() == tmp_path / "mine"
    monkeypatch.setenv(HISTORY_ENV, "")
    assert default_history_path() is None  # empty: no history
    monkeypatch.delenv(HISTORY_ENV)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    if sys.platform not in ("darwin", "win32"):
        assert default_history_path() == tmp_path / "data" / "mlx-loom" / "chat_history"
    assert default_history_path().name == "chat_history"

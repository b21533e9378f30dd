"""``loom chat`` keeps a long conversation inside the context, for every family.

The first test runs the installed command in a subprocess; the rest call the
same entry point in-process with piped input, which is the same code path
without paying for a new interpreter each time.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal

import pytest

import mlx_loom

from .conftest import FAMILIES, family_checkpoint

TURNS = "".join(f"message number {i} goes here\n" for i in range(4))
STATS = re.compile(r"Prompt: (\d+) tokens.*?\nGeneration: (\d+) tokens", re.S)


def turn_sizes(stderr: str) -> list[tuple[int, int]]:
    return [(int(p), int(g)) for p, g in STATS.findall(stderr)]


def test_the_bundled_model_answers_every_turn_of_a_long_chat(loom):
    """The reported failure: on the 256-token bundled model the third turn used to fail."""
    result = loom("chat", "--model", "tiny", "--stats", input="Tell me a story\n" * 3)
    assert result.returncode == 0, result.stderr
    assert "error" not in result.stderr
    sizes = turn_sizes(result.stderr)
    assert len(sizes) == 3
    assert all(prompt + generated <= 256 for prompt, generated in sizes)
    assert result.stderr.count("no longer fits the 256-token context") == 1  # said once


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_stays_inside_its_context_turn_after_turn(chat, short_context, model_type):
    code, _, err = chat("--model", short_context[model_type], "-m", "16", "--stats", input=TURNS)
    assert code == 0, err
    assert "error" not in err
    sizes = turn_sizes(err)
    assert len(sizes) == 4
    assert all(prompt + generated <= 64 for prompt, generated in sizes), sizes
    assert err.count("the oldest turns are left out") == 1


def test_max_kv_size_caps_what_the_conversation_occupies(chat, short_context):
    model = short_context["llama"]
    code, _, err = chat("--model", model, "--max-kv-size", "40", "--stats", input=TURNS)
    assert code == 0, err
    sizes = turn_sizes(err)
    assert len(sizes) == 4 and all(p + g <= 40 for p, g in sizes), sizes
    assert "no longer fits the 40-token context" in err


def test_a_max_kv_size_beyond_the_context_is_a_usage_error_naming_the_flag(chat, short_context):
    code, _, err = chat("--model", short_context["llama"], "--max-kv-size", "1000", input="")
    assert code == 2
    assert "argument --max-kv-size: 1000 is more than the model's context of 64" in err
    assert "fix: pass --max-kv-size 64 or less" in err


def test_a_message_too_long_for_the_context_is_refused_and_the_chat_goes_on(chat, short_context):
    long = "the model reads a token " * 40
    code, _, err = chat(
        "--model", short_context["llama"], "-m", "4", "--stats", input=f"{long}\nhello\n"
    )
    assert code == 0
    assert "The message is too long for the chat" in err
    assert "--max-kv-size" in err  # the fix names the flag
    assert len(turn_sizes(err)) == 1  # the short message was still answered


def test_save_keeps_every_turn_and_load_continues_the_conversation(chat, short_context, tmp_path):
    model = short_context["llama"]
    saved = tmp_path / "talk.json"
    code, _, err = chat(
        "--model", model, "-m", "8", "--system", "be brief", input=f"{TURNS}/save {saved}\n"
    )
    assert code == 0, err
    assert "left out" in err  # some turns left the model's window ...
    data = json.loads(saved.read_text())
    roles = [m["role"] for m in data["messages"]]
    assert roles == ["system"] + ["user", "assistant"] * 4  # ... but not the transcript
    assert data["messages"][0]["content"] == "be brief"

    code, _, err = chat(
        "--model", model, "-m", "8", input=f"/load {saved}\none more\n/save {saved}\n"
    )
    assert code == 0, err
    assert "(loaded 4 turn(s)" in err
    again = json.loads(saved.read_text())["messages"]
    assert [m["content"] for m in again[:-2]] == [m["content"] for m in data["messages"]]
    assert again[-2] == {"role": "user", "content": "one more"}


def test_loading_a_broken_file_reports_it_and_keeps_the_chat(chat, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": [{"role": "tool", "content": "x"}]}')
    code, _, err = chat("--model", "tiny", "-m", "4", "--stats", input=f"/load {bad}\nhi\n")
    assert code == 0
    assert "messages.0.role" in err and "fix:" in err
    assert len(turn_sizes(err)) == 1


def test_system_command_sets_the_system_message_the_model_sees(chat, tmp_path):
    saved = tmp_path / "talk.json"
    code, _, err = chat(
        "--model",
        "tiny",
        "-m",
        "4",
        input=f"/system talk like a pirate\nhi\n/system\n/save {saved}\n",
    )
    assert code == 0, err
    assert "(system message: 'talk like a pirate')" in err
    assert json.loads(saved.read_text())["messages"][0] == {
        "role": "system",
        "content": "talk like a pirate",
    }


def test_reset_forgets_the_turns(chat, tmp_path):
    saved = tmp_path / "talk.json"
    _, _, err = chat("--model", "tiny", "-m", "4", input=f"hi\n/reset\n/save {saved}\n")
    assert "(conversation reset)" in err
    assert json.loads(saved.read_text())["messages"] == []


def test_piped_replies_go_to_stdout_and_remarks_to_stderr(chat):
    code, out, err = chat("--model", "tiny", "-m", "4", input="/help\n/nope\nhi\n")
    assert code == 0
    assert "/save FILE" in out  # help answers the command
    assert "unknown command /nope" in err and "unknown" not in out


class InterruptAfter:
    """A stdout that presses Ctrl-C (a real SIGINT) after ``n`` pieces of the answer."""

    def __init__(self, n: int, presses: int = 1) -> None:
        self.n, self.presses, self.pieces, self.text = n, presses, 0, []

    def write(self, text: str) -> None:
        self.text.append(text)
        self.pieces += 1
        if self.pieces == self.n:
            for _ in range(self.presses):
                os.kill(os.getpid(), signal.SIGINT)

    def flush(self) -> None:
        pass


def chat_session(model_dir, out, err):
    from mlx_loom.cli.chat_session import ChatSession

    model, tokenizer = mlx_loom.load(model_dir)
    return ChatSession(
        model,
        tokenizer,
        options={"max_tokens": 16, "temperature": 0.0},
        budget=model.context_length,
        name="test",
        out=out,
        err=err,
    )


@pytest.mark.parametrize("presses", [1, 2])
@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "gemma4"])
def test_after_ctrl_c_the_next_reply_equals_a_fresh_chats(tmp_path, model_type, presses):
    """Stopping an answer (once: at a token boundary; twice: at once) leaves no stale cache."""
    from mlx_loom.cli.conversation import Conversation

    model_dir = family_checkpoint(tmp_path, model_type)
    out, err = InterruptAfter(3, presses), io.StringIO()
    session = chat_session(model_dir, out, err)
    session.handle("the model reads a token")
    assert "(stopped)" in err.getvalue()
    stopped = session.conversation.messages[-1].content
    assert stopped == "".join(out.text[:3]) and stopped
    out.n = -1  # no more presses
    session.handle("and writes the next")
    cached_reply = session.conversation.messages[-1].content

    fresh = chat_session(model_dir, io.StringIO(), io.StringIO())
    fresh.conversation = Conversation(messages=list(session.conversation.messages[:-2]))
    fresh.handle("and writes the next")
    assert fresh.conversation.messages[-1].content == cached_reply

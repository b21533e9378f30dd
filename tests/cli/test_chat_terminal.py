"""``loom chat`` at a real (pseudo-)terminal: keys, readline, history, Ctrl-C, Ctrl-D, /commands."""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path

from .terminal import CTRL_A, CTRL_C, CTRL_D, LEFT, UP

PROMPT = ">> "


def saved_messages(path) -> list[dict]:
    return json.loads(path.read_text())["messages"]


def data_dir(tmp_path) -> Path:
    """The mlx-loom data directory the CLI uses under the test's private home."""
    home = tmp_path / "home"
    if sys.platform == "darwin":
        return home / "Library" / "Application Support" / "mlx-loom"
    return home / "data" / "mlx-loom"  # XDG_DATA_HOME, set by the loom_env fixture


def test_ctrl_d_at_the_prompt_leaves_on_a_fresh_line_with_exit_code_0(terminal):
    term = terminal("chat", "--model", "tiny", "--no-history")
    term.expect(PROMPT)
    term.send(CTRL_D)
    assert term.wait() == 0
    assert term.rest().startswith(("\r\n", "\n"))


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(terminal, long_talker, tmp_path):
    term = terminal("chat", "--model", long_talker, "-m", "100000", "--no-history")
    term.expect(PROMPT)
    term.send("tell me everything\r")
    term.expect("tell me everything")  # the echo of the typed line
    term.expect(" ")  # the answer has started streaming
    term.send(CTRL_C)
    term.expect("(stopped)", timeout=30)
    term.expect(PROMPT)
    term.send(f"/save {tmp_path / 'chat.json'}\r")
    term.expect("(saved 1 turn(s)")
    term.expect(PROMPT)  # keys typed before readline is ready would be cooked by the tty
    term.send(CTRL_D)
    assert term.wait() == 0
    user, assistant = saved_messages(tmp_path / "chat.json")
    assert user == {"role": "user", "content": "tell me everything"}
    assert assistant["role"] == "assistant" and assistant["content"]  # the partial answer kept


def test_ctrl_c_at_the_prompt_drops_the_line_and_keeps_the_chat(terminal, tmp_path):
    term = terminal("chat", "--model", "tiny", "--no-history")
    term.expect(PROMPT)
    term.send("half a thought")
    term.expect("half a thought")
    # CPython's readline loop only notices a signal that interrupts its select();
    # one that lands while it is still echoing the last key waits for the next key.
    time.sleep(0.3)
    term.send(CTRL_C)
    term.expect(PROMPT)
    term.send(f"/save {tmp_path / 'chat.json'}\r")
    term.expect("(saved 0 turn(s)")
    term.expect(PROMPT)  # keys typed before readline is ready would be cooked by the tty
    term.send(CTRL_D)
    assert term.wait() == 0
    assert saved_messages(tmp_path / "chat.json") == []


def test_readline_edits_the_line_before_it_is_sent(terminal, tmp_path):
    term = terminal("chat", "--model", "tiny", "--no-history", "-m", "4")
    term.expect(PROMPT)
    term.send(f"ello wrld{LEFT * 3}o{CTRL_A}h\r")  # fix both typos with the cursor keys
    term.expect(PROMPT)
    term.send(f"/save {tmp_path / 'chat.json'}\r")
    term.expect("(saved")
    term.expect(PROMPT)  # keys typed before readline is ready would be cooked by the tty
    term.send(CTRL_D)
    term.wait()
    assert saved_messages(tmp_path / "chat.json")[0]["content"] == "hello world"


def test_history_persists_privately_and_up_recalls_the_last_session(terminal, loom_env, tmp_path):
    history = data_dir(tmp_path) / "chat_history"
    first = terminal("chat", "--model", "tiny", "-m", "4")
    first.expect(PROMPT)
    first.send("remember this line\r")
    first.expect(PROMPT)
    first.send(CTRL_D)
    assert first.wait() == 0
    assert "remember" in history.read_text()  # libedit escapes the spaces
    assert stat.S_IMODE(history.stat().st_mode) == 0o600

    second = terminal("chat", "--model", "tiny", "-m", "4")
    second.expect(PROMPT)
    second.send(f"{UP}\r")
    second.expect(PROMPT)
    second.send(f"/save {tmp_path / 'chat.json'}\r")
    second.expect("(saved")
    second.expect(PROMPT)  # keys typed before readline is ready would be cooked by the tty
    second.send(CTRL_D)
    second.wait()
    assert saved_messages(tmp_path / "chat.json")[0]["content"] == "remember this line"


def test_no_history_reads_and_writes_no_file(terminal, tmp_path):
    term = terminal("chat", "--model", "tiny", "-m", "4", "--no-history")
    term.expect(PROMPT)
    term.send("not for the record\r")
    term.expect(PROMPT)
    term.send(CTRL_D)
    assert term.wait() == 0
    assert not data_dir(tmp_path).exists()


def test_slash_commands_are_answered_by_the_repl_not_the_model(terminal, tmp_path):
    term = terminal("chat", "--model", "tiny", "--no-history", "--stats")
    term.expect(PROMPT)
    term.send("/help\r")
    help_text = term.expect(PROMPT)
    assert "/save FILE" in help_text and "/system" in help_text and "/reset" in help_text
    term.send("/frobnicate now\r")
    assert "unknown command /frobnicate: /help lists the commands" in term.expect(PROMPT)
    term.send("/he\t\r")  # Tab completes the command name
    assert "/load FILE" in term.expect(PROMPT)
    term.send(f"/save {tmp_path / 'chat.json'}\r")
    term.expect(PROMPT)
    term.send(CTRL_D)
    assert term.wait() == 0
    assert "Generation:" not in term.output  # the model never ran
    assert saved_messages(tmp_path / "chat.json") == []


def test_multi_line_messages_by_backslash_and_triple_quotes(terminal, tmp_path):
    term = terminal("chat", "--model", "tiny", "--no-history", "-m", "4")
    term.expect(PROMPT)
    term.send("first line \\\r")
    term.expect("... ")
    term.send("second line\r")
    term.expect(PROMPT)
    term.send('"""\r')
    term.expect("... ")
    term.send("a block\r")
    term.expect("... ")
    term.send('of text"""\r')
    term.expect(PROMPT)
    term.send(f"/save {tmp_path / 'chat.json'}\r")
    term.expect("(saved 2 turn(s)")
    term.expect(PROMPT)  # keys typed before readline is ready would be cooked by the tty
    term.send(CTRL_D)
    term.wait()
    users = [m["content"] for m in saved_messages(tmp_path / "chat.json") if m["role"] == "user"]
    assert users == ["first line \nsecond line", "a block\nof text"]

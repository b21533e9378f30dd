"""``loom serve``'s limit flags: their defaults, their refusals, and that they reach the server."""

from __future__ import annotations

import pytest

from mlx_loom.cli.main import build_parser, main
from mlx_loom.serve import LoomServer
from mlx_loom.serve.app import DEFAULT_MAX_PROMPT_CHARS
from mlx_loom.serve.connection import ConnectionLimits
from mlx_loom.serve.prepare import DEFAULT_THREADS


def test_the_limit_flags_default_to_the_servers_defaults():
    args = build_parser().parse_args(["serve"])
    limits = ConnectionLimits()
    assert (args.idle_timeout, args.header_timeout, args.body_timeout, args.write_timeout) == (
        limits.idle_timeout,
        limits.header_timeout,
        limits.body_timeout,
        limits.write_timeout,
    )
    assert args.max_connections == limits.max_connections
    assert (args.max_prompt_chars, args.max_prompt_tokens) == (DEFAULT_MAX_PROMPT_CHARS, None)
    assert args.tokenizer_threads == DEFAULT_THREADS


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--idle-timeout", "0"),
        ("--header-timeout", "-1"),
        ("--body-timeout", "nan"),
        ("--write-timeout", "inf"),
        ("--max-connections", "0"),
        ("--tokenizer-threads", "0"),
        ("--max-prompt-chars", "-5"),
        ("--max-prompt-tokens", "1.5"),
    ],
)
def test_a_bad_limit_is_a_usage_error_naming_the_flag(checkpoint, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", str(checkpoint), "--port", "0", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_the_limit_flags_reach_the_running_server(checkpoint, monkeypatch):
    seen: dict[str, object] = {}

    def serve_forever(self: LoomServer, *args, **kwargs) -> None:
        seen.update(
            limits=self.limits,
            threads=self.prepare_pool.threads,
            chars=self.app.max_prompt_chars,
            tokens=self.app.max_prompt_tokens,
        )
        raise KeyboardInterrupt  # as Ctrl-C would

    monkeypatch.setattr(LoomServer, "serve_forever", serve_forever)
    code = main(
        [
            "serve",
            "--model",
            str(checkpoint),
            "--port",
            "0",
            *("--idle-timeout", "4", "--header-timeout", "3", "--body-timeout", "6"),
            *("--write-timeout", "7", "--max-connections", "9", "--tokenizer-threads", "3"),
            *("--max-prompt-chars", "5000", "--max-prompt-tokens", "100"),
        ]
    )
    assert code == 0
    assert seen["limits"] == ConnectionLimits(
        idle_timeout=4, header_timeout=3, body_timeout=6, write_timeout=7, max_connections=9
    )
    assert (seen["threads"], seen["chars"], seen["tokens"]) == (3, 5000, 100)


def test_a_connection_limit_below_rows_plus_queue_is_warned_about(checkpoint, caplog):
    import mlx_loom
    from mlx_loom.serve import make_server

    model, tokenizer = mlx_loom.load(checkpoint)
    with caplog.at_level("WARNING", logger="mlx_loom.serve"):
        server = make_server(model, tokenizer, port=0, max_connections=40)
        server.stop()
    assert "connections are refused before the queue fills" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mlx_loom.serve"):
        server = make_server(model, tokenizer, port=0)
        server.stop()
    assert "queue fills" not in caplog.text

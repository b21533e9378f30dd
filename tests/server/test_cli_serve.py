"""``loom serve``: the command, its defaults, its start-up errors, and a real run."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from mlx_loom.cli.main import build_parser, main


def test_serve_defaults_bind_loopback_port_8080():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8080, None)
    assert args.max_tokens_limit == 4096


def test_a_port_in_use_exits_1_with_a_fix(checkpoint, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", "--model", str(checkpoint), "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 1
    assert f"Cannot listen on 127.0.0.1:{port}" in err and "fix:" in err


def test_an_invalid_max_tokens_limit_is_a_usage_error(checkpoint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", str(checkpoint), "--port", "0", "--max-tokens-limit", "0"])
    assert exit_info.value.code == 2
    assert "argument --max-tokens-limit" in capsys.readouterr().err


def test_loom_serve_serves_until_interrupted(checkpoint):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_loom.cli.main",
            "serve",
            "--model",
            str(checkpoint),
            "--port",
            "0",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()  # "loom: serving ... at http://127.0.0.1:PORT/v1"
        match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert match, line
        url = f"http://127.0.0.1:{match.group(1)}"
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
            models = json.loads(resp.read())
        assert [m["id"] for m in models["data"]] == [str(checkpoint)]
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps({"prompt": "hello", "max_tokens": 3}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)
        proc.stderr.close()


def test_serve_batching_flags_default_to_mlx_lm_servers_values():
    from mlx_loom.cli.serve_cmd import engine_settings

    settings = engine_settings(build_parser().parse_args(["serve"]))
    assert (settings.decode_concurrency, settings.prompt_concurrency) == (32, 8)
    # No chunk set: the engine takes the model's (prefill_step_for its kernels).
    assert (settings.prefill_step_size, settings.prompt_cache_size) == (None, 10)
    assert settings.prefill_token_budget == 2048
    assert settings.prompt_cache_bytes is None and settings.max_queued == 64
    assert settings.idle_seconds is None  # the server keeps its engine thread


def test_serve_batching_flags_are_read_with_sizes_in_units():
    from mlx_loom.cli.serve_cmd import engine_settings

    args = build_parser().parse_args(
        [
            "serve",
            "--decode-concurrency",
            "4",
            "--prompt-concurrency",
            "2",
            "--prefill-step-size",
            "256",
            "--prefill-token-budget",
            "512",
            "--prompt-cache-size",
            "0",
            "--prompt-cache-bytes",
            "1.5GB",
            "--queue-size",
            "3",
        ]
    )
    settings = engine_settings(args)
    assert (settings.decode_concurrency, settings.prompt_concurrency) == (4, 2)
    assert (settings.prefill_step_size, settings.prompt_cache_size) == (256, 0)
    assert settings.prefill_token_budget == 512
    assert settings.prompt_cache_bytes == 1_500_000_000 and settings.max_queued == 3


def test_an_out_of_range_batching_flag_is_a_usage_error(capsys):
    import pytest

    for argv in (
        ["--decode-concurrency", "0"],
        ["--prompt-cache-bytes", "lots"],
        ["--prefill-token-budget", "-1"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["serve", *argv])
        assert exit_info.value.code == 2
        assert argv[0] in capsys.readouterr().err


def test_serve_reads_the_prompt_cache_directory_and_its_disk_bound(tmp_path):
    from mlx_loom.cli.serve_cmd import engine_settings

    argv = ["serve", "--prompt-cache-dir", str(tmp_path), "--prompt-cache-disk-bytes", "20GB"]
    settings = engine_settings(build_parser().parse_args(argv))
    assert settings.prompt_cache_dir == str(tmp_path)
    assert settings.prompt_cache_disk_bytes == 20_000_000_000
    assert engine_settings(build_parser().parse_args(["serve"])).prompt_cache_dir is None

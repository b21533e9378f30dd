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

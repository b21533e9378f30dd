"""Every family through every door with each CPU path: the API, generate, chat and serve."""

from __future__ import annotations

import io
import json
import socket
import urllib.request

import pytest

import mlx_loom
from mlx_loom.cli import generate_cmd
from mlx_loom.cli.main import main
from mlx_loom.serve import make_server
from mlx_loom.testing.checkpoints import write_checkpoint

FAMILIES = ["llama", "qwen3_next", "gemma4_text"]
PATHS = [
    ("float32", "cpu-native"),
    ("checkpoint", "cpu-ops"),
    ("bfloat16", "cpu-native"),
    ("float32", "cpu-native-int8-act"),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family_checkpoint(request, tmp_path_factory):
    claim = mlx_loom.default_host().registry.model_types[request.param]
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    return write_checkpoint(path, claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config))


@pytest.fixture
def loaded(monkeypatch):
    """The models the CLI loads, recorded."""
    models = []
    real_load = generate_cmd.load

    def recording_load(*args, **kwargs):
        model, tokenizer = real_load(*args, **kwargs)
        models.append(model)
        return model, tokenizer

    monkeypatch.setattr(generate_cmd, "load", recording_load)
    return models


def flags(compute_dtype: str, cpu_kernels: str) -> list[str]:
    return ["--compute-dtype", compute_dtype, "--cpu-kernels", cpu_kernels]


@pytest.mark.parametrize("compute_dtype,cpu_kernels", PATHS)
def test_api_generates_on_each_path(family_checkpoint, compute_dtype, cpu_kernels):
    model, tok = mlx_loom.load(
        family_checkpoint, compute_dtype=compute_dtype, cpu_kernels=cpu_kernels
    )
    assert (model.cpu_path.compute_dtype, model.cpu_path.kernel_set) == (
        compute_dtype,
        cpu_kernels,
    )
    text = mlx_loom.generate(model, tok, "hello", max_tokens=6)
    assert isinstance(text, str)


@pytest.mark.parametrize("compute_dtype,cpu_kernels", PATHS)
def test_loom_generate_runs_the_path_it_is_given(
    family_checkpoint, compute_dtype, cpu_kernels, loaded, capsys
):
    argv = ["generate", "--model", str(family_checkpoint), "-p", "hello", "-m", "6"]
    assert main(argv + flags(compute_dtype, cpu_kernels)) == 0, capsys.readouterr().err
    (model,) = loaded
    assert (model.cpu_path.compute_dtype, model.cpu_path.kernel_set) == (
        compute_dtype,
        cpu_kernels,
    )


def test_loom_chat_runs_the_path_it_is_given(family_checkpoint, loaded, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nand then?\n"))
    argv = ["chat", "--model", str(family_checkpoint), "-m", "4", "--stats"]
    assert main(argv + flags("checkpoint", "cpu-ops")) == 0
    assert capsys.readouterr().err.count("Generation:") == 2
    assert loaded[0].cpu_path.kernel_set == "cpu-ops"


def test_loom_serve_loads_the_path_it_is_given(family_checkpoint, loaded, capsys):
    # The server then fails to bind (the port is taken): the model it loaded is what counts.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        argv = ["serve", "--model", str(family_checkpoint), "--port", str(busy.getsockname()[1])]
        assert main(argv + flags("bfloat16", "cpu-ops")) == 1
    assert "Cannot listen" in capsys.readouterr().err
    assert (loaded[0].cpu_path.compute_dtype, loaded[0].cpu_path.kernel_set) == (
        "bfloat16",
        "cpu-ops",
    )


def served_completion(model, tok) -> str:
    """What a server on ``model`` answers to a 6-token completion of "hello"."""
    server = make_server(model, tok, host="127.0.0.1", port=0, model_id="m")
    server.start_in_background()
    try:
        request = urllib.request.Request(
            f"{server.url}/v1/completions",
            data=json.dumps({"prompt": "hello", "max_tokens": 6}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())["choices"][0]["text"]
    finally:
        server.stop()


def test_the_server_answers_on_the_native_kernels(family_checkpoint):
    model, tok = mlx_loom.load(family_checkpoint)
    assert model.cpu_path.kernel_set == "cpu-native"
    expected = mlx_loom.generate(model, tok, "hello", max_tokens=6)
    assert served_completion(model, tok) == expected


# --- int8 activations: 4-bit checkpoints, every door --------------------------

INT8 = ["--compute-dtype", "float32", "--cpu-kernels", "cpu-native-int8-act"]


@pytest.fixture(scope="module", params=FAMILIES)
def q4_checkpoint(request, checkpoints):
    return checkpoints(request.param, "q4")


def int8_modules(model) -> int:
    return sum(bool(getattr(m, "int8_activations", False)) for _, m in model.module.named_modules())


def test_int8_activations_reach_the_api_and_the_server(q4_checkpoint):
    model, tok = mlx_loom.load(q4_checkpoint, cpu_kernels="cpu-native-int8-act")
    assert model.cpu_path.kernel_set == "cpu-native-int8-act" and int8_modules(model) > 0
    expected = mlx_loom.generate(model, tok, "hello", max_tokens=6)
    assert served_completion(model, tok) == expected


def test_int8_activations_reach_generate_chat_and_serve(q4_checkpoint, loaded, capsys, monkeypatch):
    model_flag = ["--model", str(q4_checkpoint)]
    assert main(["generate", *model_flag, "-p", "hello", "-m", "4", *INT8]) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", *model_flag, "-m", "4", *INT8]) == 0
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", *model_flag, "--port", str(busy.getsockname()[1]), *INT8]) == 1
    assert len(loaded) == 3
    for model in loaded:
        assert model.cpu_path.kernel_set == "cpu-native-int8-act" and int8_modules(model) > 0

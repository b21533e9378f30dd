"""Naming models: the bundled short name, ``loom models`` over the hub cache, ``loom explain``."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import mlx_loom
from mlx_loom.artifacts import read_config, resolve_model_ref
from mlx_loom.artifacts.summary import summarize_artifact
from mlx_loom.cli.main import main

from .conftest import family_checkpoint, loom_command

COMMIT = "0123456789abcdef0123456789abcdef01234567"
BRANCH_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def cache_snapshot(cache: Path, repo: str, source: Path, *, commit=COMMIT, ref="main") -> None:
    """Copy ``source`` into the hub cache the way huggingface_hub lays it out (blobs + links)."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        blob = storage / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-sources")
    found = {t: family_checkpoint(root, t) for t in ("llama", "qwen3_next", "gemma4")}
    unknown = root / "unknown"
    shutil.copytree(found["llama"], unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no_such_family"}))
    found["unknown"] = unknown
    partial = root / "partial"
    partial.mkdir()
    shutil.copy(found["llama"] / "config.json", partial / "config.json")
    found["partial"] = partial
    return found


@pytest.fixture(scope="module")
def quantized(checkpoints, tmp_path_factory) -> Path:
    """The Llama checkpoint quantized to 4 bits by mlx-lm's own converter."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, quantize_model, save_config

    model, config = load_model(checkpoints["llama"])
    model, config = quantize_model(model, config, 32, 4)
    dst = tmp_path_factory.mktemp("quantized") / "q4"
    dst.mkdir()
    mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())))
    save_config(config, dst / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoints["llama"] / name, dst / name)
    return dst


@pytest.fixture
def hub(loom_env, checkpoints, quantized) -> Path:
    cache = Path(loom_env["HF_HUB_CACHE"])
    cache_snapshot(cache, "org/llama-tiny", checkpoints["llama"])
    cache_snapshot(cache, "org/llama-tiny", quantized, commit=BRANCH_COMMIT, ref="q4")
    cache_snapshot(cache, "org/qwen-tiny", checkpoints["qwen3_next"])
    cache_snapshot(cache, "org/gemma-tiny", checkpoints["gemma4"])
    cache_snapshot(cache, "org/mystery", checkpoints["unknown"])
    cache_snapshot(cache, "org/half-downloaded", checkpoints["partial"])
    return cache


@pytest.fixture
def run_here(hub, loom_env, monkeypatch, capsys):
    """``run_here(*argv)`` -> (exit code, stdout): ``loom ARGV`` in-process, against the hub."""
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, loom_env[name])

    def run(*argv: str) -> tuple[int, str]:
        code = main([*map(str, argv)])
        return code, capsys.readouterr().out

    return run


# --- the short name ------------------------------------------------------------------


def test_the_short_name_tiny_is_the_bundled_model():
    assert resolve_model_ref("tiny") == mlx_loom.BUNDLED_MODEL
    assert resolve_model_ref("tiny-minicpm5") == mlx_loom.BUNDLED_MODEL
    assert (mlx_loom.BUNDLED_MODEL / "config.json").is_file()


def test_load_accepts_the_short_name():
    model, tokenizer = mlx_loom.load("tiny")
    assert model.model_dir == mlx_loom.BUNDLED_MODEL
    assert mlx_loom.generate(model, tokenizer, "Once upon a time", max_tokens=3)


def test_a_local_directory_named_like_a_short_name_wins(tmp_path, monkeypatch, checkpoints):
    shutil.copytree(checkpoints["llama"], tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_ref("tiny") == Path("tiny")


@pytest.mark.parametrize("command", ["generate", "explain"])  # chat: test_chat_terminal
def test_every_command_accepts_model_tiny(loom, command):
    args = ["explain", "tiny"] if command == "explain" else [command, "--model", "tiny", "-m", "3"]
    result = loom(*args, input="hello\n")
    assert result.returncode == 0, result.stderr
    if command == "explain":
        assert "minicpm5/llama" in result.stdout


def test_loom_serve_accepts_model_tiny_and_serves_it_under_that_id(loom_env, tmp_path):
    proc = subprocess.Popen(
        [*loom_command(), "serve", "--model", "tiny", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env=loom_env,
        cwd=tmp_path,
    )
    try:
        line = proc.stderr.readline()  # "loom: serving tiny at http://127.0.0.1:PORT/v1 ..."
        match = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
        assert match, line
        with urllib.request.urlopen(f"{match[1]}/v1/models", timeout=30) as response:
            assert [m["id"] for m in json.loads(response.read())["data"]] == ["tiny"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()


def test_bundled_model_is_on_the_package_root_without_importing_a_submodule():
    shown = subprocess.run(
        [sys.executable, "-c", "import mlx_loom; print(mlx_loom.BUNDLED_MODEL)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(shown) == mlx_loom.BUNDLED_MODEL


# --- loom models ----------------------------------------------------------------------


def test_models_lists_the_bundled_model_and_runnable_cache_snapshots(loom, hub):
    result = loom("models")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "NAME",
        "MODEL",
        "TYPE",
        "PARAMS",
        "DTYPE",
        "QUANT",
        "CONTEXT",
        "SIZE",
    ]
    names = [line.split()[0] for line in lines[1:] if not line.startswith("(")]
    assert names == [
        "tiny",
        "org/gemma-tiny",
        "org/llama-tiny",
        "org/llama-tiny@q4",
        "org/qwen-tiny",
    ]
    assert "(2 more cannot run here; `loom models --all` says why.)" in result.stdout


def test_models_all_says_why_the_others_cannot_run(run_here):
    code, out = run_here("models", "--all", "--json")
    assert code == 0
    entries = {e["name"]: e for e in json.loads(out)}
    assert not entries["org/mystery"]["runnable"]
    assert "no_such_family" in entries["org/mystery"]["reason"]
    assert not entries["org/half-downloaded"]["runnable"]
    assert "safetensors" in entries["org/half-downloaded"]["reason"]


def test_models_json_reports_size_dtype_quantization_and_context(run_here, checkpoints):
    entries = {e["name"]: e for e in json.loads(run_here("models", "--json")[1])}
    plain, q4 = entries["org/llama-tiny"], entries["org/llama-tiny@q4"]
    assert plain["weights"]["dtype"] == "float32" and plain["weights"]["quantization"] is None
    assert q4["weights"]["quantization_bits"] == [4]
    assert q4["weights"]["quantization"] == "4-bit, group 32"
    assert q4["weights"]["parameters"] == plain["weights"]["parameters"]
    assert q4["weights"]["weights_bytes"] < plain["weights"]["weights_bytes"]
    assert entries["org/qwen-tiny"]["model_type"] == "qwen3_next"
    assert entries["org/gemma-tiny"]["weights"]["context_length"] == 4096
    assert entries["tiny"]["weights"]["context_length"] == 256
    assert (
        plain["weights"]["weights_bytes"]
        == (checkpoints["llama"] / "model.safetensors").stat().st_size
    )


def test_every_listed_name_runs_with_that_name(run_here):
    for entry in json.loads(run_here("models", "--json")[1]):
        code, out = run_here("explain", entry["name"], "--json")
        assert code == 0, entry["name"]
        assert json.loads(out)["model_dir"] == entry["path"]


def test_models_with_an_empty_cache_still_lists_the_bundled_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert main(["models"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["tiny"]


# --- loom explain ---------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "gemma4"])
def test_explain_shows_params_dtype_quantization_and_context(checkpoints, model_type, capsys):
    assert main(["explain", str(checkpoints[model_type])]) == 0
    out = capsys.readouterr().out
    summary = summarize_artifact(checkpoints[model_type], read_config(checkpoints[model_type]))
    rows = dict(
        re.split(r"\s{2,}", line, maxsplit=1)
        for line in out.splitlines()
        if re.search(r"\S\s{2,}\S", line) and not line.startswith(" ")
    )
    assert rows["parameters"].endswith(f"({summary.parameters:,})")
    assert rows["dtype"] == "float32"
    assert rows["quantization"] == "none"
    assert rows["context length"] == ("512" if model_type == "llama" else "4096")


def test_explain_json_counts_a_quantized_checkpoint_like_its_source(checkpoints, quantized, capsys):
    main(["explain", str(checkpoints["llama"]), "--json"])
    source = json.loads(capsys.readouterr().out)["weights"]
    main(["explain", str(quantized), "--json"])
    packed = json.loads(capsys.readouterr().out)["weights"]
    assert packed["parameters"] == source["parameters"]
    assert packed["quantization_bits"] == [4]
    assert source["context_length"] == packed["context_length"] == 512


def test_parameter_count_matches_the_loaded_model(checkpoints):
    from mlx.utils import tree_flatten

    for model_type in ("llama", "qwen3_next", "gemma4"):
        model, _ = mlx_loom.load(checkpoints[model_type])
        loaded = sum(v.size for _, v in tree_flatten(model.module.parameters()))
        summary = summarize_artifact(checkpoints[model_type], model.config)
        assert summary.parameters == loaded, model_type


def test_an_unreadable_cache_is_an_error_with_a_fix(tmp_path, monkeypatch, capsys):
    not_a_dir = tmp_path / "hub"
    not_a_dir.write_text("")
    monkeypatch.setenv("HF_HUB_CACHE", str(not_a_dir))
    assert main(["models"]) == 1
    err = capsys.readouterr().err
    assert "cannot be read" in err and "fix: point HF_HUB_CACHE" in err

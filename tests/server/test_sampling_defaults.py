"""Sampling defaults: generation_config.json, the server's flags, and what a request gives."""

from __future__ import annotations

import json
import logging
import shutil

import anthropic
import openai
import pytest

import mlx_loom
from mlx_loom.errors import RequestError
from mlx_loom.artifacts.generation import read_sampling_defaults
from mlx_loom.cli.main import main
from mlx_loom.engine.defaults import generation_defaults
from mlx_loom.serve import make_server

from .formats import FORMATS, scripted, write_format_checkpoint

USER = {"role": "user", "content": "hello"}
#: Qwen3's published recommendation.
RECOMMENDED = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_format_checkpoint(tmp_path_factory.mktemp("gen") / "ckpt", FORMATS["json_tools"])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, **RECOMMENDED}))
    return path


@pytest.fixture(scope="module")
def loaded(ckpt):
    return mlx_loom.load(ckpt)


def serving(loaded, **options):
    model, tokenizer = loaded
    server = make_server(model, tokenizer, port=0, model_id="m", **options)
    worker = scripted(server)
    server.start_in_background()
    return server, worker


@pytest.fixture(scope="module")
def served(loaded):
    server, worker = serving(loaded)
    yield server, worker
    server.stop()


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def sampled(worker) -> dict:
    s = worker.jobs[-1].sampling
    return {k: s[k] for k in ("temperature", "top_p", "top_k", "min_p")}


def test_generation_config_applies_when_a_request_omits_the_field(served):
    server, worker = served
    worker.script("a", "b", "c")
    client = oai(server)
    client.chat.completions.create(model="m", messages=[USER])
    assert sampled(worker) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    client.completions.create(model="m", prompt="hi", max_tokens=4)
    assert sampled(worker)["temperature"] == 0.6
    anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.create(
        model="m", max_tokens=4, messages=[USER]
    )
    assert sampled(worker)["top_k"] == 20


def test_a_request_value_overrides_the_default(served):
    server, worker = served
    worker.script("a")
    oai(server).chat.completions.create(model="m", messages=[USER], temperature=0, top_p=0.5)
    assert sampled(worker) == {"temperature": 0.0, "top_p": 0.5, "top_k": 20, "min_p": 0.0}


def test_models_show_the_defaults_in_force(served):
    server, _ = served
    card = oai(server).models.list().data[0]
    assert card.model_extra["defaults"] == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "max_tokens": 256,
    }


def test_server_defaults_override_the_checkpoints(loaded):
    server, worker = serving(
        loaded, sampling_defaults={"temperature": 0.9, "min_p": 0.05}, default_max_tokens=32
    )
    try:
        worker.script("a", "b")
        client = oai(server)
        client.chat.completions.create(model="m", messages=[USER])
        assert sampled(worker) == {"temperature": 0.9, "top_p": 0.95, "top_k": 20, "min_p": 0.05}
        assert worker.jobs[-1].max_tokens == 32
        client.chat.completions.create(model="m", messages=[USER], max_tokens=8)
        assert worker.jobs[-1].max_tokens == 8
        defaults = client.models.retrieve("m").model_extra["defaults"]
        assert defaults["temperature"] == 0.9 and defaults["max_tokens"] == 32
    finally:
        server.stop()


def test_the_checkpoints_values_can_be_left_out(loaded):
    server, worker = serving(loaded, generation_config=False)
    try:
        worker.script("a")
        oai(server).chat.completions.create(model="m", messages=[USER])
        assert sampled(worker) == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"sampling_defaults": {"top_p": 2.0}}, "top_p"),
        ({"sampling_defaults": {"temperature": float("nan")}}, "temperature"),
        ({"sampling_defaults": {"seed": 1}}, "seed"),
        ({"default_max_tokens": 5000}, "max_tokens"),
    ],
)
def test_a_bad_server_default_fails_start_up(loaded, options, param):
    model, tokenizer = loaded
    with pytest.raises(RequestError) as info:
        make_server(model, tokenizer, port=0, **options)
    assert info.value.param == param and info.value.fix


def test_hostile_checkpoint_values_are_ignored_with_a_warning(ckpt, tmp_path, caplog):
    path = tmp_path / "hostile"
    shutil.copytree(ckpt, path)
    (path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": "hot",  # wrong type
                "top_p": 7,  # out of range
                "top_k": 2.5,  # not an integer
                "min_p": True,  # a boolean is no number
                "repetition_penalty": 1.1,  # kept
            }
        )
    )
    with caplog.at_level(logging.WARNING):
        assert generation_defaults(path) == {"repetition_penalty": 1.1}
    warned = " ".join(r.getMessage() for r in caplog.records)
    for name in ("temperature", "top_p", "top_k", "min_p"):
        assert name in warned
    # The model still loads and serves.
    model, tokenizer = mlx_loom.load(path)
    server = make_server(model, tokenizer, port=0)
    assert server.app.sampling_defaults == {"repetition_penalty": 1.1}
    server.stop()


def test_do_sample_false_keeps_only_the_repetition_penalty(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"do_sample": False, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.2}
        )
    )
    assert read_sampling_defaults(tmp_path) == {"repetition_penalty": 1.2}
    assert read_sampling_defaults(tmp_path / "missing") == {}


def test_explain_shows_the_checkpoints_defaults(ckpt, capsys):
    assert main(["explain", str(ckpt), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["sampling_defaults"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert main(["explain", str(ckpt)]) == 0
    assert "temperature=0.6, top_p=0.95, top_k=20" in capsys.readouterr().out


def test_serve_refuses_a_bad_default_flag_before_loading(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--top-p", "3", "--port", "0"])
    assert info.value.code == 2
    assert "--top-p" in capsys.readouterr().err


def test_xtc_fields_reach_the_engine_and_are_checked_there(served):
    server, worker = served
    worker.script("a")
    client = oai(server)
    client.chat.completions.create(
        model="m", messages=[USER], extra_body={"xtc_probability": 0.5, "xtc_threshold": 0.2}
    )
    sampling = worker.jobs[-1].sampling
    assert (sampling["xtc_probability"], sampling["xtc_threshold"]) == (0.5, 0.2)
    # The request was built by make_request: EOS is protected from the cut.
    assert set(server.app.tokenizer.eos_token_ids) <= set(
        worker.jobs[-1].request.params.xtc_special_tokens
    )
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="hi", extra_body={"xtc_threshold": 0.9})
    assert info.value.body["param"] == "xtc_threshold"


def test_generate_takes_the_xtc_flags(capsys):
    argv = ["generate", "hi", "-m", "4", "--temp", "1", "--seed", "0", "--xtc-probability", "1"]
    assert main(argv) == 0
    assert "Generation: 4 tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", "--xtc-threshold", "0.7"])
    assert info.value.code == 2
    assert "--xtc-threshold" in capsys.readouterr().err

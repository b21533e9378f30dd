"""``loom generate --generation-config``: the checkpoint's sampling values, under the flags."""

from __future__ import annotations

import pytest

import mlx_loom
from mlx_loom import BUNDLED_MODEL
from mlx_loom.cli.generate_cmd import sampling_kwargs
from mlx_loom.cli.main import build_parser, main


@pytest.fixture(scope="module")
def model():
    # The bundled model's generation_config.json: temperature 0.7, top_p 0.9.
    return mlx_loom.load(BUNDLED_MODEL)[0]


def options(model, *argv: str) -> dict:
    return sampling_kwargs(build_parser().parse_args(["generate", *argv]), model)


def test_without_the_flag_the_checkpoints_values_are_not_applied(model):
    got = options(model)
    assert not {"temperature", "top_p", "top_k", "min_p"} & got.keys()  # mlx-lm's defaults


def test_the_flag_applies_them_and_a_given_flag_wins(model):
    got = options(model, "--generation-config", "--top-p", "0.5")
    assert (got["temperature"], got["top_p"]) == (0.7, 0.5)
    assert options(model, "--generation-config", "--temp", "0")["temperature"] == 0


def test_generate_runs_with_the_checkpoints_values(capsys):
    assert main(["generate", "hi", "-m", "4", "--seed", "0", "--generation-config"]) == 0
    assert "Generation: 4 tokens" in capsys.readouterr().err

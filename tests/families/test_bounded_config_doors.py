"""A hostile config is refused the same way through every door, for every family.

The bounds themselves (time, memory) are tested in ``test_bounded_config``;
here each door — ``mlx_loom.load``, ``loom generate``, ``loom chat``,
``loom serve`` — must turn a 100,000-layer config into the typed
``ConfigError`` naming the field (CLI: exit code 1, the message and a fix on
stderr) before anything is built or served.
"""

from __future__ import annotations

import io
import json

import pytest

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.errors import ConfigError
from mlx_loom.host import PluginHost
from mlx_loom.testing.checkpoints import write_checkpoint

FAMILIES = ["llama", "qwen3_next", "qwen3_5", "gemma4_text", "gemma4"]
NEEDLE = "num_hidden_layers: found 100000"


@pytest.fixture(scope="module", params=FAMILIES)
def hostile_checkpoint(request, tmp_path_factory):
    claim = PluginHost().registry.model_types[request.param]
    config = json.loads(json.dumps(claim.tiny_config))
    path = write_checkpoint(
        tmp_path_factory.mktemp(request.param) / "ckpt", config, claim.checkpoint_tensors(config)
    )
    text = config.get("text_config", config)
    text["num_hidden_layers"] = 100000
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_python_api_raises_a_config_error_naming_the_field(hostile_checkpoint):
    with pytest.raises(ConfigError, match=NEEDLE):
        mlx_loom.load(hostile_checkpoint)


@pytest.mark.parametrize(
    "command",
    [["generate", "-p", "hello", "-m", "4"], ["chat", "-m", "4"], ["serve", "--port", "0"]],
    ids=["generate", "chat", "serve"],
)
def test_every_cli_command_exits_with_the_error_and_its_fix(
    hostile_checkpoint, command, capsys, monkeypatch
):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    code = main([command[0], "--model", str(hostile_checkpoint), *command[1:]])
    err = capsys.readouterr().err
    assert code == 1
    assert NEEDLE in err and "fix:" in err

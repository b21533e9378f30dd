"""Start-up stays cheap: `loom --help` imports none of the heavy modules."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("mlx", "pydantic", "huggingface_hub", "tokenizers", "jinja2", "safetensors")


def test_loom_help_imports_none_of_the_heavy_modules():
    probe = (
        "import contextlib, io, sys\n"
        "from mlx_loom.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"imported at start-up: {done.stdout.strip()}"


def test_the_command_table_matches_each_commands_own_help():
    from mlx_loom.cli.main import COMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, type(a)) and a.choices)
    helps = {action.dest: action.help for action in sub._choices_actions}
    assert helps == {name: help_line for name, (_, help_line) in COMMANDS.items()}


def test_the_package_still_exports_its_api_on_first_use():
    import mlx_loom

    assert callable(mlx_loom.load) and callable(mlx_loom.generate)
    assert mlx_loom.__version__
    assert issubclass(mlx_loom.Refusal, mlx_loom.LoomError)


def test_constants_restated_for_the_parser_equal_their_sources():
    from mlx_loom.cache._buffers import KV_BITS, KV_GROUP_SIZES
    from mlx_loom.cli import flags

    assert (flags.KV_BITS, flags.KV_GROUP_SIZES) == (KV_BITS, KV_GROUP_SIZES)


def test_the_parsers_cpu_choices_equal_the_registered_ones():
    # The CLI restates them so that building the parser imports no MLX.
    import argparse

    from mlx_loom.cli.generate_cmd import add_cpu_path_options
    from mlx_loom.cpu.path import COMPUTE_DTYPES, KERNEL_SETS

    parser = argparse.ArgumentParser()
    add_cpu_path_options(parser)
    choices = {a.dest: a.choices for a in parser._actions if a.choices}
    assert set(choices["cpu_kernels"]) == set(KERNEL_SETS)
    assert set(choices["compute_dtype"]) == set(COMPUTE_DTYPES)

"""Start-up stays cheap: `loom --help` builds its parser without the heavy imports."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("mlx", "pydantic", "huggingface_hub", "tokenizers", "jinja2", "safetensors")


def test_building_the_cli_parser_imports_none_of_the_heavy_modules():
    probe = (
        "import sys\n"
        "from mlx_loom.cli.main import build_parser\n"
        "build_parser().format_help()\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"imported at start-up: {done.stdout.strip()}"


def test_the_package_still_exports_its_api_on_first_use():
    import mlx_loom

    assert callable(mlx_loom.load) and callable(mlx_loom.generate)
    assert mlx_loom.__version__
    assert issubclass(mlx_loom.Refusal, mlx_loom.LoomError)


def test_serve_default_limit_restated_for_the_parser_equals_the_servers():
    from mlx_loom.cli import serve_cmd
    from mlx_loom.serve import DEFAULT_MAX_TOKENS_LIMIT

    assert serve_cmd.DEFAULT_MAX_TOKENS_LIMIT == DEFAULT_MAX_TOKENS_LIMIT

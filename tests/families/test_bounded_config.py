"""Hostile sizes in config.json are refused before any graph or buffer is built.

Each case is a real tiny checkpoint of one model type whose ``config.json``
is then edited (a 600-byte file asking for 100,000 layers, a size past int32,
``Infinity`` where a finite float is required ...). Every case loads through
``mlx_loom``'s resolution and build in one child process whose address space
is capped (``RLIMIT_AS``) at 1.5 GiB; the child measures each case's wall time
and its growth of peak resident memory. A refusal must be typed, name the
field or tensor, and stay inside the bounds: a few seconds, and under 64 MiB
of new resident memory (before the fix, 100,000 layers built the graph first
and passed 8 GB in 30 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from mlx_loom.host import PluginHost
from mlx_loom.testing.checkpoints import write_checkpoint

INT32_PAST = 2**31  # one past the largest MLX dimension
HUGE = 2**31 - 1  # within int32, far past any header
MAX_SECONDS = 10.0
MAX_NEW_RSS_MB = 64
ADDRESS_SPACE = 3 << 29  # 1.5 GiB: importing MLX needs ~0.25 GiB

# (case id, model type, edit of the text fields, error type, text the message must contain)
CASES: list[tuple[str, str, dict[str, Any], str, str]] = []
for model_type in ("llama", "qwen3_next", "qwen3_5", "gemma4_text", "gemma4", "qwen3", "qwen3_moe"):
    CASES += [
        (
            f"{model_type}-100000-layers",
            model_type,
            {"num_hidden_layers": 100000},
            "ConfigError",
            "num_hidden_layers: found 100000",
        ),
        (
            f"{model_type}-60000-layers-vs-headers",
            model_type,
            # Gemma's tiny config lists its layer kinds; drop them so 60000 is consistent.
            {"num_hidden_layers": 60000, "layer_types": None},
            "WeightsError",
            "config.json describes",
        ),
        (
            f"{model_type}-hidden-past-int32",
            model_type,
            {"hidden_size": INT32_PAST},
            "ConfigError",
            f"hidden_size: found {INT32_PAST}",
        ),
        (
            f"{model_type}-vocab-at-int32-vs-headers",
            model_type,
            {"vocab_size": HUGE},
            "WeightsError",
            f"({HUGE}, ",
        ),
        (
            f"{model_type}-eps-nan",
            model_type,
            {"rms_norm_eps": float("nan")},
            "ConfigError",
            "rms_norm_eps: found nan",
        ),
        (
            f"{model_type}-layers-as-bool",
            model_type,
            {"num_hidden_layers": True},
            "ConfigError",
            "num_hidden_layers: found True",
        ),
    ]
CASES += [
    ("llama-rope-theta-inf", "llama", {"rope_theta": float("inf")}, "ConfigError", "rope_theta"),
    (
        "llama-yarn-factor-inf",
        "llama",
        {"rope_scaling": {"rope_type": "yarn", "factor": float("inf")}},
        "ConfigError",
        "rope_scaling",
    ),
    (
        "qwen3_next-rope-theta-inf",
        "qwen3_next",
        {"rope_theta": float("inf")},
        "ConfigError",
        "rope_theta: found inf",
    ),
    (
        "qwen3_next-experts-at-int32",
        "qwen3_next",
        {"num_experts": HUGE},
        "WeightsError",
        f"num_experts = {HUGE}",
    ),
    (
        "qwen3_5-rope-parameters-theta-inf",
        "qwen3_5",
        {"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
        "ConfigError",
        "text_config.rope_parameters.rope_theta",
    ),
    (
        "gemma4_text-rope-parameters-theta-inf",
        "gemma4_text",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "proportional", "rope_theta": float("inf")}
            }
        },
        "ConfigError",
        "rope_parameters",
    ),
    (
        "gemma4_text-experts-at-int32",
        "gemma4_text",
        {"num_experts": HUGE},
        "WeightsError",
        "router",
    ),
    (
        "gemma4_text-window-pattern-at-int32",
        "gemma4_text",
        {"sliding_window_pattern": HUGE, "layer_types": None},
        "WeightsError",
        "self_attn",
    ),
    (
        "qwen3_moe-experts-at-int32",
        "qwen3_moe",
        {"num_experts": HUGE},
        "WeightsError",
        "per-expert tensors",
    ),
    (
        "qwen3_moe-100000-mlp-only-layers",
        "qwen3_moe",
        {"mlp_only_layers": list(range(100_000))},
        "ConfigError",
        "mlp_only_layers",
    ),
    (
        "gemma4-softcap-inf",
        "gemma4",
        {"final_logit_softcapping": float("inf")},
        "ConfigError",
        "text_config.final_logit_softcapping: found inf",
    ),
]

_CHILD = textwrap.dedent(
    """
    import json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    from mlx_loom.host import resolve_model
    from mlx_loom.loader import build_model

    def peak_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024

    out = {{}}
    for case, path in json.loads(sys.argv[1]).items():
        before, start = peak_mb(), time.monotonic()
        try:
            build_model(resolve_model(path))
            outcome = ("loaded", "")
        except Exception as err:
            outcome = (type(err).__name__, str(err))
        out[case] = {{
            "error": outcome[0],
            "message": outcome[1],
            "seconds": time.monotonic() - start,
            "new_rss_mb": peak_mb() - before,
        }}
    print(json.dumps(out))
    """
)


def _edited(config: dict[str, Any], edit: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config", config)
    for key, value in edit.items():
        if value is None:
            text.pop(key, None)
        else:
            text[key] = value
    return config


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Every case loaded once, in one bounded child process."""
    root = tmp_path_factory.mktemp("bounded")
    claims = PluginHost().registry.model_types
    clean: dict[str, Path] = {}
    for model_type in {c[1] for c in CASES}:
        claim = claims[model_type]
        cfg = json.loads(json.dumps(claim.tiny_config))
        clean[model_type] = write_checkpoint(root / model_type, cfg, claim.checkpoint_tensors(cfg))
    paths = {}
    for case, model_type, edit, _, _ in CASES:
        path = root / case
        path.mkdir()
        source = clean[model_type]
        (path / "model.safetensors").symlink_to(source / "model.safetensors")
        config = _edited(json.loads((source / "config.json").read_text()), edit)
        (path / "config.json").write_text(json.dumps(config))
        paths[case] = str(path)
    child = subprocess.run(
        [sys.executable, "-c", _CHILD.format(limit=ADDRESS_SPACE), json.dumps(paths)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "case,error,needle", [(c[0], c[3], c[4]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_hostile_config_is_refused_quickly_with_small_memory(outcomes, case, error, needle):
    got = outcomes[case]
    assert got["error"] == error, got["message"][:500]
    assert needle in got["message"], got["message"][:500]
    assert got["seconds"] < MAX_SECONDS
    assert got["new_rss_mb"] < MAX_NEW_RSS_MB

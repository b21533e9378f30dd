"""Every family's factory attaches the checkpoint's weights without reading them.

The core owns evaluation: ``mlx_loom.load`` evaluates the weights, unless the
caller asks for ``lazy=True``, in which case nothing is read until the first
forward. A factory that evaluated on its own would make ``lazy`` a lie.
"""

from __future__ import annotations

import gc
import json

import mlx.core as mx
import pytest

from mlx_loom.host import PluginHost, resolve_model
from mlx_loom.loader import build_model
from mlx_loom.testing.checkpoints import write_checkpoint

#: Every model type an installed plugin claims with a tiny config (new families included).
MODEL_TYPES = sorted(
    name for name, claim in PluginHost().registry.model_types.items() if claim.tiny_config
)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_lazy_build_reads_no_weights_until_they_are_evaluated(model_type, tmp_path):
    claim = PluginHost().registry.model_types[model_type]
    config = json.loads(json.dumps(claim.tiny_config))
    path = write_checkpoint(tmp_path / "ckpt", config, claim.checkpoint_tensors(config))
    stored = (path / "model.safetensors").stat().st_size
    resolved = resolve_model(path)
    # Earlier tests' garbage freed mid-measurement would read as negative growth.
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    model = build_model(resolved, lazy=True)
    built = mx.get_active_memory()
    mx.eval(model.module.parameters())
    evaluated = mx.get_active_memory()
    assert built - before < stored // 10
    assert evaluated - before >= stored // 2

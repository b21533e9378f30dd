"""A split model's followers build rank 0's requests with the same KV codec."""

from __future__ import annotations

import mlx_loom
from mlx_loom.serve.ranks import build, describe
from mlx_loom.serve.worker import Job
from mlx_loom.testing.checkpoints import write_checkpoint


def test_rank_0s_description_of_a_job_carries_its_kv_codec(tmp_path):
    claim = mlx_loom.default_host().registry.model_types["llama"]
    ckpt = write_checkpoint(
        tmp_path / "ckpt", claim.tiny_config, claim.checkpoint_tensors(claim.tiny_config)
    )
    model, tokenizer = mlx_loom.load(ckpt)
    job = Job(prompt=[5, 6, 7], max_tokens=3, kv_codec="turboquant", kv_bits=3)
    request = build(model, tokenizer, describe(job))
    assert (request.kv.codec, request.kv.bits) == ("turboquant", 3)

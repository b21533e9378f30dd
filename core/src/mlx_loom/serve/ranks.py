"""``loom serve`` across ranks: rank 0 serves HTTP, the others run every request with it.

Rank 0's server submits each request to its engine with :func:`describe`'s
plain description of it; its engine announces the submission with that
description (:mod:`mlx_loom.engine.lockstep_service`), and the other ranks, which
run :func:`follow_jobs` instead of a server, build the same request from it
(:func:`build`) and run it in the same engine step. Cancellations (a client
going away) are rank 0's engine's, announced the same way, so the other
ranks' requests leave their batches at the same step. Their output is
discarded: rank 0 answers the clients.

A request that fails fails alike on every rank (the same engine, the same
tokens); a rank that fails where rank 0 did not cannot rejoin, so its
process exits with the error and ``mlx.launch`` stops the group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlx_loom.engine.lockstep_service import lockstep_of
from mlx_loom.engine.params import SamplingParams
from mlx_loom.engine.request import make_request
from mlx_loom.errors import ParallelRefused

if TYPE_CHECKING:
    from mlx_loom.engine.request import Request
    from mlx_loom.model import Model
    from mlx_loom.serve.worker import Job
    from mlx_loom.text import Tokenizer

__all__ = ["build", "describe", "follow_jobs"]


def describe(job: Job) -> dict[str, Any]:
    """What the other ranks need to build ``job``'s request: plain JSON."""
    return {
        "prompt": list(job.prompt),
        "max_tokens": job.max_tokens,
        "stop": list(job.stop),
        "sampling": job.sampling,
        "kv_bits": job.kv_bits,
        "kv_group_size": job.kv_group_size,
        "quantized_kv_start": job.quantized_kv_start,
        "kv_codec": job.kv_codec,
    }


def build(model: Model, tokenizer: Tokenizer, spec: dict[str, Any]) -> Request:
    """The request :func:`describe` described, as rank 0's server built it."""
    sampling = dict(spec["sampling"])
    bias = sampling.get("logit_bias")
    if bias is not None:  # JSON object keys are strings; logit_bias maps token ids
        sampling["logit_bias"] = {int(k): v for k, v in bias.items()}
    return make_request(
        model,
        tokenizer,
        spec["prompt"],
        max_tokens=spec["max_tokens"],
        params=SamplingParams(**sampling),
        stop=spec["stop"],
        kv_bits=spec["kv_bits"],
        kv_group_size=spec["kv_group_size"],
        quantized_kv_start=spec["quantized_kv_start"],
        kv_codec=spec.get("kv_codec"),
    )


def follow_jobs(model: Model, tokenizer: Tokenizer) -> int:
    """Run every request rank 0's server runs, in step with it, until it stops; the count."""
    info = model.parallel
    assert info is not None and not info.leader
    service = lockstep_of(model)
    built = 0

    def builder(spec: dict[str, Any]) -> Request:
        nonlocal built
        try:
            request = build(model, tokenizer, spec)
        except Exception as err:
            raise ParallelRefused(
                f"Rank {info.rank} could not build a request rank 0 runs "
                f"({type(err).__name__}: {err}); the ranks can no longer run in step.",
                fix="Run the same mlx-loom version and model on every rank; if they are, "
                "report it.",
            ) from err
        built += 1
        return request

    service.follow(builder)
    return built

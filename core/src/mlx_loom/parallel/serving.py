"""``loom serve`` across ranks: rank 0 serves HTTP, the others run every job with it.

Rank 0's generation worker tells the other ranks each job it starts
(:meth:`JobChannel.begin`) and, after every token, whether the job goes on
(:meth:`JobChannel.token`) — the one thing they cannot work out themselves,
because a client can go away at any token. Everything else follows from the
shared job: the same prompt-cache reuse, the same tokens, the same stop.

:func:`follow_jobs` is what the other ranks run instead of a server. A job
that fails fails alike on every rank (request validation, for instance),
and both sides then exchange one status, so they stay in step; a rank that
fails where rank 0 did not cannot rejoin and raises, which stops the group
(``mlx.launch`` ends the other ranks when one exits with an error).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlx_loom.errors import ParallelRefused

from .lockstep import Lockstep

if TYPE_CHECKING:
    from mlx_loom.model import Model
    from mlx_loom.text import Tokenizer

__all__ = ["JobChannel", "follow_jobs"]

#: After each token: go on, or stop (finished, or the client went away).
GO, STOP = 0, 1
#: The job failed on rank 0 (``FAILED_RESET``: and its prompt cache was reset).
FAILED, FAILED_RESET = 2, 3


class JobChannel:
    """Rank 0's side: announce jobs and per-token decisions to the other ranks."""

    def __init__(self, lockstep: Lockstep) -> None:
        self._lockstep = lockstep

    @classmethod
    def for_model(cls, model: Model) -> JobChannel | None:
        """A channel when ``model`` is split across ranks, else ``None``."""
        return None if model.parallel is None else cls(model.parallel.lockstep())

    def begin(self, prompt: list[int], options: dict[str, Any]) -> None:
        """A job starts: its prompt and the ``stream_generate`` options it runs with."""
        self._lockstep.share({"prompt": prompt, "options": options})

    def token(self, *, last: bool) -> None:
        self._lockstep.share_int(STOP if last else GO)

    def failed(self, *, reset: bool) -> None:
        self._lockstep.share_int(FAILED_RESET if reset else FAILED)

    def close(self) -> None:
        """No more jobs: the other ranks return from :func:`follow_jobs`."""
        self._lockstep.share(None)


def _options(options: dict[str, Any]) -> dict[str, Any]:
    # JSON object keys are strings; logit_bias maps token ids.
    bias = options.get("logit_bias")
    if bias is not None:
        options = {**options, "logit_bias": {int(k): v for k, v in bias.items()}}
    return options


def follow_jobs(model: Model, tokenizer: Tokenizer) -> int:
    """Run every job rank 0 announces, in step with it, until it closes; returns the count."""
    from mlx_loom.generate import PromptCache, stream_generate
    from mlx_loom.host import PROMPT_CACHE

    assert model.parallel is not None and not model.parallel.leader
    lockstep = model.parallel.lockstep()
    prompt_cache = PromptCache(model) if PROMPT_CACHE in model.capabilities else None
    jobs = 0
    while (job := lockstep.share()) is not None:
        jobs += 1
        stream = None
        try:
            stream = stream_generate(
                model,
                tokenizer,
                job["prompt"],
                prompt_cache=prompt_cache,
                **_options(job["options"]),
            )
            for _ in stream:
                status = lockstep.share_int()
                if status != GO:
                    break
            else:
                continue
        except Exception as err:
            status = lockstep.share_int()
            if status not in (FAILED, FAILED_RESET):
                raise ParallelRefused(
                    f"Rank {model.parallel.rank} failed a job that rank 0 ran on "
                    f"({type(err).__name__}: {err}); the ranks can no longer run in step.",
                    fix="Restart the server; if it happens again, report it.",
                ) from err
        finally:
            if stream is not None:
                stream.close()
        if status == FAILED_RESET and prompt_cache is not None:
            prompt_cache.reset()
    return jobs

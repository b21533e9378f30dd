"""How an engine schedules: batch sizes, prefill chunking, the shared prefix store.

The names and meanings are mlx-lm's server flags (``--decode-concurrency``,
``--prompt-concurrency``, ``--prefill-step-size``, ``--prompt-cache-size``,
``--prompt-cache-bytes``), so a server configured for one means the same on
the other. Validated at the boundary: a bad value is a
:class:`~mlx_loom.errors.RequestError` naming the setting.
"""

from __future__ import annotations

import os

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from mlx_loom.errors import RequestError

#: mlx-lm's server defaults.
DEFAULT_DECODE_CONCURRENCY = 32
DEFAULT_PROMPT_CONCURRENCY = 8
DEFAULT_PREFILL_STEP = 2048
#: Prefill chunk where the native CPU kernels run: llama.cpp's physical batch.
#: Their GEMM computes every row on its own, so a chunk of more than 32 rows
#: changes no result (a smaller one, at any chunk size, sums in the
#: matrix-vector kernel's order), and on this path a 512-token chunk prefills
#: as fast as 2048 while a 2048-token prompt's peak memory drops by about a
#: third (docs/cpu.md, "Peak memory").
NATIVE_CPU_PREFILL_STEP = 512
#: Prompt tokens one engine step prefills while rows decode (one default chunk).
DEFAULT_PREFILL_TOKEN_BUDGET = 2048
DEFAULT_PROMPT_CACHE_SIZE = 10


class EngineSettings(BaseModel):
    """Scheduling settings of one engine. Frozen: change them with ``model_copy(update=...)``.

    * ``decode_concurrency``: most requests decoding together (rows in the
      decode batches, plus prompts being prefilled, which will join them).
    * ``prompt_concurrency``: most prompts prefilled at once; each advances
      by one chunk per engine step, between decode steps of the running rows.
    * ``prefill_step_size``: tokens per prefill chunk for requests that do
      not set their own (``None``: :func:`prefill_step_for` the model's
      kernels). Smaller chunks bound how long a new prompt stalls the
      running streams and the memory a prefill forward takes.
    * ``prefill_token_budget``: while any row decodes, most prompt tokens
      one step prefills between two decode steps (``0``: no bound, every
      prefilling prompt advances by a chunk each step). Prompts take the
      budget first come, first served; a chunk is never cut (the chunk grid
      is what makes a prompt's caches equal a lone prefill's), so the first
      prompt always advances by one chunk even when that chunk alone is
      larger. Without it, eight long prompts arriving at once put eight
      chunks between two tokens of every running stream.
    * ``prompt_cache_size`` / ``prompt_cache_bytes``: bounds of the shared
      prefix store (``0`` entries disables it; ``None`` bytes means no byte
      bound). The Python API's default engine keeps no store, so a plain
      ``generate`` call keeps nothing alive after it returns.
    * ``checkpoint_chunks``: for caches that cannot trim (recurrent state,
      sliding windows), the prefix store keeps a checkpoint at every turn
      boundary of a prompt and every this many prefill chunks (``0``: at turn
      boundaries and the prompt's end only); see :mod:`mlx_loom.engine.splits`.
    * ``prompt_cache_dir`` / ``prompt_cache_disk_bytes``: the prefix store's
      disk tier (:mod:`mlx_loom.engine.disk`): entries evicted from memory,
      and all of them when the engine stops, are written there as verified
      prompt-cache files and serve later requests and restarted engines;
      ``None`` bytes means no bound on disk. Needs ``prompt_cache_size > 0``.
    * ``max_queued``: requests that may wait for a free row; ``None`` is
      unbounded. Past it, :meth:`EngineService.submit` raises
      :class:`~mlx_loom.errors.EngineBusy` (the server answers 503).
    * ``max_kv_bytes``: most bytes the running requests' KV caches may hold,
      each counted at its fullest (prompt plus ``max_tokens``); a request
      that does not fit waits for running ones to finish, one that could
      never fit is failed with :class:`~mlx_loom.errors.KVBudgetExceeded`
      (the server answers 503). ``None``: rows are bounded by count only.
      See :mod:`mlx_loom.engine.kv_budget` for what it counts.
    * ``idle_seconds``: how long the engine thread waits for work before it
      exits (it restarts on the next request; the prefix store survives), so
      that an idle model holds no thread; ``None`` keeps it for good (the
      server does).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    decode_concurrency: int = DEFAULT_DECODE_CONCURRENCY
    prompt_concurrency: int = DEFAULT_PROMPT_CONCURRENCY
    prefill_step_size: int | None = None
    prefill_token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET
    prompt_cache_size: int = 0
    prompt_cache_bytes: int | None = None
    checkpoint_chunks: int = 4
    prompt_cache_dir: str | None = None
    prompt_cache_disk_bytes: int | None = None
    max_queued: int | None = None
    max_kv_bytes: int | None = None
    idle_seconds: float | None = 5.0

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            name = str(err["loc"][0]) if err["loc"] else "settings"
            reason = err["msg"].removeprefix("Value error, ")
            raise RequestError(
                f"invalid engine setting {name}={err.get('input')!r}: {reason}.",
                fix=f"pass {name} as described in EngineSettings",
            ) from None

    @field_validator("decode_concurrency", "prompt_concurrency", mode="before")
    @classmethod
    def _positive(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("it must be an int >= 1")
        return value

    @field_validator("prefill_step_size", mode="before")
    @classmethod
    def _step(cls, value: Any) -> Any:
        if value is None:
            return value  # the model's default: prefill_step_for()
        return cls._positive(value)

    @field_validator("prompt_cache_size", mode="before")
    @classmethod
    def _count(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError("it must be an int >= 0 (0 disables the prefix store)")
        return value

    @field_validator("prefill_token_budget", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError("it must be an int >= 0 (0: no bound)")
        return value

    @field_validator("checkpoint_chunks", mode="before")
    @classmethod
    def _chunks(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError("it must be an int >= 0 (0 checkpoints at turn boundaries only)")
        return value

    @field_validator("prompt_cache_dir", mode="before")
    @classmethod
    def _directory(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value or "\x00" in value:
            raise ValueError("it must be None or a directory path")
        return value

    @field_validator(
        "prompt_cache_bytes", "prompt_cache_disk_bytes", "max_queued", "max_kv_bytes", mode="before"
    )
    @classmethod
    def _optional_count(cls, value: Any) -> Any:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ValueError("it must be None or an int >= 0")
        return value

    @field_validator("idle_seconds", mode="before")
    @classmethod
    def _seconds(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
            raise ValueError("it must be a positive number of seconds below 1e6, or None")
        return float(value)


def prefill_step_for(kernel_set: str | None) -> int:
    """The prefill chunk for requests and engines that set none: smaller on the
    native CPU kernels (``NATIVE_CPU_PREFILL_STEP``: the same results wherever
    a chunk has more than 32 rows, the same speed, less memory), mlx-lm's 2048 elsewhere — on MLX's own operations the chunk
    is part of the arithmetic the parity tests hold equal to mlx-lm's."""
    if kernel_set is not None and kernel_set.startswith("cpu-native"):
        return NATIVE_CPU_PREFILL_STEP
    return DEFAULT_PREFILL_STEP

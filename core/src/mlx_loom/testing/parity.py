"""Parity with mlx-lm: one tiny checkpoint, both engines, the same greedy tokens and logits.

mlx-lm is this project's numerical oracle. A family proves its graph the same
way whichever it is::

    from mlx_loom.testing import parity

    path = parity.write_hf_checkpoint(tmp_path / "hf", config, dtype=mx.bfloat16)
    parity.compare_with_mlx_lm(path)                       # Hugging Face layout
    q4 = parity.quantize_checkpoint(path, tmp_path / "q4", bits=4, group_size=32)
    parity.compare_with_mlx_lm(q4)                         # MLX layout, 4-bit affine

The weights are shaped by **mlx-lm's own model class** for the config (the
class its loader picks, remappings included), so the checkpoint is one mlx-lm
can load by construction; a family whose Hugging Face names differ from
mlx-lm's passes ``to_hf`` (the inverse of mlx-lm's ``sanitize``: unstack
experts ...). Our side loads through the core's resolution and build — the
path ``mlx_loom.load`` takes — on the oracle's arithmetic
(``compute_dtype="checkpoint"``, ``cpu_kernels="cpu-ops"``), so the
comparison is bit-equal: :func:`assert_same_run` holds every step's logits to
``mx.array_equal`` and the greedy tokens to equality.

mlx-lm is a test dependency only: it is imported inside these functions, so
importing :mod:`mlx_loom.testing` never needs it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..host import resolve_model
from ..loader import build_model
from ..model import Model
from .oracle import oracle_options

__all__ = [
    "PROMPT",
    "STEPS",
    "Run",
    "assert_same_run",
    "compare_with_mlx_lm",
    "greedy",
    "load_oracle",
    "load_ours",
    "mlx_lm_cache",
    "oracle_model",
    "quantize_checkpoint",
    "write_hf_checkpoint",
    "write_mlx_checkpoint",
]

#: A 12-token prompt (ids below 256: every tiny config's vocabulary holds them).
PROMPT: tuple[int, ...] = (3, 17, 42, 99, 7, 250, 128, 64, 5, 11, 200, 31)
#: Greedy decode steps after the prefill: long enough to cross small windows.
STEPS = 64

#: ``to_hf(weights) -> weights``: mlx-lm's parameter names to the Hugging Face ones.
ToHF = Callable[[dict[str, mx.array]], dict[str, mx.array]]

_DTYPE_NAMES = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}


def _mlx_lm_utils() -> ModuleType:
    # mlx-lm is a test dependency, never a run-time one: imported only when a test asks.
    from mlx_lm import utils

    return utils


def mlx_lm_cache(model: Any) -> list[Any]:
    """mlx-lm's caches for its model, as its generate makes them (``make_prompt_cache``)."""
    # mlx-lm is a test dependency, never a run-time one: imported only when a test asks.
    from mlx_lm.models.cache import make_prompt_cache

    return cast(list[Any], make_prompt_cache(model))


def _as_oracle(config: Mapping[str, Any], oracle_type: str | None) -> dict[str, Any]:
    return dict(config) | ({"model_type": oracle_type} if oracle_type else {})


@dataclass(frozen=True)
class Run:
    """A greedy run: the last-position logits of every forward, and the tokens picked."""

    logits: list[mx.array]
    tokens: list[list[int]]  # one list per row: the prefill's pick, then one per decode step


def oracle_model(
    config: Mapping[str, Any],
    *,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
    oracle_type: str | None = None,
) -> Any:
    """mlx-lm's own model for ``config`` with seeded random weights (what it would load).

    ``oracle_type`` names the mlx-lm model type that implements the
    architecture when the config's own ``model_type`` is one mlx-lm does not
    know (a new family built on a Llama graph: ``oracle_type="llama"``).

    Values are large enough that greedy picks differ from step to step: norm
    gains ``1 + 0.1 * N(0, 1)``, everything else ``0.2 * N(0, 1)``.
    """
    utils = _mlx_lm_utils()
    cfg = _as_oracle(config, oracle_type)
    model_class, args_class = utils._get_classes(config=cfg)
    model = model_class(args_class.from_dict(cfg))
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    shapes = {name: tuple(p.shape) for name, p in params}
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    weights: dict[str, mx.array] = {}
    for key, name in zip(keys, sorted(shapes), strict=True):
        noise = mx.random.normal(shapes[name], key=key)
        norm = len(shapes[name]) == 1 and "norm" in name
        weights[name] = (1.0 + 0.1 * noise if norm else 0.2 * noise).astype(dtype)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def write_hf_checkpoint(
    path: str | Path,
    config: Mapping[str, Any],
    *,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
    to_hf: ToHF | None = None,
    oracle_type: str | None = None,
) -> Path:
    """A tiny checkpoint in Hugging Face layout: ``config.json`` + ``model.safetensors``.

    Tensor names are mlx-lm's parameter names mapped by ``to_hf`` (identity by
    default: for most families mlx-lm keeps the Hugging Face names), stored in
    ``dtype`` with the ``"pt"`` format tag transformers writes. ``config.json``
    is ``config`` as given (see :func:`oracle_model` for ``oracle_type``).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = oracle_model(config, dtype=dtype, seed=seed, oracle_type=oracle_type)
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    weights = dict(params)
    if to_hf is not None:
        weights = to_hf(weights)
    cfg = {"torch_dtype": _DTYPE_NAMES.get(dtype, "float32"), **config}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    return path


def write_mlx_checkpoint(
    path: str | Path,
    config: Mapping[str, Any],
    *,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
    bits: int | None = None,
    group_size: int = 64,
    oracle_type: str | None = None,
) -> Path:
    """A tiny checkpoint in MLX layout, as ``mlx_lm.convert`` writes it (``bits``: quantized)."""
    utils = _mlx_lm_utils()
    path = Path(path)
    model = oracle_model(config, dtype=dtype, seed=seed, oracle_type=oracle_type)
    cfg = {"torch_dtype": _DTYPE_NAMES.get(dtype, "float32"), **config}
    if bits is not None:
        model, cfg = utils.quantize_model(model, cfg, group_size, bits)
    utils.save_model(path, model)
    utils.save_config(cfg, path / "config.json")
    return path


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    bits: int,
    group_size: int,
    predicate: Callable[[str, nn.Module], bool | dict[str, Any]] | None = None,
    oracle_type: str | None = None,
) -> Path:
    """Quantize ``src`` with mlx-lm's own converter path into ``dst`` (MLX layout).

    ``predicate(path, module)`` is mlx-lm's per-module recipe (``False``:
    leave it; a dict: its own bits / group size). The written ``config.json``
    keeps ``src``'s ``model_type`` (see :func:`oracle_model` for ``oracle_type``).
    """
    utils = _mlx_lm_utils()
    dst = Path(dst)
    own_type = json.loads((Path(src) / "config.json").read_text())["model_type"]
    model, config = utils.load_model(Path(src), model_config=_as_oracle({}, oracle_type))
    model, config = utils.quantize_model(model, config, group_size, bits, quant_predicate=predicate)
    config["model_type"] = own_type
    utils.save_model(dst, model)
    utils.save_config(config, dst / "config.json")
    return dst


def load_ours(path: str | Path, **options: Any) -> Model:
    """The checkpoint as ``mlx_loom.load`` builds it (minus the tokenizer), on mlx-lm's arithmetic.

    ``options`` go to the core's resolution; the defaults are the oracle's
    arithmetic: the checkpoint's dtype on MLX's own operations.
    """
    options = {**oracle_options(), **options}
    return build_model(resolve_model(Path(path), **options))


def load_oracle(path: str | Path, *, oracle_type: str | None = None) -> Any:
    """The checkpoint as mlx-lm loads it (read as ``oracle_type`` when given)."""
    return _mlx_lm_utils().load_model(Path(path), model_config=_as_oracle({}, oracle_type))[0]


def greedy(
    model: Any,
    prompt: mx.array,
    cache: list[Any],
    *,
    steps: int = STEPS,
    chunks: Sequence[int] | None = None,
    after_forward: Callable[[list[Any]], None] | None = None,
) -> Run:
    """Prefill ``prompt`` ([rows, length], in ``chunks`` if given) then ``steps`` greedy steps.

    ``after_forward(cache)`` runs after every forward (mlx-lm's generate
    quantizes its KV cache there).
    """
    bounds = [0]
    for size in chunks or (prompt.shape[1],):
        bounds.append(bounds[-1] + size)
    if bounds[-1] != prompt.shape[1]:
        raise ValueError(f"chunks {list(chunks or ())} do not sum to the prompt's length")
    logits: list[mx.array] = []
    picks: list[mx.array] = []
    y = prompt
    for step in range(len(bounds) - 1 + steps):
        x = prompt[:, bounds[step] : bounds[step + 1]] if step < len(bounds) - 1 else y
        out = model(x, cache=cache)[:, -1, :]
        if after_forward is not None:
            after_forward(cache)
        mx.eval(out)
        logits.append(out)
        if step >= len(bounds) - 2:  # the prefill's last chunk and every decode step pick
            y = mx.argmax(out, axis=-1)[:, None]
            picks.append(y)
    tokens = cast(list[list[int]], mx.concatenate(picks, axis=1).tolist())
    return Run(logits=logits, tokens=tokens)


def assert_same_run(ours: Run, oracle: Run) -> None:
    """Identical greedy tokens and bit-equal logits at every forward (dtype included)."""
    assert ours.tokens == oracle.tokens, f"greedy tokens differ:\n{ours.tokens}\n{oracle.tokens}"
    assert len(ours.logits) == len(oracle.logits)
    for step, (a, b) in enumerate(zip(ours.logits, oracle.logits, strict=True)):
        assert a.dtype == b.dtype, f"forward {step}: dtype {a.dtype} vs {b.dtype}"
        assert mx.array_equal(a, b).item(), (
            f"forward {step}: logits differ, max |diff| {mx.abs(a - b).max().item()}"
        )
    # A run that repeats one token would pass vacuously.
    assert len({t for row in ours.tokens for t in row}) > 1, "the run repeats one token"


def compare_with_mlx_lm(
    path: str | Path,
    *,
    prompt: mx.array | None = None,
    steps: int = STEPS,
    chunks: Sequence[int] | None = None,
    our_cache: Callable[[Any], list[Any]] | None = None,
    oracle_cache: Callable[[Any], list[Any]] | None = None,
    our_after: Callable[[list[Any]], None] | None = None,
    oracle_after: Callable[[list[Any]], None] | None = None,
    oracle_type: str | None = None,
    **options: Any,
) -> tuple[Run, Run]:
    """Load ``path`` in both engines, run both greedily, :func:`assert_same_run`.

    Each side decodes on its own caches: ``model.make_cache()`` and
    :func:`mlx_lm_cache` unless ``our_cache`` / ``oracle_cache`` (called with
    the model) build others
    (batch caches for a left-padded batch). ``options`` go to :func:`load_ours`;
    ``oracle_type`` reads the checkpoint as that mlx-lm model type.
    Returns both runs.
    """
    ours, oracle = load_ours(path, **options), load_oracle(path, oracle_type=oracle_type)
    x = mx.array([list(PROMPT)]) if prompt is None else prompt
    mine = greedy(
        ours,
        x,
        our_cache(ours) if our_cache else ours.make_cache(),
        steps=steps,
        chunks=chunks,
        after_forward=our_after,
    )
    ref = greedy(
        oracle,
        x,
        oracle_cache(oracle) if oracle_cache else mlx_lm_cache(oracle),
        steps=steps,
        chunks=chunks,
        after_forward=oracle_after,
    )
    assert_same_run(mine, ref)
    return mine, ref

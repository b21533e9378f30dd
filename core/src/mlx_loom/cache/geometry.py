"""Whether caches read from a file fit a model, checked before they are used.

A prompt cache saved for one model and loaded for another (or edited, or
saved by a different build of the same family) would either crash deep
inside attention with a raw MLX shape error or, worse, attend over keys of
the wrong geometry and produce garbage. So before a loaded cache is used we
compare it, layer by layer, with the caches the model itself produces.

How the expected geometry is found, without any family-specific code: the
model runs two forwards — one token and two tokens — on fresh caches from
``model.make_cache()``, and nothing is evaluated. MLX is lazy, so building
the graph fixes every cache array's shape and dtype at the cost of a few
milliseconds (measured on the five tiny families: 1-3 ms) and no tensor
data. Comparing the two probes tells which parts are geometry and which grow
with the sequence:

* an array axis that is the same after 1 and 2 tokens (batch, heads,
  head_dim, a recurrent state's dimensions, a packed quantized width) must
  match the loaded array exactly; an axis that grew is a sequence axis, and
  the loaded one may hold at most as many slots as tokens were seen;
* a ``meta_state`` entry that is the same in both probes (a window's
  ``max_size`` and ``keep``, a quantized cache's ``group_size`` and
  ``bits``) must match; entries that changed are positions (offset, write
  index);
* dtypes and the number of state arrays must match, and the cache kind must
  be the model's — or its form in a KV codec, since generating with
  ``kv_bits`` / ``kv_codec`` converts a model's caches; those are compared
  with the probes converted the same way (``convert_like``).

Every layer's ``offset`` must equal the number of tokens the file says the
cache holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlx_loom.errors import CacheError, LoomError

__all__ = ["check_caches_fit"]

_SHOW = 8  # problems listed in one error


def _probe(model: Any, n: int) -> list[Any]:
    caches = model.make_cache()
    model(mx.zeros((1, n), dtype=mx.int32), cache=caches)  # lazy: shapes only
    return caches


def _expected(short: Any, long: Any, loaded: Any) -> tuple[Any, Any] | None:
    """The probe pair to compare ``loaded`` with: the model's kind or its codec form.

    A cache in a KV codec (affine, TurboQuant, a plugin's) converts a plain
    probe the way it was converted itself (``convert_like``); the converted
    probes must then be of the loaded kind.
    """
    form = _form(loaded)
    if _form(short) == form:
        return short, long
    convert_like = getattr(loaded, "convert_like", None)
    if not callable(convert_like) or not hasattr(short, "to_quantized"):
        return None
    try:
        pair = (convert_like(short), convert_like(long))
    except LoomError:
        return None
    if any(_form(p) != form for p in pair):
        return None
    return pair


def _form(cache: Any) -> tuple[Any, Any]:
    """A cache's kind and the codec it stores in (a layout's kind is the same in every codec)."""
    return getattr(type(cache), "kind", None), getattr(cache, "codec", None)


def _layer_problems(i: int, loaded: Any, short: Any, long: Any, tokens: int) -> list[str]:
    kind = type(loaded).__name__
    expected = _expected(short, long, loaded)
    if expected is None:
        return [f"layer {i}: the file holds a {kind}; this model uses a {type(short).__name__}"]
    short, long = expected
    problems = []
    offset = getattr(loaded, "offset", None)
    if isinstance(offset, bool) or not isinstance(offset, int):
        problems.append(
            f"layer {i} ({kind}): its offset is {type(offset).__name__}, not the int count of "
            "tokens it holds (a batch cache, or a kind without Cache.offset)"
        )
    elif offset != tokens:
        problems.append(f"layer {i} ({kind}): holds {offset} tokens; the file lists {tokens}")

    meta, m1, m2 = tuple(loaded.meta_state), tuple(short.meta_state), tuple(long.meta_state)
    if len(meta) != len(m1):
        problems.append(f"layer {i} ({kind}): meta_state {meta!r} has the wrong number of fields")
    else:
        for j, (have, a, b) in enumerate(zip(meta, m1, m2, strict=True)):
            if a == b and have != a:
                problems.append(
                    f"layer {i} ({kind}): meta_state[{j}] is {have!r}; this model's is {a!r}"
                )

    state, s1, s2 = tuple(loaded.state), tuple(short.state), tuple(long.state)
    if not state:
        return problems  # an empty cache: the offset check above is all there is
    if len(state) != len(s1):
        problems.append(
            f"layer {i} ({kind}): holds {len(state)} state arrays; this model's holds {len(s1)}"
        )
        return problems
    for j, (have, a, b) in enumerate(zip(state, s1, s2, strict=True)):
        if have.dtype != a.dtype:
            problems.append(
                f"layer {i} ({kind}): state[{j}] is {_dtype(have)}; this model's is {_dtype(a)}"
            )
        if have.ndim != a.ndim or not _fits(have.shape, a.shape, b.shape, tokens):
            problems.append(
                f"layer {i} ({kind}): state[{j}] has shape {tuple(have.shape)}; this model's "
                f"is {_pattern(a.shape, b.shape)}"
            )
    return problems


def _fits(have: Sequence[int], a: Sequence[int], b: Sequence[int], tokens: int) -> bool:
    for h, x, y in zip(have, a, b, strict=True):
        if x == y:
            if h != x:
                return False
        elif not 0 <= h <= tokens:
            return False
    return True


def _pattern(a: Sequence[int], b: Sequence[int]) -> str:
    return (
        "(" + ", ".join(str(x) if x == y else "<tokens>" for x, y in zip(a, b, strict=True)) + ")"
    )


def _dtype(a: mx.array) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


def check_caches_fit(caches: Sequence[Any], model: Any, *, tokens: int, source: str) -> None:
    """Raise :class:`CacheError` unless ``caches`` are what ``model`` would hold after ``tokens``.

    ``model`` is anything with ``make_cache()`` and ``__call__(inputs, cache=...)``
    (a :class:`~mlx_loom.model.Model`). ``source`` names the file in the message.
    """
    short, long = _probe(model, 1), _probe(model, 2)
    if len(caches) != len(short):
        raise CacheError(
            f"{source} holds caches for {len(caches)} layers; this model uses {len(short)}",
            fix="load the prompt cache with the model it was saved for, or rebuild it",
        )
    problems: list[str] = []
    for i, (loaded, a, b) in enumerate(zip(caches, short, long, strict=True)):
        problems += _layer_problems(i, loaded, a, b, tokens)
    if problems:
        more = f"\n  ... and {len(problems) - _SHOW} more" if len(problems) > _SHOW else ""
        raise CacheError(
            f"{source} does not fit this model ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems[:_SHOW])
            + more,
            fix="load the prompt cache with the model it was saved for, or rebuild it",
        )

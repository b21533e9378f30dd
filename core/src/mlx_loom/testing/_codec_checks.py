"""The conformance check for KV codecs a plugin registers.

A codec is a set of cache kinds declaring ``codec`` (see
:mod:`mlx_loom.cache.codecs`). Every family's graph will attend through
whatever view such a kind's ``append`` returns, so the kit holds each kind to
what graphs and the engine rely on, on small synthetic keys/values:

* ``codec_bits`` / ``codec_default_bits`` are declared and consistent;
* ``from_plain`` converts a plain full or window cache (and returns ``None``
  for kinds it does not take), keeping the token count;
* the view attends with the right shape, finite values, and close to the
  plain cache's attention (a relative error below 0.5 — a codec that
  scrambles keys or values fails);
* ``state`` / ``meta_state`` / ``from_state`` recreate a cache that attends
  bit for bit as the original (prompt-cache files depend on it);
* if the kind can ``stack``, every stacked row attends bit for bit as alone
  (the engine's batching depends on it).
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx

from mlx_loom.cache import CACHE_KINDS, KVCache, RotatingKVCache, append_kv

from .conformance import CheckResult, failed, passed, skipped

NAME = "kv-codec-kinds"
_H, _D, _SCALE = 2, 64, 0.125


def _kv(seed: int, L: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, _H, L, _D), key=mx.random.key(seed))
    v = mx.random.normal((1, _H, L, _D), key=mx.random.key(seed + 1))
    return k, v


def _plain_probes() -> list[Any]:
    full, window = KVCache(), RotatingKVCache(8)
    for seed, L in enumerate([5, 1, 1]):
        full.update_and_fetch(*_kv(10 + 2 * seed, L))
        window.update_and_fetch(*_kv(10 + 2 * seed, L))
    return [full, window]


def _attend(cache: Any, seed: int) -> mx.array:
    q = mx.random.normal((1, 2 * _H, 1, _D), key=mx.random.key(seed + 7))
    mask = cache.make_mask(1)
    return append_kv(cache, *_kv(seed, 1)).attend(q, scale=_SCALE, mask=mask)


def _kind_problems(cls: Any) -> list[str]:  # a plugin's class: duck-typed
    name = cls.__name__
    bits = getattr(cls, "codec_bits", None)
    default = getattr(cls, "codec_default_bits", None)
    if not (isinstance(bits, tuple) and bits and all(isinstance(b, int) for b in bits)):
        return [f"{name}: codec_bits must be a non-empty tuple of ints; found {bits!r}"]
    if default not in bits:
        return [f"{name}: codec_default_bits={default!r} is not one of codec_bits {bits}"]
    problems: list[str] = []
    converted = []
    for probe in _plain_probes():
        out = cls.from_plain(probe, bits=default, group_size=64)
        if out is None:
            continue
        if type(out) is not cls:
            problems.append(f"{name}.from_plain returned a {type(out).__name__}")
            continue
        if out.offset != probe.offset:
            problems.append(f"{name}.from_plain holds {out.offset} tokens of {probe.offset}")
        converted.append((probe, out))
    if not converted:
        return [*problems, f"{name}.from_plain converts neither a KVCache nor a RotatingKVCache"]
    for probe, cache in converted:
        kind = type(probe).__name__
        ref = _attend(probe, 40)
        got = _attend(cache, 40)
        if got.shape != ref.shape:
            problems.append(
                f"{name} (from a {kind}): attention has shape {got.shape}, not {ref.shape}"
            )
            continue
        if not mx.isfinite(got).all().item():
            problems.append(f"{name} (from a {kind}): attention is not finite")
            continue
        err = cast(float, (mx.linalg.norm(got - ref) / mx.linalg.norm(ref)).item())
        if not err < 0.5:
            problems.append(f"{name} (from a {kind}): attention is {err:.2f} (relative) off plain")
        try:
            again = cls.from_state([a[...] for a in cache.state], list(cache.meta_state))
        except Exception as e:  # a plugin may raise anything
            problems.append(f"{name}.from_state failed on its own state: {e}")
            continue
        if not mx.array_equal(_attend(again, 42), _attend(cache, 42)).item():
            problems.append(f"{name}: a cache recreated from its state attends differently")
        if callable(getattr(cls, "stack", None)):
            problems += _stack_problems(cls, probe, name)
    return problems


def _stack_problems(cls: Any, probe: Any, name: str) -> list[str]:
    rows = []
    for extra in (0, 2):
        plain = type(probe)() if isinstance(probe, KVCache) else RotatingKVCache(probe.max_size)
        for seed, L in enumerate([4 + extra, 1]):
            plain.update_and_fetch(*_kv(60 + 2 * seed + extra, L))
        rows.append(cls.from_plain(plain, bits=cls.codec_default_bits, group_size=64))
    try:
        batch = cls.stack([*rows])
    except Exception as e:  # a plugin may raise anything
        return [f"{name}.stack failed: {e}"]
    k = mx.random.normal((2, _H, 1, _D), key=mx.random.key(90))
    v = mx.random.normal((2, _H, 1, _D), key=mx.random.key(91))
    q = mx.random.normal((2, 2 * _H, 1, _D), key=mx.random.key(92))
    mask = batch.make_mask(1)
    out = append_kv(batch, k, v).attend(q, scale=_SCALE, mask=mask)
    for i, row in enumerate(rows):
        m = row.make_mask(1)
        alone = append_kv(row, k[i : i + 1], v[i : i + 1]).attend(
            q[i : i + 1], scale=_SCALE, mask=m
        )
        if not mx.array_equal(out[i : i + 1], alone).item():
            return [f"{name}.stack: row {i} of a batch attends differently from the row alone"]
    return []


def check_kv_codecs(own_cache_kinds: dict[str, type]) -> CheckResult:
    """Hold every codec kind the plugin registers to the view and engine contracts."""
    kinds: list[Any] = [
        cls
        for kind, cls in own_cache_kinds.items()
        if kind not in CACHE_KINDS
        and isinstance(getattr(cls, "codec", None), str)
        and callable(getattr(cls, "from_plain", None))
    ]
    if not kinds:
        return skipped(NAME, "registers no KV codec")
    problems = [p for cls in kinds for p in _kind_problems(cls)]
    if problems:
        return failed(NAME, "; ".join(problems))
    codecs = sorted({cls.codec for cls in kinds})
    return passed(
        NAME,
        f"codec(s) {', '.join(codecs)}: {', '.join(c.__name__ for c in kinds)} convert, attend, "
        "round-trip their state and batch",
    )

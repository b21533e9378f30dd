"""Behaviour checks on one built model: forward, caches, loops, weights, kernels.

Each check drives the model only through the public protocols — ``model(ids,
cache)``, ``make_cache()``, the cache protocol and the core's loops — exactly
as the engine will, and compares against a reference computed the plain way
(a fresh full forward, or the same prompt alone).

Tolerances. A cached decode, a batch row and a trimmed or rolled-back cache
compute the same function as the reference with a different op order
(longer key axes under a mask, chunked versus stepwise recurrences), so
logits are compared within ``1e-4`` relative to the logits' scale in float32
and ``3e-2`` in half precision (one bf16 ulp at 1.0 is ~8e-3, and a few
roundings accumulate through a tiny model). Greedy tokens, and everything
that is the *same* computation repeated, must match exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten

from ..cache import (
    CACHE_KINDS,
    Cache,
    SpeculativeRounds,
    codec_table,
)
from ..cache.mixed import stack_rows
from ..cpu.compiled_step import CompiledStep
from ..errors import (
    CacheError,
    CacheNotTrimmable,
    CapabilityRefused,
    KernelUnavailable,
    LoomError,
    ParallelRefused,
    RequestError,
    WeightsError,
)
from ..generation import (
    PromptCache,
    batch_generate_tokens,
    generate,
    generate_tokens,
    stream_generate,
)
from ..host import (
    BACKENDS,
    BATCH,
    COMPILED_STEP,
    KV_QUANTIZATION,
    PROMPT_CACHE,
    SPECULATIVE,
    Registry,
    active_backend,
    runnable_backends,
)
from ..loader import _build_split, build_model
from ..model import Model
from ..parallel.build import RankView
from .checkpoints import write_checkpoint
from .conformance import (
    CheckResult,
    Target,
    _describe_error,
    _guard,
    failed,
    passed,
    resolve_for,
    skipped,
)

CHECK_NAMES: tuple[str, ...] = (
    "forward",
    "incremental-decode",
    "greedy-determinism",
    "weight-coverage",
    "kernel-refusal",
    "cache-trim",
    "prompt-cache-reuse",
    "state-round-trip",
    "batch-rows",
    "batch-equals-single",
    "speculative-rounds",
    "kv-quantization",
    "kv-codecs",
    "compiled-step",
    "parallel-plan",
)

NEW_TOKENS = 6


def run_all(subject: Any, target: Target) -> list[CheckResult]:
    checks: dict[str, Callable[[], CheckResult]] = {
        "forward": lambda: check_forward(target),
        "incremental-decode": lambda: check_incremental_decode(target),
        "greedy-determinism": lambda: check_greedy_determinism(target),
        "weight-coverage": lambda: check_weight_coverage(subject, target),
        "kernel-refusal": lambda: check_kernel_refusal(subject, target),
        "cache-trim": lambda: check_cache_trim(target),
        "prompt-cache-reuse": lambda: check_prompt_cache_reuse(target),
        "state-round-trip": lambda: check_state_round_trip(target),
        "batch-rows": lambda: check_batch_rows(target),
        "batch-equals-single": lambda: check_batch_equals_single(target),
        "speculative-rounds": lambda: check_speculative_rounds(target),
        "kv-quantization": lambda: check_kv_quantization(target),
        "kv-codecs": lambda: check_kv_codecs_on_model(target),
        "compiled-step": lambda: check_compiled_step(target),
        "parallel-plan": lambda: check_parallel_plan(target),
    }
    out: list[CheckResult] = []
    for name in CHECK_NAMES:
        label = f"{name}[{target.label}]"
        for result in _guard(label, checks[name]):
            out.append(result if result.name == label else _relabel(result, label))
    return out


def _relabel(result: CheckResult, label: str) -> CheckResult:
    return CheckResult(label, result.status, result.detail)


# --- helpers -------------------------------------------------------------------


def _vocab(target: Target) -> int:
    vocab = target.model.vocab_size
    if vocab is None:
        raise LoomError(
            f"config of {target.checkpoint} has no vocab_size", fix="add vocab_size to tiny_config"
        )
    return vocab


def _ids(target: Target, n: int, seed: int) -> list[int]:
    """``n`` deterministic token ids the tokenizer can produce (so decoding them is valid)."""
    limit = min(_vocab(target), target.tokenizer.vocab_size)
    rng = random.Random(seed)
    return [rng.randrange(3, limit) for _ in range(n)]  # 0..2 are the special tokens


def _forward(model: Model, ids: Sequence[int] | Sequence[Sequence[int]], cache: Any) -> mx.array:
    if ids and isinstance(ids[0], int):
        rows = [list(cast(Sequence[int], ids))]
    else:
        rows = [list(r) for r in cast(Sequence[Sequence[int]], ids)]
    logits = model(mx.array(rows, dtype=mx.int32), cache)
    mx.eval(logits)
    return logits


def _tolerance(dtype: mx.Dtype) -> float:
    return 1e-4 if dtype == mx.float32 else 3e-2


def _close(actual: mx.array, expected: mx.array) -> tuple[bool, float]:
    a, b = actual.astype(mx.float32), expected.astype(mx.float32)
    if a.shape != b.shape:
        return False, float("inf")
    diff = _real(mx.abs(a - b).max())
    scale = max(1.0, _real(mx.abs(b).max()))
    return diff <= _tolerance(expected.dtype) * scale, diff


def _real(scalar: mx.array) -> float:
    """A real scalar's value (``mx.array.item`` is typed to allow complex results)."""
    return cast(float, scalar.item())


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _decode(model: Model, prompt: Sequence[int], n: int = NEW_TOKENS) -> list[tuple[int, mx.array]]:
    out = list(generate_tokens(model, prompt, model.make_cache(), sampler=_greedy, max_tokens=n))
    mx.eval([lp for _, lp in out])
    return out


def _offsets(cache: Sequence[Any]) -> list[int]:
    out = []
    for c in cache:
        off = c.offset
        out.append(int(off) if isinstance(off, int) else int(_real(mx.array(off).max())))
    return out


def _kinds(cache: Sequence[Any]) -> str:
    counts: dict[str, int] = {}
    for c in cache:
        counts[type(c).__name__] = counts.get(type(c).__name__, 0) + 1
    return ", ".join(f"{k}×{v}" for k, v in counts.items()) or "no caches"


def _requires(target: Target, capability: str, name: str) -> CheckResult | None:
    if capability not in target.capabilities:
        return skipped(name)
    return None


# --- always-on checks ------------------------------------------------------------


def check_forward(target: Target) -> CheckResult:
    name = "forward"
    model, V = target.model, _vocab(target)
    ids = _ids(target, 7, seed=1)
    cache = model.make_cache()
    if not isinstance(cache, list):
        return failed(name, f"make_cache() returned a {type(cache).__name__}, not a list")
    bad = [type(c).__name__ for c in cache if not isinstance(c, Cache)]
    if bad:
        return failed(name, f"make_cache() returned objects that are not caches: {bad}")
    if any(not c.empty() for c in cache):
        return failed(name, "a fresh cache from make_cache() is not empty()")
    logits = _forward(model, ids, cache)
    if logits.shape != (1, 7, V):
        return failed(
            name, f"logits of a [1, 7] input have shape {list(logits.shape)}, expected [1, 7, {V}]"
        )
    if not mx.issubdtype(logits.dtype, mx.floating):
        return failed(name, f"logits dtype is {logits.dtype}, not floating point")
    if not mx.all(mx.isfinite(logits)).item():
        return failed(name, "logits hold inf or nan")
    offsets = _offsets(cache)
    if any(o != 7 for o in offsets):
        return failed(name, f"cache offsets after a 7-token forward are {offsets}, expected 7")
    batch = _forward(model, [ids[:5], ids[2:]], None)
    if batch.shape != (2, 5, V):
        return failed(
            name,
            f"logits of a [2, 5] input without caches have shape "
            f"{list(batch.shape)}, expected [2, 5, {V}]",
        )
    ok, diff = _close(batch[0], logits[0, :5])
    if not ok:
        return failed(
            name, f"a cache-less forward of a prefix differs from the cached one by {diff:.3g}"
        )
    dtype = str(logits.dtype).removeprefix("mlx.core.")
    return passed(
        name, f"logits [1, 7, {V}] {dtype}, [2, 5, {V}] without caches; caches: {_kinds(cache)}"
    )


def check_incremental_decode(target: Target) -> CheckResult:
    name = "incremental-decode"
    model = target.model
    ids = _ids(target, 9, seed=2)
    full = _forward(model, ids, model.make_cache())
    cache = model.make_cache()
    steps = [_forward(model, ids[:5], cache)[:, -1]]
    for t in ids[5:]:
        steps.append(_forward(model, [t], cache)[:, -1])
    worst = 0.0
    for i, logits in enumerate(steps):
        ok, diff = _close(logits, full[:, 4 + i])
        worst = max(worst, diff)
        if not ok:
            return failed(
                name,
                f"decode step {i} differs from the full forward by {diff:.3g} "
                f"(tolerance {_tolerance(full.dtype):g} × scale)",
            )
    return passed(name, f"prefill 5 + 4 decode steps match the full forward (max |Δ| {worst:.2g})")


def check_greedy_determinism(target: Target) -> CheckResult:
    name = "greedy-determinism"
    model, tok = target.model, target.tokenizer
    ids = _ids(target, 6, seed=3)
    first, second = _decode(model, ids), _decode(model, ids)
    if [t for t, _ in first] != [t for t, _ in second]:
        return failed(
            name, f"two greedy runs gave {[t for t, _ in first]} and {[t for t, _ in second]}"
        )
    for (_, a), (_, b) in zip(first, second, strict=True):
        if not mx.array_equal(a, b).item():
            return failed(name, "two greedy runs gave the same tokens but different logprobs")
    text = [
        generate(model, tok, "hello world", max_tokens=NEW_TOKENS, temperature=0.0)
        for _ in range(2)
    ]
    if text[0] != text[1]:
        return failed(name, f"text generation differs between runs: {text[0]!r} vs {text[1]!r}")
    chat = tok.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    chat_text = generate(model, tok, chat, max_tokens=2, temperature=0.0)
    return passed(
        name,
        f"tokens {[t for t, _ in first]} and logprobs repeat bit for bit; text "
        f"{text[0]!r} repeats; chat prompt generates {chat_text!r}",
    )


def check_weight_coverage(subject: Any, target: Target) -> CheckResult:
    """Every checkpoint tensor is used, every parameter comes from the checkpoint, and the
    loader refuses a checkpoint with a tensor missing or an unexpected one."""
    name = "weight-coverage"
    mt = target.model_type
    config = dict(mt.tiny_config or {})
    tensors = dict(mt.checkpoint_tensors(config))  # type: ignore[misc]
    root = target.workdir / mt.name

    def build(directory, seed: int | None) -> Model:
        if seed is not None:
            write_checkpoint(directory, config, tensors, seed=seed, tokenizer=False)
        resolved = resolve_for(
            directory, target.implementation, host=subject.host, registry=subject.registry
        )
        mx.random.seed(1234)  # a parameter the loader never sets keeps the same init
        return build_model(resolved)

    def build_with(directory, spec) -> Model:
        write_checkpoint(directory, config, spec, seed=0, tokenizer=False)
        return build(directory, None)

    params = [
        dict(tree_flatten(build(d, s).module.parameters()))
        for d, s in ((target.checkpoint, None), (root / "seed1", 1))
    ]
    untouched = sorted(
        k for k, v in params[0].items() if k in params[1] and mx.array_equal(v, params[1][k]).item()
    )
    if untouched:
        return failed(
            name,
            f"parameters not loaded from the checkpoint (identical for two "
            f"different checkpoints): {_capped(untouched)}",
        )
    quantized = target.resolved.config.quantization is not None
    held = sum(_numel(shape) for shape, _ in tensors.values())
    used = sum(v.size for v in params[0].values())
    if not quantized and held != used:
        what = "unused" if held > used else "not backed by any tensor"
        return failed(
            name,
            f"the checkpoint holds {held} values but the model's parameters "
            f"hold {used}: {abs(held - used)} values {what}",
        )
    names = sorted(tensors)
    victim = names[len(names) // 2]
    missing = {k: v for k, v in tensors.items() if k != victim}
    refusal = _expect_weights_error(
        lambda: build_with(root / "missing", missing), victim, "missing"
    )
    if refusal:
        return failed(name, refusal)
    extra_name = "conformance.unexpected.weight"
    extra = {**tensors, extra_name: ((2, 2), "float32")}
    refusal = _expect_weights_error(lambda: build_with(root / "extra", extra), extra_name, "extra")
    if refusal:
        return failed(name, refusal)
    return passed(
        name,
        f"all {len(tensors)} tensors ({held} values) load into the parameters, "
        f"none left at init; missing {victim!r} and extra {extra_name!r} are "
        "refused with WeightsError",
    )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _capped(items: Sequence[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f" ... ({len(items) - n} more)" if len(items) > n else "")


def _expect_weights_error(load: Callable[[], Any], tensor: str, how: str) -> str | None:
    try:
        load()
    except WeightsError as err:
        # A loader may name the tensor by its own (mapped) path; the layer-local
        # tail of the name must still appear so a person can find it.
        tail = ".".join(tensor.split(".")[-4:])
        if tensor not in err.message and tail not in err.message:
            return (
                f"the {how} tensor {tensor!r} was refused, but the WeightsError does not name "
                f"it: {err.message}"
            )
        return None
    except Exception as err:  # noqa: BLE001
        return (
            f"a checkpoint with {how} tensor {tensor!r} raised {_describe_error(err)}, "
            "not WeightsError"
        )
    return (
        f"a checkpoint with {how} tensor {tensor!r} loaded without a WeightsError "
        "(loading is not strict)"
    )


def check_kernel_refusal(subject: Any, target: Target) -> CheckResult:
    name = "kernel-refusal"
    impl = target.implementation
    if not impl.kernels:
        return skipped(name, "no kernels declared")
    reg: Registry = subject.registry
    notes = []
    absent = [b for b in BACKENDS if b not in runnable_backends()]
    if absent:
        backend = absent[0]
        outcome = _expect_kernel_refusal(
            lambda: resolve_for(
                target.checkpoint,
                impl,
                host=subject.host,
                registry=reg.with_(kernel_backend=backend),
            )
        )
        if outcome:
            return failed(name, f"pinned to backend {backend!r}, which cannot run here: {outcome}")
        notes.append(f"pinning {backend!r} (absent here) is refused")
    here = reg.kernel_backend or active_backend()
    kernel = impl.kernels[0]
    stripped = Registry(
        model_types=reg.model_types.values(),
        implementations=reg.implementations.values(),
        profiles=reg.profiles,
        kernels=[k for k in reg.kernels if not (k.name == kernel and k.backend == here)],
        cache_kinds=[c for k, c in reg.cache_kinds.items() if k not in CACHE_KINDS],
    )
    outcome = _expect_kernel_refusal(
        lambda: resolve_for(target.checkpoint, impl, host=subject.host, registry=stripped),
        mention=kernel,
    )
    if outcome:
        return failed(name, f"without the {here!r} registration of kernel {kernel!r}: {outcome}")
    notes.append(f"without kernel {kernel!r}[{here}] the model is refused, not substituted")
    return passed(name, "; ".join(notes))


def _expect_kernel_refusal(resolve_it: Callable[[], Any], mention: str | None = None) -> str | None:
    try:
        resolve_it()
    except KernelUnavailable as err:
        if mention and mention not in err.message:
            return f"KernelUnavailable does not name the kernel: {err.message}"
        return None
    except Exception as err:  # noqa: BLE001
        return f"raised {_describe_error(err)}, not KernelUnavailable"
    return "resolution succeeded (a silent substitute)"


# --- capability checks ---------------------------------------------------------


def check_cache_trim(target: Target) -> CheckResult:
    """Trim drops exactly the last tokens, or refuses with CacheNotTrimmable and changes nothing."""
    name = "cache-trim"
    if PROMPT_CACHE not in target.capabilities and SPECULATIVE not in target.capabilities:
        return skipped(name)
    model = target.model
    ids = _ids(target, 8, seed=4)
    nxt = _ids(target, 1, seed=5)[0]
    cache = model.make_cache()
    _forward(model, ids, cache)
    refused, trimmed = [], []
    for i, c in enumerate(cache):
        if c.is_trimmable():
            continue
        before = _offsets([c])[0]
        try:
            c.trim(3)
        except CacheNotTrimmable:
            refused.append(type(c).__name__)
        else:
            return failed(
                name,
                f"cache {i} ({type(c).__name__}) says it is not trimmable but "
                "trim(3) did not raise CacheNotTrimmable",
            )
        if _offsets([c])[0] != before:
            return failed(name, f"cache {i} ({type(c).__name__}) refused trim but its offset moved")
    if refused:
        # A refusing cache must be left intact: the next token continues the full prompt.
        logits = _forward(model, [nxt], cache)[:, -1]
        reference = _forward(model, [*ids, nxt], model.make_cache())[:, -1]
        ok, diff = _close(logits, reference)
        if not ok:
            return failed(
                name,
                f"after a refused trim the cache no longer continues the prompt (|Δ| {diff:.3g})",
            )
        return passed(
            name,
            f"{_capped(sorted(set(refused)))} refuse trim with CacheNotTrimmable and stay intact",
        )
    for i, c in enumerate(cache):
        got = c.trim(3)
        if got != 3:
            return failed(name, f"cache {i} ({type(c).__name__}).trim(3) returned {got}")
        trimmed.append(type(c).__name__)
    offsets = _offsets(cache)
    if any(o != 5 for o in offsets):
        return failed(name, f"offsets after trimming 3 of 8 tokens are {offsets}, expected 5")
    logits = _forward(model, [nxt], cache)[:, -1]
    reference = _forward(model, [*ids[:5], nxt], model.make_cache())[:, -1]
    ok, diff = _close(logits, reference)
    if not ok:
        return failed(
            name, f"decoding after trim differs from a fresh run over the kept tokens by {diff:.3g}"
        )
    return passed(
        name, f"trim(3) of 8 tokens is exact on every cache ({_kinds(cache)}; max |Δ| {diff:.2g})"
    )


def check_prompt_cache_reuse(target: Target) -> CheckResult:
    name = "prompt-cache-reuse"
    if (s := _requires(target, PROMPT_CACHE, name)) is not None:
        return s
    model, tok = target.model, target.tokenizer

    def run(prompt, cache=None):
        out = list(
            stream_generate(model, tok, prompt, max_tokens=4, temperature=0.0, prompt_cache=cache)
        )
        return [r.token for r in out], (out[0].cached_tokens if out else 0)

    pc = PromptCache(model)
    first = _ids(target, 6, seed=6)
    out1, _ = run(first, pc)
    extended = first + out1 + _ids(target, 3, seed=7)
    out2, reused = run(extended, pc)
    fresh2, _ = run(extended)
    if out2 != fresh2:
        return failed(
            name,
            f"continuing a conversation from the prompt cache gave {out2}, a "
            f"fresh run gave {fresh2}",
        )
    if reused <= 0:
        return failed(name, "the second turn reused no cached tokens")
    diverged = first[:4] + _ids(target, 3, seed=8)
    out3, _ = run(diverged, pc)
    fresh3, _ = run(diverged)
    if out3 != fresh3:
        return failed(
            name, f"a prompt diverging from the cached one gave {out3}, a fresh run gave {fresh3}"
        )
    return passed(
        name,
        f"turn 2 reused {reused} cached tokens and matches a fresh run; a "
        "diverging prompt matches a fresh run",
    )


def check_state_round_trip(target: Target) -> CheckResult:
    name = "state-round-trip"
    if (s := _requires(target, PROMPT_CACHE, name)) is not None:
        return s
    model = target.model
    ids = _ids(target, 6, seed=9)
    nxt = _ids(target, 1, seed=10)[0]
    # The production path: PromptCache.save/load with the cache kinds the
    # registry knows (the core's and those plugins registered), nothing more.
    saved = PromptCache(model)
    cache = saved.cache
    _forward(model, ids, cache)
    saved.record(ids)
    path = target.workdir / f"{target.label}-prompt-cache.safetensors"
    saved.save(path)
    restored = PromptCache.load(path, model)
    loaded = restored.cache
    if restored.tokens != list(ids):
        return failed(name, f"tokens did not survive the round trip: {restored.tokens}")
    if [type(c) for c in loaded] != [type(c) for c in cache]:
        return failed(name, f"reloaded cache kinds {[type(c).__name__ for c in loaded]} differ")
    if _offsets(loaded) != _offsets(cache):
        return failed(name, f"reloaded offsets {_offsets(loaded)} != {_offsets(cache)}")
    a = _forward(model, [nxt], cache)[:, -1]
    b = _forward(model, [nxt], loaded)[:, -1]
    ok, diff = _close(b, a)
    if not ok:
        return failed(name, f"a reloaded cache continues differently (|Δ| {diff:.3g})")
    return passed(
        name,
        f"saved and reloaded {_kinds(cache)}; decoding continues identically (max |Δ| {diff:.2g})",
    )


def check_batch_rows(target: Target) -> CheckResult:
    """merge / extend / filter / extract on the batch counterparts of the model's caches."""
    name = "batch-rows"
    if (s := _requires(target, BATCH, name)) is not None:
        return s
    model = target.model
    prompts = [_ids(target, 5, seed=11), _ids(target, 3, seed=12)]
    steps = [_ids(target, 2, seed=13), _ids(target, 2, seed=14)]
    reference = []  # per row: logits of the two decode steps, the row alone
    for p, (t, u) in zip(prompts, steps, strict=True):
        cache = model.make_cache()
        _forward(model, p, cache)
        reference.append((_forward(model, [t], cache)[0, -1], _forward(model, [u], cache)[0, -1]))

    def prefilled() -> list[list[Any]]:
        rows = []
        for p in prompts:
            cache = model.make_cache()
            _forward(model, p, cache)
            rows.append(cache)
        return rows

    def merged() -> list[Any]:
        rows = prefilled()
        out = []
        for layer in zip(*rows, strict=True):
            merge = getattr(type(layer[0]), "merge", None)
            if merge is None:
                raise LoomError(
                    f"{type(layer[0]).__name__} has no merge()",
                    fix="give the cache kind a merge(caches) classmethod",
                )
            out.append(merge(list(layer)))
        return out

    def compare(logits: mx.array, rows: Sequence[int], step: int, what: str) -> str | None:
        for i, row in enumerate(rows):
            ok, diff = _close(logits[i, -1], reference[row][step])
            if not ok:
                return f"{what}: row {row} differs from the row alone by {diff:.3g}"
        return None

    first = [[steps[0][0]], [steps[1][0]]]
    second = [[steps[0][1]], [steps[1][1]]]
    # merge, then decode both rows, then filter to row 1 and decode once more
    batch = merged()
    problem = compare(_forward(model, first, batch), [0, 1], 0, "merge")
    if problem:
        return failed(name, problem)
    for c in batch:
        c.filter([1])
    problem = compare(_forward(model, [second[1]], batch), [1], 1, "filter([1])")
    if problem:
        return failed(name, problem)
    # extract row 0 of a merged batch as an independent single-row cache
    single = [c.extract(0) for c in merged()]
    problem = compare(_forward(model, [first[0]], single), [0], 0, "extract(0)")
    if problem:
        return failed(name, problem)
    # extend a one-row batch with another
    rows = prefilled()
    left = [type(c).merge([c]) for c in rows[0]]
    right = [type(c).merge([c]) for c in rows[1]]
    for a, b in zip(left, right, strict=True):
        a.extend(b)
    problem = compare(_forward(model, first, left), [0, 1], 0, "extend")
    if problem:
        return failed(name, problem)
    kinds = _kinds(batch)
    return passed(name, f"merge, filter, extract and extend on {kinds} match each row alone")


def check_batch_equals_single(target: Target) -> CheckResult:
    name = "batch-equals-single"
    if (s := _requires(target, BATCH, name)) is not None:
        return s
    model = target.model
    prompts = [_ids(target, 4, seed=15), _ids(target, 7, seed=16), _ids(target, 2, seed=17)]
    batched = [t for t, _ in batch_generate_tokens(model, prompts, max_tokens=NEW_TOKENS)]
    singles = [[t for t, _ in _decode(model, p)] for p in prompts]
    for i, (b, alone) in enumerate(zip(batched, singles, strict=True)):
        if b != alone:
            return failed(
                name, f"prompt {i} (length {len(prompts[i])}): batched {b}, alone {alone}"
            )
    return passed(
        name,
        f"{len(prompts)} prompts of lengths {[len(p) for p in prompts]}: "
        f"batched greedy tokens equal each run alone",
    )


def check_speculative_rounds(target: Target) -> CheckResult:
    """Verify a 3-token draft window and keep 1: the caches must equal a run over the kept
    tokens."""
    name = "speculative-rounds"
    if (s := _requires(target, SPECULATIVE, name)) is not None:
        return s
    model = target.model
    ids = _ids(target, 4, seed=18)
    draft = _ids(target, 3, seed=19)
    nxt = _ids(target, 1, seed=20)[0]
    cache = model.make_cache()
    _forward(model, ids, cache)
    rounds, trims = [], []
    for i, c in enumerate(cache):
        if isinstance(c, SpeculativeRounds):
            c.begin_round()
            rounds.append(c)
        elif c.is_trimmable():
            trims.append(c)
        else:
            return failed(
                name,
                f"cache {i} ({type(c).__name__}) is neither trimmable nor "
                "supports begin_round()/commit(keep)",
            )
    _forward(model, draft, cache)
    for c in rounds:
        c.commit(1)
    for c in trims:
        got = c.trim(2)
        if got != 2:
            return failed(name, f"{type(c).__name__}.trim(2) returned {got}")
    offsets = _offsets(cache)
    if any(o != len(ids) + 1 for o in offsets):
        return failed(
            name,
            f"offsets after keeping 1 of 3 draft tokens are {offsets}, expected {len(ids) + 1}",
        )
    logits = _forward(model, [nxt], cache)[:, -1]
    reference = _forward(model, [*ids, draft[0], nxt], model.make_cache())[:, -1]
    ok, diff = _close(logits, reference)
    if not ok:
        return failed(
            name,
            f"after keeping 1 of 3 draft tokens, decoding differs from a fresh run by {diff:.3g}",
        )
    how = []
    if rounds:
        how.append(f"rounds on {_kinds(rounds)}")
    if trims:
        how.append(f"trim on {_kinds(trims)}")
    return passed(
        name, f"keep 1 of 3 draft tokens via {' and '.join(how)}: exact (max |Δ| {diff:.2g})"
    )


def check_kv_quantization(target: Target) -> CheckResult:
    name = "kv-quantization"
    if (s := _requires(target, KV_QUANTIZATION, name)) is not None:
        return s
    model, tok = target.model, target.tokenizer
    # The engine picks the group size that divides the heads (64, else 32).
    pc = PromptCache(model)
    try:
        out = list(
            stream_generate(
                model,
                tok,
                _ids(target, 6, seed=21),
                max_tokens=4,
                temperature=0.0,
                kv_bits=8,
                quantized_kv_start=0,
                prompt_cache=pc,
            )
        )
    except (CacheError, RequestError) as err:
        return failed(
            name,
            f"kv_bits=8: {err.message} (a tiny_config needs head dimensions that are a "
            "multiple of 32 to test KV quantization)",
        )
    quantized = [c for c in pc.cache if getattr(c, "bits", None) == 8]
    if not quantized:
        return failed(name, f"kv_bits=8 left every cache unquantized ({_kinds(pc.cache)})")
    groups = sorted({g for c in quantized if isinstance(g := getattr(c, "group_size", None), int)})
    return passed(
        name,
        f"kv_bits=8 (group {', '.join(map(str, groups))}) generated {len(out)} tokens with "
        f"{_kinds(quantized)}",
    )


def check_kv_codecs_on_model(target: Target) -> CheckResult:
    """Every non-affine KV codec the registry offers stores this model's caches.

    The graph attends through whatever view a cache's ``append`` returns, so a
    family that follows the view protocol works with every codec unchanged;
    this check generates with each one (TurboQuant, and any a plugin
    registered) and confirms the caches were converted.
    """
    name = "kv-codecs"
    if (s := _requires(target, KV_QUANTIZATION, name)) is not None:
        return s
    model, tok = target.model, target.tokenizer
    codecs = [c for n, c in codec_table(model.binding.cache_kinds).items() if n != "affine"]
    done, refused = [], []
    for codec in codecs:
        pc = PromptCache(model)
        try:
            list(
                stream_generate(
                    model,
                    tok,
                    _ids(target, 6, seed=23),
                    max_tokens=3,
                    temperature=0.0,
                    kv_codec=codec.name,
                    prompt_cache=pc,
                )
            )
        except CapabilityRefused as err:
            refused.append(f"{codec.name} ({err.message})")
            continue
        kv = [c for c in pc.cache if hasattr(c, "append")]
        stray = [type(c).__name__ for c in kv if getattr(c, "codec", None) != codec.name]
        if stray:
            return failed(name, f"kv_codec={codec.name!r} left caches {stray} unconverted")
        done.append(f"{codec.name} ({_kinds(kv)})")
    if not done:
        return skipped(name, "no codec applies: " + "; ".join(refused) if refused else "none")
    detail = "generated with " + ", ".join(done)
    return passed(name, detail + (f"; refused: {'; '.join(refused)}" if refused else ""))


def _batched_steps(model: Model, prompts: Sequence[Sequence[int]], n: int) -> list[mx.array]:
    """Logits of ``n`` greedy one-token steps of ``prompts`` decoded together: each
    prefilled through its own caches, then stacked, as the engine batches rows."""
    rows = []
    for prompt in prompts:
        cache = model.make_cache()
        mx.eval(model.forward(mx.array([list(prompt)]), cache))
        rows.append(cache)
    caches = [stack_rows(list(layer)) for layer in zip(*rows, strict=True)]
    tokens = mx.array([[prompt[-1]] for prompt in prompts])
    out = []
    for _ in range(n):
        logits = model.forward(tokens, caches)
        mx.eval(logits)
        out.append(logits)
        tokens = mx.argmax(logits[:, -1:, :], axis=-1)
    return out


def check_compiled_step(target: Target) -> CheckResult:
    """Greedy decode through the compiled one-token forward equals the eager one,
    for one row and (with ``batch``) for rows decoding together."""
    name = "compiled-step"
    if (s := _requires(target, COMPILED_STEP, name)) is not None:
        return s

    class Counted(CompiledStep):
        calls = 0

        def __call__(self, inputs, cache):
            Counted.calls += 1
            return super().__call__(inputs, cache)

    model = target.model
    # Prompt and decode together run past the tiny configs' sliding windows
    # (8 tokens), so a rotating window wraps while compiled.
    prompt = _ids(target, 5, seed=31)
    # Rows of two lengths: the shorter is left-padded in the batch.
    prompts = [prompt, _ids(target, 9, seed=32)]
    batched = BATCH in target.capabilities
    kept = model.compiled_step
    counted = Counted(model.module)
    try:
        model.compiled_step = None
        eager = _decode(model, prompt)
        eager_rows = _batched_steps(model, prompts, NEW_TOKENS) if batched else []
        model.compiled_step = counted
        compiled = _decode(model, prompt)
        alone_calls = Counted.calls
        compiled_rows = _batched_steps(model, prompts, NEW_TOKENS) if batched else []
    finally:
        model.compiled_step = kept
    for step, (e, c) in enumerate(zip(eager_rows, compiled_rows, strict=True)):
        ok, diff = _close(c, e)
        if not ok:
            return failed(name, f"batched rows, step {step}: compiled logits differ by {diff:.3g}")
    rows_note = ""
    if batched:
        rows_calls = Counted.calls - alone_calls
        rows_exact = all(
            mx.array_equal(a, b).item() for a, b in zip(eager_rows, compiled_rows, strict=True)
        )
        rows_note = (
            f"; batched rows: {rows_calls} compiled steps equal the eager ones"
            + (" bit for bit" if rows_exact else " within tolerance")
            if rows_calls
            else "; batched rows ran eager (their caches are not of the kinds it traces)"
        )
    Counted.calls = alone_calls
    if Counted.calls == 0:
        kinds = _kinds(model.make_cache())
        return passed(
            name, f"no step ran compiled: its caches ({kinds}) are not of the kinds it traces"
        )
    if counted.refused:
        why = "; ".join(sorted(set(counted.refused.values())))
        return passed(name, f"steps ran eager: the compiled step's trace was refused ({why})")
    for step, ((t1, lp1), (t2, lp2)) in enumerate(zip(eager, compiled, strict=True)):
        if t1 != t2:
            return failed(name, f"step {step}: compiled chose token {t2}, eager {t1}")
        ok, diff = _close(lp2, lp1)
        if not ok:
            return failed(name, f"step {step}: compiled log-probs differ by {diff:.3g}")
    exact = all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(eager, compiled, strict=True))
    return passed(
        name,
        f"{Counted.calls} compiled steps equal the eager ones"
        + (" bit for bit" if exact else " within tolerance")
        + rows_note,
    )


def check_parallel_plan(target: Target) -> CheckResult:
    """A declared parallel plan splits the tiny model across two ranks, in each mode it has.

    Every rank's part is made in this process (splitting runs no collective),
    so this checks the plan against the built graph — every rule names real
    modules, the tiny config's geometry divides, each rank holds less than
    the whole and together they hold all of it — not the ranks' arithmetic
    (``tests/parallel`` runs two real ranks for the core's families).
    """
    name = "parallel-plan"
    impl = target.implementation
    if impl.parallel is None:
        return skipped(name)
    plan = impl.parallel(target.resolved.family_config)
    flat = cast(list[tuple[str, mx.array]], tree_flatten(target.model.module.parameters()))
    whole = sum(v.nbytes for _, v in flat)
    done = []
    for mode, declared in (("tensor", plan.tensor), ("pipeline", plan.pipeline)):
        if declared is None:
            continue
        try:
            parts = [_build_split(target.resolved, mode, RankView(r, 2)) for r in (0, 1)]
        except ParallelRefused as err:
            return failed(
                name,
                f"{mode}: the tiny config does not split across 2 processes, so the plan "
                f"cannot be checked: {err.message} (choose a tiny_config whose split fields "
                "divide by 2)",
            )
        sizes = [info.weight_bytes for _, info in parts]
        if any(size >= whole for size in sizes) or sum(sizes) < whole:
            return failed(
                name,
                f"{mode}: the ranks hold {sizes} bytes of a {whole}-byte model; each must hold "
                "less than the whole, and together all of it",
            )
        done.append(f"{mode}: {' + '.join(map(str, sizes))} of {whole} bytes")
    if not done:
        return failed(name, "the plan declares neither tensor nor pipeline rules")
    return passed(name, "; ".join(done))

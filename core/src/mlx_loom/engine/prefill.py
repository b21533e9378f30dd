"""Prefill: a prompt chunk through a row's own caches, or the first chunks of several
fresh prompts in one padded forward.

A prompt is prefilled in chunks of ``prefill_step_size`` tokens, all but its
last token (whose logits choose the first new token, in the decode step).
Each chunk goes through the row's own single-row caches — the op graph of a
lone request — so the caches come out exactly as a lone prefill makes them.

When several fresh prompts (empty caches, no prefix reused) start prefilling
in the same step, their first chunks run as one left-padded forward through
the model's padded batch caches (``empty_batch``: pads are masked out of
attention and never enter a recurrent state), and each row's caches are then
extracted as single-row caches. One forward instead of one per prompt is
what keeps time to first token down when a burst of requests arrives (the
per-forward overhead, and on a fast BLAS the matrix products, shrink). On
the CPU backend each row's values are the lone prefill's bit for bit (the
engine tests check every family): rows are computed independently and a
masked slot adds an exact zero. The native kernel sets' fp32-activation
products change their order of summation past ``SMALL_ROWS`` rows, so
there rows share a forward only while it holds at most that many
(:func:`partition`). Rows whose caches have no padded batch kind (quantized
KV, windows that keep leading tokens) are prefilled alone.

Padding costs compute, so only chunks of similar length share a forward.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import mlx.core as mx

from mlx_loom.engine.mtp import MtpDrafter, uses_mtp
from mlx_loom.engine.row import Row, adapter_batch_key, row_adapters
from mlx_loom.errors import CapabilityRefused

if TYPE_CHECKING:
    from mlx_loom.model import Model

#: A padded forward may hold at most this many tokens per real token; chunks
#: shorter than that share of the longest are prefilled in another forward.
MAX_PADDING_RATIO = 1.5


def prefill_alone(model: Model, row: Row, step: int) -> None:
    """Feed ``row``'s next chunk through its own caches (then the KV-quantization check).

    A row drafting with the model's MTP head hands the chunk's hidden states,
    each with the prompt token after it, to its head (:mod:`mlx_loom.engine.mtp`).
    """
    start = row.cursor
    chunk = row.next_chunk(step)
    caches = row.caches
    assert caches is not None  # given when the row was admitted
    inputs = mx.array(chunk, mx.uint32)[None]
    if uses_mtp(row):
        _, hidden = model.forward_hidden(inputs, caches)
        if row.mtp is None:
            row.mtp = MtpDrafter(model, row)
        row.mtp.prefill(hidden[0], row.to_feed[start + 1 : start + 1 + len(chunk)])
    else:
        model.forward(inputs, caches, adapters=row_adapters([row]))
    row.request.kv.apply(caches)
    mx.eval([c.state for c in caches])


def can_share(row: Row) -> bool:
    """Whether ``row``'s next chunk may be prefilled with other rows' (fresh caches only)."""
    request = row.request
    return (
        not uses_mtp(row)  # its head needs the hidden states: it prefills alone
        and row.cursor == 0
        and row.cached == 0
        and request.cache is None
        and request.kv.bits is None
        and all(c.empty() for c in row.caches or ())
    )


def partition(
    rows: list[Row], steps: list[int], rows_switch: int | None = None
) -> list[list[int]]:
    """Indices of ``rows`` grouped into forwards whose padding stays bounded.

    ``rows_switch``: the product row count past which a row's arithmetic
    changes (:attr:`~mlx_loom.cpu.path.CpuPath.rows_switch`). Rows then share
    a forward only while it holds at most that many (members times width),
    so every product, a routed expert's included, stays on the side its lone
    prefill is on; longer chunks are prefilled alone (each already a
    many-row product).
    """
    order = sorted(range(len(rows)), key=lambda i: -rows[i].chunk_len(steps[i]))
    groups: list[list[int]] = []
    for i in order:
        n = rows[i].chunk_len(steps[i])
        if groups:
            group = groups[-1]
            width = rows[group[0]].chunk_len(steps[group[0]])
            real = sum(rows[j].chunk_len(steps[j]) for j in group) + n
            together = width * (len(group) + 1)
            same_side = rows_switch is None or together <= rows_switch
            if together <= MAX_PADDING_RATIO * real and same_side:
                group.append(i)
                continue
        groups.append([i])
    return groups


def prefill_together(model: Model, rows: list[Row], steps: list[int]) -> None:
    """The first chunks of fresh ``rows`` in one left-padded forward.

    Raises :class:`~mlx_loom.errors.CapabilityRefused` (having changed
    nothing) when the model's caches have no padded batch kind.
    """
    chunks = [row.to_feed[: row.chunk_len(step)] for row, step in zip(rows, steps, strict=True)]
    width = max(len(c) for c in chunks)
    pads = [width - len(c) for c in chunks]
    first = rows[0].caches
    assert first is not None  # given when the row was admitted
    batch = [c.empty_batch(pads) for c in first]  # may refuse: nothing changed yet
    inputs = mx.array([[0] * p + c for p, c in zip(pads, chunks, strict=True)], mx.uint32)
    model.forward(inputs, batch, adapters=row_adapters(rows))
    for i, (row, step) in enumerate(zip(rows, steps, strict=True)):
        row.next_chunk(step)
        row.caches = [c.extract(i) for c in batch]
    mx.eval([c.state for row in rows for c in row.caches or ()])


def prefill_step(
    model: Model, rows: list[Row], steps: list[int], batchable: bool
) -> dict[int, BaseException]:
    """Advance every row by one chunk; the rows whose chunk failed, by uid."""
    failed: dict[int, BaseException] = {}
    alone = list(range(len(rows)))
    if batchable:
        switch = model.cpu_path.rows_switch if model.cpu_path is not None else None
        shared: dict[Hashable, list[int]] = {}
        for i in alone:
            if can_share(rows[i]):
                shared.setdefault(adapter_batch_key(model, rows[i]), []).append(i)
        forwards = [
            [fresh[j] for j in group]
            for fresh in shared.values()
            for group in partition(
                [rows[i] for i in fresh], [steps[i] for i in fresh], switch
            )
        ]
        for members in forwards:
            if len(members) < 2:
                continue
            try:
                prefill_together(model, [rows[i] for i in members], [steps[i] for i in members])
            except CapabilityRefused:
                continue  # no padded batch kind here: these rows go alone
            except BaseException as err:  # a plugin may raise anything
                for i in members:
                    failed[rows[i].uid] = err
            alone = [i for i in alone if i not in members]
    for i in alone:
        try:
            prefill_alone(model, rows[i], steps[i])
        except BaseException as err:  # a plugin may raise anything
            failed[rows[i].uid] = err
    return failed

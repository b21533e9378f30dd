"""The one-token forward as a compiled MLX function, over full KV caches, rotating
windows and recurrent state.

Building a decode step's graph is Python work — a few milliseconds for a
24-layer model — that competes for the cores with the products themselves
(on a 2-core machine the interpreter's thread takes one of them while it
builds the next step). A compiled function replays a traced graph instead.

A trace is only valid while nothing the forward reads as a Python value
changes, and a cache's offset changes every token. So the step is traced
against stand-in caches whose offset (the token's position) is an array:

* a **full** :class:`~mlx_loom.cache.KVCache` writes the new key/value at
  that offset into its buffer (``mx.slice_update`` with a dynamic start) and
  attends over the buffer's first ``offset + 1`` slots: the native attention
  takes that count as an array and reads nothing past it;
* a **rotating window** (:class:`~mlx_loom.cache.RotatingKVCache`) first
  does, in Python before the call, the slot housekeeping its own one-token
  write does (grow the buffer, drop what a chunk left past the window, wrap
  the write index: :meth:`~mlx_loom.cache.RotatingKVCache.prepare_write`),
  then the trace writes at that slot (an array) and attends over the buffer
  in its slot order, as the eager step does, its filled length an array too.
  Only where the eager step builds no mask: a graph that asks a window for a
  narrower attention window than its buffer (or a full cache for any window)
  gets a mask from the eager step, so the trace refuses — the step records
  why (:attr:`CompiledStep.refused`) and that layout of caches runs eager;
* a **recurrent** cache (:class:`~mlx_loom.cache.recurrent.RecurrentCache`,
  unpadded, no speculative round open) hands its convolution tail and state
  in as arrays and takes the new ones back;
* **batched rows** (``B > 1``: the engine's batch of stacked rows, each
  layer's cache a :class:`~mlx_loom.cache.BatchKVCache` or a
  :class:`~mlx_loom.cache.StackedRotatingKVCache` in plain storage, or an
  unpadded recurrent cache): a batch's full cache hands in its rows'
  positions and left padding as arrays besides its buffers, writes every
  row's token at the shared write slot, and builds in the trace the padding
  mask the eager cache builds — over the whole buffer, of which the native
  attention reads only the filled columns, the eager mask's. A batch's
  sliding windows keep each row's own slot order: after the eager write's
  growth, done first in Python, they hand in each row's token count and
  write slot, write each row at its own slot (the eager scatter) and build
  the eager window mask from the same arrays. MLX retraces per input shape,
  so each row count and buffer length is one more trace.

A KV-shared layer (Gemma 4) attends through its donor's view, which in the
trace is the donor's traced buffer, so it needs nothing of its own. The
logits equal the uncompiled step's bit for bit (tested per kind, over
prompts longer than the windows so they wrap). A full buffer grows by 256
slots at a time, a window's up to its size, and each new set of buffer
lengths is one more trace.

It applies — :meth:`CompiledStep.applies` — only where that reasoning holds:
one new token, every cache one of those kinds in plain storage (one row: at
one shared offset) with room for the token, no adapters, not a rank of a
split model. The core uses it for models on the native CPU kernel sets whose
family declares ``compiled-step``, unless ``MLX_LOOM_COMPILED_STEP=0``.

What stays eager, and why:

* a trace that asks for a mask or attention sinks (above), or whose kernels
  read an array on the host, which MLX refuses in a trace (none of the
  core's on the native sets, where routed experts are native gathered
  products; a plugin's kernel might). The
  step keeps the reason in :attr:`CompiledStep.refused`, logs it once
  (``mlx_loom.cpu``, info) and runs that layout of caches eager;

* **affine-quantized and TurboQuant KV** (``kv_bits`` / ``kv_codec``): their
  views attend with MLX ops whose key count is the stored arrays' length. A
  trace fixes that length at the whole buffer (MLX has no slice of a dynamic
  length), so it would attend over up to 255 empty slots behind a mask: a
  longer reduction than the eager step's (not bit-equal) and more work — the
  same reason the plain path first attended that way and was slower than
  eager. Only the native plain-key attention takes a filled length.
* mixed-codec batches (:class:`~mlx_loom.cache.mixed.MixedRowsCache`).
* prefill chunks, speculative verification windows and open rounds, adapters.

Measured (350M Llama, 4-bit, float32, 2 threads, alternated in one process,
100 new tokens): 18.3 against 20.8 ms a token with int8 activations, 17.6
against 19.9 without; the tiny 4-layer model 0.84 against 1.09 ms. It used
to attend over the whole buffer with the slots past the offset masked off,
and was then slower than eager on the 350M model (the buffer is up to 255
slots longer than the sequence). Over windows and recurrent state, on a
loaded 2-core machine (min / median ms a token, eager against compiled): a
15-layer Gemma-4-shaped model 18.6 / 24.4 against 13.6 / 19.2, a 12-layer
Qwen3-Next-shaped one 11.6 / 17.9 against 10.2 / 12.7 (docs/cpu.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import partial
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from ..cache.batch import BatchKVCache
from ..cache.kv import KVCache
from ..cache.recurrent import RecurrentCache
from ..cache.rotating import RotatingKVCache
from ..cache.stacked import StackedRotatingKVCache
from ..cpu.native import NATIVE_KERNEL_SETS
from ..forward_hooks import current_attention

__all__ = ["CompiledStep", "describe", "not_compiled_because"]

#: The capability a family declares when its graph reads caches only through what
#: the stand-ins below provide (``mlx_loom.plugin.COMPILED_STEP``; docs/plugin-authors.md).
_CAPABILITY = "compiled-step"


def not_compiled_because(
    kernel_set: str | None, capabilities: frozenset[str], *, split: bool = False
) -> str | None:
    """Why a model with this kernel set and these capabilities gets no compiled step (or None).

    ``split``: the model is one rank's part of a split model, whose forward
    hands activations between ranks as it goes (``async_eval`` cannot run in
    a trace).
    """
    if split:
        return "a split model's forward exchanges activations between ranks"
    if kernel_set not in NATIVE_KERNEL_SETS:
        return "compiled only on the native CPU kernel sets"
    if _CAPABILITY not in capabilities:
        return "the family does not declare compiled-step"
    if os.environ.get("MLX_LOOM_COMPILED_STEP") == "0":
        return "MLX_LOOM_COMPILED_STEP=0 turns it off"
    return None


def describe(kernel_set: str | None, capabilities: frozenset[str], *, split: bool = False) -> str:
    """What ``loom explain`` says about the decode step."""
    why = not_compiled_because(kernel_set, capabilities, split=split)
    if why is None:
        return (
            "compiled where one token goes over full KV caches, rotating windows and "
            "recurrent state in plain storage, one row or a batch's (else eager: prefill, "
            "quantized KV)"
        )
    return f"eager ({why})"


log = logging.getLogger("mlx_loom.cpu")

#: What MLX says when a traced function asks for an array's value.
_HOST_READ = "during function transformations"


class _Untraceable(Exception):
    """The traced forward asked for something only the eager step builds (a mask)."""


class _WindowView:
    """A layer's whole key/value buffer, attended over its first ``lengths`` slots
    (behind a batch's padding mask, the only mask a trace builds)."""

    def __init__(self, keys: mx.array, values: mx.array, lengths: mx.array) -> None:
        self.keys, self.values, self.lengths = keys, values, lengths

    def attend(
        self, queries: mx.array, *, scale: float, mask: Any, sinks: mx.array | None = None
    ) -> mx.array:
        if (mask is not None and not isinstance(mask, mx.array)) or sinks is not None:
            raise _Untraceable("the compiled step attends one query, without attention sinks")
        kernel = current_attention()
        if kernel is not None:
            # The native kernel reads only the filled slots (their count, an
            # array, rides in the trace), and of the mask only those columns.
            return kernel(
                queries, self.keys, self.values, scale=scale, mask=mask, lengths=self.lengths
            )
        valid = mx.arange(self.keys.shape[2]) < self.lengths
        if mask is not None:
            valid = valid & mask
        return mx.fast.scaled_dot_product_attention(
            queries, self.keys, self.values, scale=scale, mask=valid
        )


class _TracedKV:
    """A KV cache as the traced step sees it: the whole buffers, the token's position
    ``offset`` (an int32 scalar array), the ``slot`` it is written to and the filled
    length after it (``lengths``), each int32 ``[1]``.

    A full cache writes at its offset; a rotating window at its write index,
    which the window's own housekeeping set before the call. ``window`` is a
    rotating cache's ``max_size`` (None for a full cache): for one token the
    eager step builds no mask over a window at most that wide, and a mask
    over anything else, which the trace refuses.
    """

    def __init__(
        self,
        keys: mx.array,
        values: mx.array,
        offset: mx.array,
        slot: mx.array,
        lengths: mx.array,
        window: int | None,
    ) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self.slot, self.lengths, self.window = slot, lengths, window

    def make_mask(
        self, N: int, *, window_size: int | None = None, return_array: bool = False
    ) -> Any:
        if N != 1 or return_array:
            raise _Untraceable("the compiled step builds no mask")
        if window_size is None:
            return None
        if self.window is not None and window_size >= self.window:
            return None  # RotatingKVCache.make_mask: no mask within the window
        over = "a full cache" if self.window is None else f"a {self.window}-slot rotating window"
        raise _Untraceable(f"an attention window of {window_size} tokens over {over} needs a mask")

    def append(self, keys: mx.array, values: mx.array) -> _WindowView:
        self.keys = mx.slice_update(self.keys, keys, self.slot, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.slot, axes=(2,))
        return _WindowView(self.keys, self.values, self.lengths)


class _TracedBatchKV(_TracedKV):
    """A batch's full KV cache (:class:`~mlx_loom.cache.BatchKVCache`) as the traced
    step sees it: the whole buffers, each row's position ``offset`` and
    ``left_padding`` (int32 ``[B]``), the shared write ``slot`` and the filled
    length after it (``lengths``, each int32 ``[1]``).

    Its mask is the eager cache's — key ``j`` is seen by row ``b`` when
    ``left_padding[b] <= j <= slot`` (and within a window, if the graph asks
    for one) — over the whole buffer; the attention reads only its first
    ``lengths`` columns, which are the eager mask's.
    """

    def __init__(
        self,
        keys: mx.array,
        values: mx.array,
        offset: mx.array,
        left_padding: mx.array,
        slot: mx.array,
        lengths: mx.array,
    ) -> None:
        super().__init__(keys, values, offset, slot, lengths, window=None)
        self.left_padding = left_padding

    def make_mask(
        self, N: int, *, window_size: int | None = None, return_array: bool = False
    ) -> mx.array:
        if N != 1:
            raise _Untraceable("the compiled step runs one token")
        slots = mx.arange(self.keys.shape[2])
        mask = (slots <= self.slot) & (self.left_padding[:, None] <= slots)
        if window_size is not None:
            mask = mask & (self.slot < slots + window_size)
        return mask[:, None, None, :]


class _TracedRowWindows:
    """A batch's sliding windows (:class:`~mlx_loom.cache.StackedRotatingKVCache`) as
    the traced step sees them: the whole buffers (grown before the call as the
    eager write grows them), each row's tokens so far (``count``, also its
    position) and the slot its token goes to (``next``), int32 ``[B]``.

    Each row writes at its own slot (the eager cache's scatter) and its mask
    is the eager cache's, computed from the same arrays: row ``b``'s slot
    ``s`` is seen when the token there is less than the window old.
    """

    def __init__(
        self, keys: mx.array, values: mx.array, count: mx.array, nxt: mx.array, max_size: int
    ) -> None:
        self.keys, self.values, self.offset, self.next = keys, values, count, nxt
        self.max_size = max_size

    def make_mask(
        self, N: int, *, window_size: int | None = None, return_array: bool = False
    ) -> mx.array:
        if N != 1:
            raise _Untraceable("the compiled step runs one token")
        W = self.max_size
        window = min(window_size or W, W)
        slot = mx.arange(self.keys.shape[2])[None]
        newest = self.offset[:, None]
        after = ((self.next + 1) % W)[:, None]
        age = mx.where(newest >= W, (after - 1 - slot) % W, newest - slot)
        return ((age >= 0) & (age < window) & (slot < W))[:, None, None, :]

    def append(self, keys: mx.array, values: mx.array) -> _WindowView:
        where = self.next[:, None, None, None]
        self.keys = mx.put_along_axis(self.keys, where, keys, axis=2)
        self.values = mx.put_along_axis(self.values, where, values, axis=2)
        every = mx.array([self.keys.shape[2]], dtype=mx.int32)  # the mask picks the slots
        return _WindowView(self.keys, self.values, every)


class _TracedRecurrent:
    """A recurrent cache as the traced step sees it: its convolution tail and state as
    arrays in, the new ones out; one unpadded row set, no speculative round open."""

    in_round = False

    def __init__(self, conv_state: mx.array, recurrent_state: mx.array, offset: mx.array) -> None:
        self.conv_state, self.recurrent_state, self.offset = conv_state, recurrent_state, offset

    def make_mask(
        self, N: int, *, window_size: int | None = None, return_array: bool = False
    ) -> None:
        if N != 1:
            raise _Untraceable("the compiled step runs one token")
        return None  # no padding: every position is real

    def tail_ends(self, N: int) -> None:
        return None

    def conv_tail(self, batch: int, width: int, channels: int, dtype: mx.Dtype) -> mx.array:
        return self.conv_state

    def record(self, **_: Any) -> None:
        """Nothing to keep: no speculative round is open (``applies``)."""

    def update(self, *, conv_state: mx.array, recurrent_state: mx.array, n: int) -> None:
        self.conv_state, self.recurrent_state = conv_state, recurrent_state


#: A layer's static part of a trace: ``None`` for a full cache, a rotating
#: window's ``max_size``, ``"recurrent"``, ``"batch"`` for a batch's full cache,
#: or ``("rows", max_size)`` for a batch's sliding windows.
_Layer = int | str | tuple[str, int] | None
_Shape = tuple[_Layer, ...]
_RECURRENT = "recurrent"
_BATCH = "batch"


def _recurrent_traceable(c: RecurrentCache) -> bool:
    """Unpadded, outside a speculative round, already written."""
    return bool(
        c.left_padding is None
        and c.lengths is None
        and not c.in_round
        and c.conv_state is not None
        and c.recurrent_state is not None
    )


def _traceable(c: Any, offset: int) -> bool:
    """A plain full cache with room for one more token, a plain rotating window, or an
    unpadded recurrent cache; outside a speculative round, already written and at
    ``offset``."""
    kind = type(c)
    if kind is RecurrentCache:
        return c.offset == offset and isinstance(c.offset, int) and _recurrent_traceable(c)
    if kind is not KVCache and kind is not RotatingKVCache:
        return False
    if not c.plain or not isinstance(c.keys, mx.array) or c.offset != offset:
        return False
    if kind is KVCache:
        return bool(c.offset < c.keys.shape[2])
    return not c.in_round


def _batch_traceable(c: Any) -> bool:
    """A batch's plain full cache that takes the token in place, or its recurrent state."""
    kind = type(c)
    if kind is RecurrentCache:
        return _recurrent_traceable(c)
    if kind is StackedRotatingKVCache:
        return c.takes_traced_token()
    return kind is BatchKVCache and c.takes_traced_token()


def _layer(c: Any) -> _Layer:
    if isinstance(c, RecurrentCache):
        return _RECURRENT
    if isinstance(c, BatchKVCache):
        return _BATCH
    if isinstance(c, StackedRotatingKVCache):
        return ("rows", c.max_size)
    return c.max_size if isinstance(c, RotatingKVCache) else None


def _arrays(c: Any, batched: bool = False) -> tuple[mx.array, ...]:
    """The arrays a layer's cache hands the trace (``applies`` checked they exist): a
    batch's full cache adds its rows' positions and left padding, a batch's
    recurrent cache its own offset (one row's is the shared offset)."""
    if isinstance(c, RecurrentCache):
        states = (cast(mx.array, c.conv_state), cast(mx.array, c.recurrent_state))
        if batched:
            return (*states, mx.array(c.offset, dtype=mx.int32))
        return states
    if isinstance(c, BatchKVCache):
        return (
            cast(mx.array, c.keys),
            cast(mx.array, c.values),
            c.offset.astype(mx.int32),
            c.left_padding.astype(mx.int32),
        )
    return cast(mx.array, c.keys), cast(mx.array, c.values)


class CompiledStep:
    """``module(tokens[B, 1], caches)`` over full KV caches, rotating windows,
    recurrent caches and batches' full caches, compiled; see the module docstring."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        #: One trace per layout of caches and sharing of ``where`` rows.
        self._compiled: dict[tuple[_Shape, tuple[int, ...]], Any] = {}
        #: Why a layout of caches runs eager after all (its trace asked for a mask).
        self.refused: dict[_Shape, str] = {}

    @staticmethod
    def applies(inputs: mx.array, cache: Sequence[Any] | None) -> bool:
        if cache is None or len(cache) == 0 or inputs.ndim != 2 or inputs.shape[1] != 1:
            return False
        if inputs.shape[0] > 1:  # batched rows: the engine's batch caches
            return all(_batch_traceable(c) for c in cache)
        offset = cache[0].offset
        return isinstance(offset, int) and all(_traceable(c, offset) for c in cache)

    def __call__(self, inputs: mx.array, cache: Sequence[Any]) -> mx.array:
        shape: _Shape = tuple(_layer(c) for c in cache)
        if shape in self.refused:
            return cast(mx.array, self._module(inputs, cache=list(cache)))
        batched = inputs.shape[0] > 1
        offset = 0 if batched else cache[0].offset
        # Per layer: where it writes and how far it attends (one row of
        # ``where``), and the arrays it hands the trace — each taken after the
        # housekeeping the eager write does first (growing, wrapping).
        where: list[list[int]] = []
        arrays: list[tuple[mx.array, ...]] = []
        for c in cache:
            if isinstance(c, RotatingKVCache):
                c.prepare_write(*_arrays(c))
                arrays.append(_arrays(c))
                where.append([c.write_slot, min(offset + 1, arrays[-1][0].shape[2])])
            elif isinstance(c, StackedRotatingKVCache):
                rows = c.prepare_traced_write()  # each row's own slot rides in its arrays
                arrays.append((*_arrays(c), *rows))
                where.append([0, 0])
            elif isinstance(c, BatchKVCache):
                arrays.append(_arrays(c))
                where.append([c.write_slot, c.write_slot + 1])
            else:
                arrays.append(_arrays(c, batched))
                where.append([offset, offset + 1])  # a recurrent layer reads neither
        # Layers that write at the same slot and attend over the same length
        # (every full cache; the windows of one size) share one row of
        # ``where``: the trace slices each distinct row once, not once per
        # layer (a 24-layer Llama's step: 48 slice nodes down to 2).
        shared: dict[tuple[int, int], int] = {}
        uses = tuple(shared.setdefault((a, b), len(shared)) for a, b in where)
        key = (shape, uses)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = mx.compile(partial(self._forward, shape, uses))
        try:
            logits, states = compiled(
                inputs,
                mx.array(offset, dtype=mx.int32),
                mx.array(list(shared), dtype=mx.int32),
                arrays,
            )
        except _Untraceable as e:
            return self._refuse(shape, str(e), inputs, cache)
        except ValueError as e:
            if _HOST_READ not in str(e):
                raise
            # A kernel read an array on the host (a plugin's, say): it cannot
            # run in a trace, so this layout runs eager.
            return self._refuse(shape, f"a kernel reads an array on the host ({e})", inputs, cache)
        for c, state in zip(cache, states, strict=True):
            if isinstance(c, RecurrentCache):
                c.update(conv_state=state[0], recurrent_state=state[1], n=1)
            elif isinstance(c, RotatingKVCache):
                c.written(state[0], state[1])
            elif isinstance(c, BatchKVCache):
                c.written(state[0], state[1], state[2])
            elif isinstance(c, StackedRotatingKVCache):
                c.traced_written(state[0], state[1])
            else:
                c.keys, c.values = state[0], state[1]
                c.offset += 1
        return cast(mx.array, logits)

    def _refuse(self, shape: _Shape, why: str, inputs: mx.array, cache: Sequence[Any]) -> mx.array:
        """Run eager from now on for this layout, keeping why.

        The trace stopped before any cache changed but for the housekeeping,
        which the eager write repeats as a no-op.
        """
        self.refused[shape] = why
        log.info("the compiled decode step runs eager for this model: %s", why)
        return cast(mx.array, self._module(inputs, cache=list(cache)))

    def _forward(
        self,
        shape: _Shape,
        uses: tuple[int, ...],
        inputs: mx.array,
        offset: mx.array,
        where: mx.array,
        states: list[tuple[mx.array, ...]],
    ) -> tuple[mx.array, list[tuple[mx.array, ...]]]:
        """The traced step; layer ``i`` writes at ``where[uses[i], 0]`` and attends
        over ``where[uses[i], 1]`` slots."""
        slots = [where[u, 0:1] for u in range(where.shape[0])]
        lengths = [where[u, 1:2] for u in range(where.shape[0])]
        traced: list[_TracedKV | _TracedBatchKV | _TracedRowWindows | _TracedRecurrent] = []
        for state, layer, u in zip(states, shape, uses, strict=True):
            if layer == _RECURRENT:
                own = state[2] if len(state) > 2 else offset  # a batch's: its own
                traced.append(_TracedRecurrent(state[0], state[1], own))
            elif layer == _BATCH:
                keys, values, positions, left_padding = state
                traced.append(
                    _TracedBatchKV(keys, values, positions, left_padding, slots[u], lengths[u])
                )
            elif isinstance(layer, tuple):
                keys, values, count, nxt = state
                traced.append(_TracedRowWindows(keys, values, count, nxt, layer[1]))
            else:
                window = layer if isinstance(layer, int) else None
                traced.append(_TracedKV(state[0], state[1], offset, slots[u], lengths[u], window))
        logits = self._module(inputs, cache=traced)
        out: list[tuple[mx.array, ...]] = []
        for t in traced:
            if isinstance(t, _TracedRecurrent):
                out.append((t.conv_state, t.recurrent_state))
            elif isinstance(t, _TracedBatchKV):
                out.append((t.keys, t.values, t.offset + 1))
            elif isinstance(t, _TracedRowWindows):
                out.append((t.keys, t.values))
            else:
                out.append((t.keys, t.values))
        return logits, out

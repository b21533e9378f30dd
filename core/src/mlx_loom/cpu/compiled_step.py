"""The one-token forward as a compiled MLX function, where every layer's cache is a full KV cache.

Building a decode step's graph is Python work — a few milliseconds for a
24-layer model — that competes for the cores with the products themselves
(on a 2-core machine the interpreter's thread takes one of them while it
builds the next step). A compiled function replays a traced graph instead.

A trace is only valid while nothing the forward reads as a Python value
changes, and a KV cache's offset changes every token. So the step is traced
against stand-in caches whose offset is an array, which write the new
key/value at that offset into the full buffer (``mx.slice_update`` with a
dynamic start) and attend over the buffer's first ``offset + 1`` slots (the
native attention takes that count as an array and reads nothing past it).
The logits equal the uncompiled step's bit for bit (tested). The buffer
grows by 256 slots at a time, and each new buffer length is one more trace.

It applies — :meth:`CompiledStep.applies` — only where that reasoning holds:
one new token, every cache a plain :class:`~mlx_loom.cache.KVCache` with room
for it at one shared offset, no adapters, not a rank of a split model.
Anything else (rotating windows, recurrent state, quantized KV, batches,
verification windows) runs the ordinary forward. The core uses it for
models on the native CPU kernel sets whose family declares
``compiled-step``, unless ``MLX_LOOM_COMPILED_STEP=0``.

Measured (350M Llama, 4-bit, float32, 2 threads, alternated in one process,
100 new tokens): 18.3 against 20.8 ms a token with int8 activations, 17.6
against 19.9 without; the tiny 4-layer model 0.84 against 1.09 ms. It used
to attend over the whole buffer with the slots past the offset masked off,
and was then slower than eager on the 350M model (the buffer is up to 255
slots longer than the sequence).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import KVCache
from ..cpu.native import NATIVE_KERNEL_SETS
from ..forward_hooks import current_attention

__all__ = ["CompiledStep", "describe", "not_compiled_because"]

#: The capability a family declares when its graph reads caches only through
#: ``offset``, ``make_mask`` and ``append`` (``mlx_loom.plugin.COMPILED_STEP``).
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
        return "compiled where one token goes over full KV caches (else eager)"
    return f"eager ({why})"


class _WindowView:
    """The whole key/value buffer, attended over its first ``offset + 1`` slots."""

    def __init__(
        self, keys: mx.array, values: mx.array, offset: mx.array, lengths: mx.array
    ) -> None:
        self.keys, self.values, self.offset, self.lengths = keys, values, offset, lengths

    def attend(
        self, queries: mx.array, *, scale: float, mask: Any, sinks: mx.array | None = None
    ) -> mx.array:
        if mask is not None or sinks is not None:
            raise NotImplementedError("the compiled step attends one query, without sinks")
        kernel = current_attention()
        if kernel is not None:
            # The native kernel reads only the filled slots (their count, an
            # array, rides in the trace).
            return kernel(
                queries, self.keys, self.values, scale=scale, mask=None, lengths=self.lengths
            )
        valid = mx.arange(self.keys.shape[2]) <= self.offset
        return mx.fast.scaled_dot_product_attention(
            queries, self.keys, self.values, scale=scale, mask=valid
        )


class _TracedKV:
    """A KV cache as the traced step sees it: the full buffers, an array offset and
    the filled length after this token (``offset + 1``, int32 ``[1]``, shared by every
    layer of the step)."""

    def __init__(
        self, keys: mx.array, values: mx.array, offset: mx.array, lengths: mx.array
    ) -> None:
        self.keys, self.values, self.offset, self.lengths = keys, values, offset, lengths

    def make_mask(
        self, N: int, *, window_size: int | None = None, return_array: bool = False
    ) -> Any:
        if N != 1 or window_size is not None or return_array:
            raise NotImplementedError("the compiled step builds no mask")
        return None

    def append(self, keys: mx.array, values: mx.array) -> _WindowView:
        start = self.offset[None]
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        return _WindowView(self.keys, self.values, self.offset, self.lengths)


class CompiledStep:
    """``module(tokens[B, 1], caches)`` for full KV caches, compiled; see the module docstring."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._compiled = mx.compile(self._forward)

    @staticmethod
    def applies(inputs: mx.array, cache: Sequence[Any] | None) -> bool:
        if cache is None or len(cache) == 0 or inputs.ndim != 2 or inputs.shape[1] != 1:
            return False
        first = cache[0]
        for c in cache:
            if type(c) is not KVCache or not c.plain or not isinstance(c.keys, mx.array):
                return False
            if c.offset != first.offset or c.offset >= c.keys.shape[2]:
                return False
        return True

    def __call__(self, inputs: mx.array, cache: Sequence[KVCache]) -> mx.array:
        offset = mx.array(cache[0].offset, dtype=mx.int32)
        logits, keys, values = self._compiled(
            inputs,
            offset,
            [cast(mx.array, c.keys) for c in cache],  # plain: one array each (applies())
            [cast(mx.array, c.values) for c in cache],
        )
        for c, k, v in zip(cache, keys, values, strict=True):
            c.keys, c.values = k, v
            c.offset += 1
        return logits

    def _forward(
        self, inputs: mx.array, offset: mx.array, keys: list[mx.array], values: list[mx.array]
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        lengths = (offset + 1).reshape(1)
        traced = [_TracedKV(k, v, offset, lengths) for k, v in zip(keys, values, strict=True)]
        logits = self._module(inputs, cache=traced)
        return logits, [t.keys for t in traced], [t.values for t in traced]

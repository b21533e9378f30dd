"""The stream a thread generates on.

Generation runs on a stream of its own so that queuing the next step
(``mx.async_eval``) overlaps with the host work of handing out the current
token; on the default stream the two serialise (measured on a 2-core CPU
with a 7M-parameter Llama: ~10% faster decode). MLX streams belong to the
thread that made them, so each thread that drives an engine gets its own.
Its own module, below the engine, because the lock-step messages of a split
model (:mod:`mlx_loom.parallel.lockstep`) run on the same stream.
"""

from __future__ import annotations

import threading

import mlx.core as mx

__all__ = ["generation_stream"]

_streams = threading.local()


def generation_stream() -> mx.Stream:
    """This thread's generation stream, made on first use."""
    stream = getattr(_streams, "stream", None)
    if stream is None:
        stream = _streams.stream = mx.new_stream(mx.default_device())
    return stream

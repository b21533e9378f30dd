"""The continuous-batching engine: one loop for every generation.

:class:`Engine` (shaped like mlx-lm's ``BatchGenerator``: ``insert``,
``remove``, ``step``) batches requests that join and leave between decode
steps, prefills new prompts in chunks between those steps, and keeps a shared
prefix store of prompt caches. :class:`EngineService` is the one thread per
model that drives it; ``generate``, ``stream_generate``, ``batch_generate``
and ``loom serve`` are its clients (``model.engine``).

Typical direct use::

    engine = Engine(model, EngineSettings(decode_concurrency=8))
    uids = engine.insert([make_request(model, tokenizer, "Hello", max_tokens=32)])
    while engine.has_work:
        for event in engine.step():
            ...
"""

from mlx_loom.engine.core import Engine, EngineStats, generation_stream
from mlx_loom.engine.events import Done, Event, TokenEvent
from mlx_loom.engine.prefix import PrefixStore
from mlx_loom.engine.request import (
    KVQuantization,
    Request,
    Speculation,
    context_room,
    encode_prompt,
    make_request,
)
from mlx_loom.engine.service import EngineService, Handle, ServiceStats
from mlx_loom.engine.settings import EngineSettings

__all__ = [
    "Done",
    "Engine",
    "EngineService",
    "EngineSettings",
    "EngineStats",
    "Event",
    "Handle",
    "KVQuantization",
    "PrefixStore",
    "Request",
    "ServiceStats",
    "Speculation",
    "TokenEvent",
    "context_room",
    "encode_prompt",
    "generation_stream",
    "make_request",
]

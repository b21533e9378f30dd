"""The generate API: the engine's clients for a program that holds a model.

``stream_generate``/``generate`` for one prompt (with prompt-cache reuse),
``batch_generate`` for several prompts decoded together, ``generate_tokens``
for token ids in and out. All of them run on the model's continuous-batching
engine (:mod:`mlx_loom.engine`): there is one loop. Request parameters and
sampling belong to the engine and are re-exported here. The package is not
called ``generate``, so the function :func:`mlx_loom.generate` is never shadowed.
"""

from ..engine.params import SamplingParams
from ..engine.sampling import Sampler, make_logits_processors, make_sampler
from .batch import BatchResponse, BatchResult, BatchStats, batch_generate, batch_generate_tokens
from .loop import KVQuantization, StepLog, generate_tokens
from .prompt_cache import PromptCache
from .stream import GenerationResponse, generate, stream_generate

__all__ = [
    "BatchResponse",
    "BatchResult",
    "BatchStats",
    "GenerationResponse",
    "KVQuantization",
    "PromptCache",
    "Sampler",
    "SamplingParams",
    "StepLog",
    "batch_generate",
    "batch_generate_tokens",
    "generate",
    "generate_tokens",
    "make_logits_processors",
    "make_sampler",
    "stream_generate",
]

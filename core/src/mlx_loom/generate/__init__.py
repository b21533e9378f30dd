"""Generation loops written once against the cache protocol.

``stream_generate``/``generate`` for one prompt (with prompt-cache reuse),
``batch_generate`` for several prompts decoded together.
"""

from .batch import BatchResult, batch_generate, batch_generate_tokens
from .loop import KVQuantization, generate_tokens
from .params import SamplingParams
from .prompt_cache import PromptCache
from .sampling import Sampler, make_logits_processors, make_sampler
from .stream import GenerationResponse, generate, stream_generate

__all__ = [
    "BatchResult",
    "GenerationResponse",
    "KVQuantization",
    "PromptCache",
    "Sampler",
    "SamplingParams",
    "batch_generate",
    "batch_generate_tokens",
    "generate",
    "generate_tokens",
    "make_logits_processors",
    "make_sampler",
    "stream_generate",
]

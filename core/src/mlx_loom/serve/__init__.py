"""``loom serve``: an OpenAI-compatible HTTP server for one loaded model.

``make_server(model, tokenizer, host=..., port=...)`` binds a
:class:`LoomServer`; ``serve_forever()`` (or ``start_in_background()``)
serves the chat page (``GET /``), ``GET /v1/models``, ``GET /health``,
``POST /v1/completions``, ``POST /v1/chat/completions``, the Responses API's
``POST /v1/responses``, the Anthropic ``POST /v1/messages`` (and its
``/count_tokens``), ``POST /tokenize``, ``POST /detokenize`` and the
Prometheus ``GET /metrics``. See ``docs/serve.md``.
"""

from .app import DEFAULT_MAX_TOKENS_LIMIT, ServeApp
from .errors import HttpError, ServerStartError
from .server import MAX_BODY_BYTES, LoomServer, make_server
from .tools import ChatFormat

__all__ = [
    "DEFAULT_MAX_TOKENS_LIMIT",
    "ChatFormat",
    "MAX_BODY_BYTES",
    "HttpError",
    "LoomServer",
    "ServeApp",
    "ServerStartError",
    "make_server",
]

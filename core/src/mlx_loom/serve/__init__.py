"""``loom serve``: an OpenAI-compatible HTTP server for one loaded model.

``make_server(model, tokenizer, host=..., port=...)`` binds a
:class:`LoomServer`; ``serve_forever()`` (or ``start_in_background()``)
serves ``GET /v1/models``, ``GET /health``, ``POST /v1/completions`` and
``POST /v1/chat/completions``. See ``docs/serve.md``.
"""

from .app import DEFAULT_MAX_TOKENS_LIMIT, ServeApp
from .errors import HttpError, ServerStartError
from .server import MAX_BODY_BYTES, LoomServer, make_server

__all__ = [
    "DEFAULT_MAX_TOKENS_LIMIT",
    "MAX_BODY_BYTES",
    "HttpError",
    "LoomServer",
    "ServeApp",
    "ServerStartError",
    "make_server",
]

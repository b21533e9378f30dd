"""Errors the server answers with, and how engine errors become HTTP answers.

Every failure a client can cause is answered with an OpenAI-style body,
``{"error": {"message", "type", "param", "code"}}``, plus our own ``fix``
field, so existing OpenAI clients raise their usual exceptions and a person
reading the body still learns what to change. The engine's typed errors keep
their messages: a :class:`~mlx_loom.errors.RequestError` from
``SamplingParams.parse`` or ``make_request`` reaches the client word for word,
with the field (``param``) and reason (``code``) it names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import (
    EngineBusy,
    KVBudgetExceeded,
    LoomError,
    Refusal,
    RequestError,
    TokenizerError,
)

#: ``type`` values, as the OpenAI API spells them (``refusal`` is ours).
INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
REFUSAL = "refusal"
SERVER_ERROR = "server_error"


class HttpError(LoomError):
    """A request the server answers with an HTTP error status instead of a completion.

    ``param`` names the request field at fault (``None`` when no single field
    is); ``code`` is a short machine-readable reason (``context_length_exceeded``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        fix: str | None = None,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, fix=fix)
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON error body; ``message`` carries the fix too, for clients that show only it."""
        message = self.message if self.fix is None else f"{self.message} Fix: {self.fix}"
        return {
            "error": {
                "message": message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
                "fix": self.fix,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """The same error in the Anthropic Messages API's shape (for ``/v1/messages``)."""
        message = self.message if self.fix is None else f"{self.message} Fix: {self.fix}"
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"), "message": message},
        }


#: Anthropic's error ``type`` per status (``api_error`` for anything else).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    411: "invalid_request_error",
    413: "request_too_large",
    414: "request_too_large",
    431: "request_too_large",
    501: "invalid_request_error",
    505: "invalid_request_error",
    422: "invalid_request_error",
    503: "overloaded_error",
}


#: Seconds a client told the server is overloaded should wait before it retries.
RETRY_AFTER_SECONDS = 1


def overloaded(message: str, *, fix: str, code: str) -> HttpError:
    """The one answer to load, whatever is full: ``503`` with ``Retry-After``.

    Every bound on concurrent work answers the same way (the connection
    limit; any queue bound), so a client has one rule: wait, then retry.
    ``code`` says which bound it met.
    """
    return HttpError(
        503,
        message,
        fix=fix,
        type=SERVER_ERROR,
        code=code,
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


class ServerStartError(LoomError):
    """The server could not start listening (address in use, not permitted ...)."""


def from_loom_error(err: LoomError, *, param: str | None = None) -> HttpError:
    """The HTTP answer for an engine error raised while handling a request.

    Bad request values and unusable chat templates are the client's to fix
    (400). A refusal — the model or its profile cannot do what was asked — is
    422: the request is well formed, this model will not serve it.
    Anything else is the server's own failure (500).
    """
    if isinstance(err, HttpError):
        return err
    if isinstance(err, EngineBusy):
        # A request that outgrew the KV byte budget fails on the engine thread.
        code = "kv_budget" if isinstance(err, KVBudgetExceeded) else "queue_full"
        return overloaded(err.message, fix=err.fix or "", code=code)
    if isinstance(err, Refusal):
        return HttpError(
            422, err.message, fix=err.fix, type=REFUSAL, param=param, code=type(err).__name__
        )
    if isinstance(err, RequestError):
        # The engine's validator names the field and the reason; ``param``
        # (the field's name on the wire) wins where the two differ.
        param = param if param is not None else err.param
        code = err.code or ("invalid_parameter" if param is not None else "invalid_request")
        return HttpError(400, err.message, fix=err.fix, param=param, code=code)
    if isinstance(err, TokenizerError):
        code = "invalid_parameter" if param is not None else "invalid_request"
        return HttpError(400, err.message, fix=err.fix, param=param, code=code)
    return HttpError(
        500, err.message, fix=err.fix, type=SERVER_ERROR, param=param, code=type(err).__name__
    )


def rename_param(err: HttpError, names: Mapping[str, str]) -> HttpError:
    """``err`` naming its field as a translating endpoint's client sent it.

    ``/v1/messages`` and ``/v1/responses`` are checked as chat requests; a
    field the translation renamed (``stop`` for ``stop_sequences``) is named
    back, keeping any index or sub-field after it (``input[2].content``).
    """
    if err.param is not None:
        head = err.param.split("[")[0].split(".")[0]
        if head in names:
            err.param = names[head] + err.param[len(head) :]
    return err

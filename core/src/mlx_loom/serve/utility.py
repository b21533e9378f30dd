"""The utility endpoints: ``/tokenize``, ``/detokenize`` and Anthropic's ``count_tokens``.

Clients use them to measure a prompt before sending it, so each answers
exactly what the generating endpoint would feed the model: a ``prompt`` is
tokenized as ``/v1/completions`` tokenizes it, a ``messages`` list through
the same preparation as ``/v1/chat/completions`` (chat template, tools,
generation prompt), and a ``count_tokens`` body through the same
translation and preparation as ``/v1/messages``. Nothing is queued: the
prepared request is only read for its prompt ids.

The shapes are vLLM's (``prompt`` or ``messages`` in; ``tokens``, ``count``,
``max_model_len`` out; ``tokens`` in, ``prompt`` out), with llama.cpp's
names accepted as well (``content`` in and out). The same bounds as the
completions apply: the body size, ``--max-prompt-chars`` and
``--max-prompt-tokens``; a detokenized list holds at most as many ids as a
prompt may.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..engine.request import encode_prompt
from ..errors import LoomError
from . import anthropic, schemas
from .app import DEFAULT_MAX_PROMPT_TOKENS, ServeApp
from .errors import HttpError, from_loom_error
from .tools import plan_tools

#: A generation length that lets a counting request be prepared like a real
#: one; nothing is generated.
_COUNTING_MAX_TOKENS = 1


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TokenizeRequest(_Request):
    """``POST /tokenize``: exactly one of ``prompt``, ``content`` (llama.cpp) or ``messages``."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    content: StrictStr | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    #: vLLM's switch: a text prompt gets the tokenizer's BOS (as completions do) unless false.
    add_special_tokens: StrictBool = True
    #: vLLM's switch: a conversation ends with the assistant's turn opened (as chat does).
    add_generation_prompt: StrictBool = True
    #: vLLM's switch: also answer each token's text (``token_strs``).
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Request):
    """``POST /detokenize``: token ids in, their text out."""

    model: StrictStr | None = None
    tokens: list[StrictInt] = Field(min_length=0)


def tokenize(app: ServeApp, body: Any) -> dict[str, Any]:
    """The answer to ``POST /tokenize``."""
    request = schemas.parse_request(TokenizeRequest, body)
    app._check_model(request.model)
    given = [n for n in ("prompt", "content", "messages") if getattr(request, n) is not None]
    if len(given) != 1:
        raise HttpError(
            400,
            "Send exactly one of prompt, content or messages"
            + (f" (this request sends {', '.join(given)})." if given else " (it sends none)."),
            fix='send {"prompt": "text"} or {"messages": [{"role": "user", "content": "..."}]}',
            param=given[1] if len(given) > 1 else "prompt",
            code="invalid_parameter",
        )
    chat_only = [n for n in ("tools", "tool_choice", "chat_template_kwargs") if n in body]
    if given[0] != "messages" and chat_only:
        raise HttpError(
            400,
            f"{chat_only[0]} applies to messages only, not to a text {given[0]}.",
            fix=f"drop {chat_only[0]}, or send messages",
            param=chat_only[0],
            code="invalid_parameter",
        )
    if request.messages is not None:
        ids = _chat_ids(app, body, request)
    else:
        ids = _text_ids(app, request.prompt or request.content or "", given[0], request)
    answer: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": _max_model_len(app),
        "tokens": ids,
    }
    if request.return_token_strs:
        tokenizer = app.tokenizer
        answer["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
    return answer


def detokenize(app: ServeApp, body: Any) -> dict[str, Any]:
    """``POST /detokenize``: the text, as ``prompt`` (vLLM) and as ``content`` (llama.cpp)."""
    request = schemas.parse_request(DetokenizeRequest, body)
    app._check_model(request.model)
    bound = _max_model_len(app)
    if len(request.tokens) > bound:
        raise HttpError(
            400,
            f"tokens holds {len(request.tokens)} ids; at most {bound} (a prompt's bound) "
            "are decoded at once.",
            fix="decode the ids in shorter pieces",
            param="tokens",
            code="too_many_tokens",
        )
    vocab = app.tokenizer.vocab_size
    for i, token in enumerate(request.tokens):
        if not 0 <= token < vocab:
            raise HttpError(
                400,
                f"tokens[{i}] = {token} is not a token id of this model (0 to {vocab - 1}).",
                fix="send ids that this model's tokenizer produced",
                param=f"tokens[{i}]",
                code="invalid_token",
            )
    text = app.tokenizer.decode(request.tokens)
    return {"prompt": text, "content": text}


def count_tokens(app: ServeApp, body: Any) -> dict[str, Any]:
    """``POST /v1/messages/count_tokens``: the prompt tokens ``/v1/messages`` would feed the model.

    The body is a Messages request without ``max_tokens``; it is translated
    and prepared exactly as ``/v1/messages`` would (so tools, the system
    prompt and the thinking switch count as they would render).
    """
    if isinstance(body, dict):
        body = {**body, "max_tokens": _COUNTING_MAX_TOKENS, "stream": False}
    chat_body = anthropic.to_chat_body(body)
    try:
        prep = app.prepare(chat_body, chat=True)
    except HttpError as err:
        raise anthropic.renamed(err) from None
    return {"input_tokens": len(prep.choices[0].job.prompt)}


def _max_model_len(app: ServeApp) -> int:
    """The most prompt tokens this server accepts: the context, or the tighter server bound."""
    context = app.model.context_length or DEFAULT_MAX_PROMPT_TOKENS
    return min(context, app.max_prompt_tokens)


def _text_ids(app: ServeApp, text: str, param: str, request: TokenizeRequest) -> list[int]:
    """A text prompt's ids, as ``/v1/completions`` makes them (under its bounds)."""
    app._check_prompt_chars(text, param)
    try:
        if request.add_special_tokens:
            ids = encode_prompt(app.tokenizer, text)
        else:
            ids = app.tokenizer.encode(text, add_special_tokens=False)
    except LoomError as err:
        raise from_loom_error(err, param=param) from None
    app._check_prompt_tokens(ids, param)
    return ids


def _chat_ids(app: ServeApp, body: dict[str, Any], request: TokenizeRequest) -> list[int]:
    """A conversation's ids, as ``/v1/chat/completions`` would prepare them."""
    chat: dict[str, Any] = {"messages": request.messages, "max_tokens": _COUNTING_MAX_TOKENS}
    for name in ("model", "tools", "tool_choice", "chat_template_kwargs"):
        if name in body:
            chat[name] = body[name]
    if request.add_generation_prompt:
        prep = app.prepare(chat, chat=True)
        return list(prep.choices[0].job.prompt)
    return _closed_chat_ids(app, chat)


def _closed_chat_ids(app: ServeApp, chat: dict[str, Any]) -> list[int]:
    """A conversation rendered without the generation prompt (``add_generation_prompt: false``):
    the chat endpoints' own rendering, under the same bounds, with the turn left closed."""
    request = schemas.parse_request(schemas.ChatCompletionRequest, chat)
    ids, _ = app._chat_prompt(
        request, plan_tools(request, app.chat_format), generation_prompt=False
    )
    return ids

"""Chat templates: Jinja source shipped in an artifact, rendered in a sandbox.

A chat template is text from the model artifact, so it is untrusted: it is
rendered with jinja2's ``ImmutableSandboxedEnvironment`` and any attempt to
reach Python internals (``__class__``, ``__subclasses__`` ...) or to mutate the
caller's data is refused with :class:`~mlx_loom.errors.TokenizerError`.

Rendering follows what transformers does for the same template so that prompts
(and therefore token ids) match what the model was trained with:
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a no-op
``{% generation %}`` block, the ``raise_exception`` and ``strftime_now``
globals, a ``tojson`` filter that does not HTML-escape, the special-token
strings (``bos_token``, ``eos_token`` ...) as variables, messages whose
``None`` fields are dropped, reasoning aliased under
``reasoning_content``/``thinking``, and tool-call arguments sent as JSON
strings (as OpenAI clients send them) decoded to objects.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError

from mlx_loom.errors import TemplateBudgetExceeded, TokenizerError
from mlx_loom.text.template_budget import (
    BudgetedSandbox,
    TemplateBudget,
    check_source,
    compile_within,
    render_within,
)

NO_TEMPLATE_FIX = (
    "pass --no-chat-template to send the prompt as raw text, or add a chat_template.jinja "
    "(or a 'chat_template' entry in tokenizer_config.json) to the model directory"
)

# Names under which a message's reasoning arrives; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Appended to the final message to find where it ends in the rendered text
# when continuing a partial assistant reply (same technique as transformers).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _StrictSandbox(BudgetedSandbox):
    """Raise on the first unsafe attribute access instead of returning Undefined.

    The stock sandbox returns an ``Undefined`` that only raises when used, so
    ``{{ x.__class__ }}`` would silently render as empty. No legitimate chat
    template touches private attributes, so refusing at once loses nothing and
    makes a hostile template fail loudly.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


class _GenerationBlock(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` and render its body unchanged.

    Training templates mark assistant spans with it; inference only needs the text.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore-prefixed names (no dunder smuggling)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} is underscore-prefixed")


class _TemplateDict:
    """``dict(...)`` for templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes '<', '>', '&' and "'"; chat prompts must carry them verbatim.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    env.globals["dict"] = _TemplateDict()
    return env


def plain_data(value: Any) -> Any:
    """Rebuild caller data from plain JSON types before a template sees it.

    Objects with methods (pydantic models, numpy scalars, str subclasses) could
    offer a template more than data, so only dict/list/tuple/str/int/float/
    bool/None pass; models and dataclasses are dumped; anything else becomes an
    inert ``"<TypeName>"`` placeholder.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    if callable(getattr(value, "item", None)):  # numpy scalar
        return plain_data(value.item())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Plain-data messages with ``None`` fields dropped and reasoning aliased.

    Many templates render a present-but-``None`` ``content`` as the string
    "None" but handle a missing key; OpenAI-style clients send ``None``.
    """
    out: list[dict[str, Any]] = []
    for index, message in enumerate(plain_data(list(messages))):
        if not isinstance(message, dict):
            raise TokenizerError(
                f"chat message {index} is a {type(message).__name__}, not a mapping",
                fix="pass messages as dicts with 'role' and 'content' keys",
            )
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_decoded_arguments(c) for c in message["tool_calls"]]
        out.append(message)
    return out


def _decoded_arguments(call: Any) -> Any:
    """An OpenAI tool call whose ``function.arguments`` JSON string is decoded to an object.

    OpenAI clients send arguments as a JSON *string*; templates iterate them
    as a mapping (``tool_call.arguments | items``) or print them with
    ``tojson``, which would quote the string a second time. mlx-lm decodes
    them the same way. A string that is not a JSON object stays a string.
    """
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class ChatTemplate:
    """One compiled chat template and where it came from (for error messages)."""

    def __init__(self, source: str, *, origin: str) -> None:
        self.source = source
        self.origin = origin
        self._compiled: jinja2.Template | None = None

    def compile(self) -> jinja2.Template:
        """Compile on first use, so a broken template only fails a chat request.

        A user who runs with ``--no-chat-template`` can still load the model.
        """
        if self._compiled is None:
            check_source(self.source, self.origin)
            fix = f"fix the template in {self.origin}, or pass --no-chat-template"
            try:
                self._compiled = compile_within(_environment(), self.source, TemplateBudget())
            except TemplateSyntaxError as exc:
                raise TokenizerError(
                    f"chat template from {self.origin} does not compile: "
                    f"{exc.message} (line {exc.lineno})",
                    fix=fix,
                ) from exc
            except (RecursionError, SyntaxError, MemoryError) as exc:
                # Nesting too deep for jinja's parser or for Python's compiler.
                raise TokenizerError(
                    f"chat template from {self.origin} does not compile: "
                    f"{type(exc).__name__}: {exc}",
                    fix=fix,
                ) from None
        return self._compiled

    def render(
        self,
        messages: Sequence[Any],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Any] | None = None,
        documents: Sequence[Any] | None = None,
        continue_final_message: bool = False,
        special_tokens: Mapping[str, str] | None = None,
        budget: TemplateBudget | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages``; template failures become :class:`TokenizerError`.

        ``special_tokens`` (``bos_token`` ...) are visible to the template and
        are overridden by ``template_kwargs`` of the same name, as in transformers.
        The render runs under ``budget`` (default: :meth:`TemplateBudget.from_env`);
        running out raises :class:`~mlx_loom.errors.TemplateBudgetExceeded`.
        """
        chat = normalize_messages(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise TokenizerError(
                    "continue_final_message and add_generation_prompt were both requested",
                    fix="continue a partial assistant reply with add_generation_prompt=False",
                )
            if not chat or not isinstance(chat[-1].get("content"), str):
                raise TokenizerError(
                    "continue_final_message needs a final message with string content",
                    fix="end the conversation with the partial assistant message to continue",
                )
            final = chat[-1]["content"]
            chat[-1]["content"] = final + _CONTINUE_TAG
        template = self.compile()
        variables = {**(special_tokens or {}), **plain_data(template_kwargs)}
        try:
            text = render_within(
                template,
                budget or TemplateBudget.from_env(),
                dict(
                    messages=chat,
                    tools=plain_data(list(tools)) if tools is not None else None,
                    documents=plain_data(list(documents)) if documents is not None else None,
                    add_generation_prompt=add_generation_prompt,
                    **variables,
                ),
            )
        except TemplateBudgetExceeded as exc:
            raise TemplateBudgetExceeded(
                f"{exc.message} (template from {self.origin})", fix=exc.fix
            ) from None
        except RecursionError as exc:  # a macro calling itself without end
            raise TokenizerError(
                f"chat template from {self.origin} recursed too deeply: {_clip(exc)}",
                fix=f"fix the template in {self.origin}, or pass --no-chat-template",
            ) from None
        except SecurityError as exc:
            raise TokenizerError(
                f"chat template from {self.origin} was refused by the sandbox: {_clip(exc)}",
                fix=f"replace the template in {self.origin} with one that only reads its "
                "variables, or pass --no-chat-template",
            ) from exc
        except TemplateError as exc:
            raise TokenizerError(
                f"chat template from {self.origin} raised: {_clip(exc)}",
                fix="check the messages against what the template accepts (roles, order, "
                f"tools), fix the template in {self.origin}, or pass --no-chat-template",
            ) from exc
        except Exception as exc:  # a template calling e.g. .strip() on a list
            raise TokenizerError(
                f"chat template from {self.origin} failed: {type(exc).__name__}: {_clip(exc)}",
                fix=f"check the message fields the template reads, fix {self.origin}, "
                "or pass --no-chat-template",
            ) from exc
        if continue_final_message:
            text = _cut_at_continue_tag(text, final, self.origin)
        return text


def _clip(exc: BaseException, limit: int = 500) -> str:
    """An exception's text for an error message, at most ``limit`` characters.

    A template decides what it raises (``raise_exception(big_string)``, a
    missing key of a megabyte): the message must stay readable and small.
    """
    text = str(exc)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def _cut_at_continue_tag(text: str, final: str, origin: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise TokenizerError(
            f"chat template from {origin} dropped the final message, so it cannot be continued",
            fix="continue only messages the template renders verbatim",
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    # The template trimmed trailing whitespace off the message; do the same.
    return text[:at].rstrip()

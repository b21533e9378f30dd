"""The wire format: OpenAI-shaped request and response bodies as pydantic models.

Requests are parsed strictly: an unknown field, a string where a number
belongs, or a boolean where a count belongs is a 400 naming the field (and,
for a misspelt name, the field we think was meant), never silently ignored.
The sampling fields (``temperature``, ``top_p`` ...) are accepted here as
raw JSON values on purpose: :class:`~mlx_loom.engine.params.SamplingParams` is the
one place they are checked, so the server answers with exactly the messages
the Python API raises.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from .errors import HttpError

#: Request fields handed to ``SamplingParams.parse`` unchanged (besides
#: ``logit_bias``, whose JSON string keys become ints, and ``logprobs``).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens_to_keep",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "penalty_context_size",
    "xtc_probability",
    "xtc_threshold",
)

# Names other servers use for our fields: an unknown field that is one of
# these is answered with the name we use.
_ALIASES = {
    "temp": "temperature",
    "max_new_tokens": "max_tokens",
    "max_length": "max_tokens",
    "random_seed": "seed",
    "stop_sequences": "stop",
    "repetition_context_size": "penalty_context_size",
    "presence_context_size": "penalty_context_size",
    "frequency_context_size": "penalty_context_size",
}

# What each structural field accepts, and what to send instead. Sampling
# fields are not here: SamplingParams words their messages.
_EXPECTED: dict[str, tuple[str, str]] = {
    "model": ("a string (the id from GET /v1/models)", "omit model, or pass the served id"),
    "prompt": (
        "a non-empty string, or a non-empty list of token ids",
        'pass prompt as text ("Once upon a time") or as token ids ([1, 2, 3])',
    ),
    "messages": (
        'a non-empty list of {"role": str, "content": str | [text parts]} objects',
        'pass messages like [{"role": "user", "content": "Hello"}]',
    ),
    "max_tokens": ("an integer >= 1", "pass a positive integer such as 64"),
    "max_completion_tokens": ("an integer >= 1", "pass a positive integer such as 64"),
    "stop": ("a string or a list of strings", 'pass stop as "\\n" or ["\\n", "User:"]'),
    "stream": ("true or false", "pass stream as a JSON boolean"),
    "stream_options": (
        'an object {"include_usage": true|false}',
        'pass stream_options as {"include_usage": true}',
    ),
    "logit_bias": (
        'an object mapping token ids (as strings) to numbers, e.g. {"50": -100}',
        'pass logit_bias as {"<token id>": <bias>}',
    ),
    "logprobs": (
        "for /v1/completions an integer in [0, 20]; for /v1/chat/completions true or false",
        "pass logprobs as documented for the endpoint",
    ),
    "top_logprobs": ("an integer in [0, 20]", "pass top_logprobs as an integer such as 5"),
    "n": ("an integer >= 1 (the number of choices)", "omit n, or pass a small count such as 2"),
    "user": ("a string", "omit user, or pass a string"),
    "store": ("true or false (accepted and ignored)", "omit store, or pass a JSON boolean"),
    "metadata": (
        "an object (accepted and ignored)",
        'omit metadata, or pass an object like {"run": "7"}',
    ),
    "service_tier": ("a string (accepted and ignored)", "omit service_tier"),
    "prompt_cache_key": ("a string (accepted and ignored)", "omit prompt_cache_key"),
    "safety_identifier": ("a string (accepted and ignored)", "omit safety_identifier"),
    "modalities": (
        '["text"]: this server writes text only',
        'omit modalities, or pass ["text"]',
    ),
    "reasoning_effort": (
        '"none", "minimal", "low", "medium", "high" or "xhigh"',
        'pass reasoning_effort as "none" (thinking off) or "medium" (thinking on)',
    ),
    "chat_template_kwargs": (
        "an object of chat-template variables",
        'pass chat_template_kwargs like {"enable_thinking": false}',
    ),
    "tools": (
        'a list of {"type": "function", "function": {"name": str, "description": str, '
        '"parameters": {JSON schema}}}',
        'pass tools like [{"type": "function", "function": {"name": "get_weather", '
        '"parameters": {"type": "object", "properties": {}}}}]',
    ),
    "tool_choice": (
        '"auto", "none", "required" or {"type": "function", "function": {"name": str}}',
        'pass tool_choice as "auto", "none", "required" or a named function',
    ),
    "parallel_tool_calls": ("true or false", "pass parallel_tool_calls as a JSON boolean"),
    "response_format": (
        '{"type": "json_schema", "json_schema": {"name": str, "schema": {...}, "strict": bool}}, '
        '{"type": "json_object"} or {"type": "text"}',
        'pass response_format like {"type": "json_object"}',
    ),
    "structured_outputs": (
        'an object with exactly one of "json" (a JSON schema), "json_object": true, "regex", '
        '"choice" (a list of strings) or "grammar" (Lark or GBNF text)',
        'pass structured_outputs like {"choice": ["yes", "no"]}',
    ),
    "json_schema": ("a JSON schema (an object)", 'pass json_schema like {"type": "object"}'),
    "grammar": ("a grammar as text (GBNF or Lark)", 'pass grammar like "root ::= \"yes\""'),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class ResponseFormat(BaseModel):
    """``response_format``; its other keys (``json_schema``) are read by the app."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["text", "json_object", "json_schema"]


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these is set."""

    json_: dict[str, Any] | StrictStr | StrictBool | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None


class _GenerationRequest(_Strict):
    """Fields both completion endpoints accept."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    # Accepted and ignored (mlx_loom.serve.routine.OPENAI_IGNORED).
    user: StrictStr | None = None
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    modalities: list[Literal["text"]] | None = None
    #: A registered adapter's name (``loom serve --adapter NAME=PATH``); mlx-lm's
    #: ``adapters`` may also name one, by name or by the path it was registered from.
    adapter: StrictStr | None = None
    adapters: StrictStr | None = None
    logit_bias: dict[str, Any] | None = None
    # Sampling: raw values, checked by SamplingParams.parse.
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    min_p: Any = None
    min_tokens_to_keep: Any = None
    seed: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    penalty_context_size: Any = None
    xtc_probability: Any = None
    xtc_threshold: Any = None
    # Speculative decoding (an extension): "ngram", "mtp" (the model's own
    # head), "model" (the server's --draft-model) or "none"; absent: the
    # server's default.
    draft: StrictStr | None = None
    num_draft_tokens: StrictInt | None = None
    # Structured output (mlx_loom.serve.structured reads them): OpenAI's,
    # vLLM's and llama.cpp's fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    json_schema: dict[str, Any] | StrictBool | None = None
    grammar: StrictStr | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: a raw prompt, no chat template."""

    prompt: StrictStr | list[StrictInt]
    #: The legacy completions API's count of top alternatives per token.
    logprobs: StrictInt | None = None


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text"}`` parts can be served."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    """A chat message. Extra keys (``name``, ``tool_calls`` ...) reach the template as given."""

    model_config = ConfigDict(extra="allow", frozen=True)

    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None


class FunctionDefinition(BaseModel):
    """A function a tool offers. Keys beyond these reach the chat template as given."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    """One entry of ``tools``; only function tools exist in the chat completions API."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    #: Mapped onto the template's thinking switch (mlx_loom.serve.routine).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


def _all_fields(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


#: Unknown names longer than this get no suggestion: a field name is short,
#: and the edit distance below costs the product of the two lengths.
_MAX_SUGGESTED_NAME = 64


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions), row by row."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def nearest_field(name: str, known: list[str]) -> str | None:
    """The field an unknown ``name`` was probably meant to be, or ``None``.

    A known alias (another server's name for one of ours) first; else the
    field within a typo's reach: at most one edit per four characters of
    the field (``temprature``, ``max-tokens``, ``response_fromat``), none for
    names under three characters. A name that merely shares letters with a
    field (``reasoning_effort`` and ``response_format``) is no typo of it.
    """
    alias = _ALIASES.get(name) or _ALIASES.get(name.lower())
    if alias is not None and alias in known:
        return alias
    if len(name) > _MAX_SUGGESTED_NAME:
        return None
    plain = name.lower().replace("-", "_")
    best: tuple[int, str] | None = None
    for field in known:
        limit = len(field) // 4 if len(field) >= 3 else 0
        distance = _edit_distance(plain, field)
        if distance <= limit and (best is None or distance < best[0]):
            best = (distance, field)
    return best[1] if best is not None else None


def _unknown_field(name: str, known: list[str]) -> HttpError:
    suggestion = nearest_field(name, known)
    if suggestion is not None:
        return HttpError(
            400,
            f"Unknown parameter {name!r}; did you mean {suggestion!r}?",
            fix=f"rename {name!r} to {suggestion!r}",
            param=name,
            code="unknown_parameter",
        )
    return HttpError(
        400,
        f"Unknown parameter {name!r}. This endpoint accepts: {', '.join(sorted(known))}.",
        fix=f"remove {name!r} from the request",
        param=name,
        code="unknown_parameter",
    )


# Keys of nested request objects that belong in an error's ``param`` path.
_PATH_KEYS = frozenset(
    {"role", "content", "type", "text", "include_usage", "function", "name", "parameters"}
)


def _param_path(loc: tuple[Any, ...], fields: list[str]) -> str:
    """``("messages", 0, "role")`` -> ``"messages[0].role"``; union-member tags are dropped."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif i == 0:
            out = str(part)
        elif part in _PATH_KEYS:
            out += f".{part}"
        # Other string parts are pydantic's union-member labels (``str``,
        # ``list[int]``): not field names, so not part of the path.
    return out or (fields[0] if fields else "body")


def _to_http_error(exc: ValidationError, model: type[BaseModel]) -> HttpError:
    fields = _all_fields(model)
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    if first["type"] == "extra_forbidden" and len(loc) == 1:
        return _unknown_field(str(loc[0]), fields)
    field = str(loc[0]) if loc else "body"
    param = _param_path(loc, fields)
    valid, fix = _EXPECTED.get(field, ("a valid value", f"correct {field!r}"))
    if first["type"] == "extra_forbidden":
        return HttpError(
            400,
            f"Unknown field {str(loc[-1])!r} in {param}: expected {valid}.",
            fix=fix,
            param=param,
            code="unknown_parameter",
        )
    if first["type"] == "missing" and len(loc) == 1:
        return HttpError(
            400,
            f"Missing required parameter {field!r}: expected {valid}.",
            fix=fix,
            param=field,
            code="missing_parameter",
        )
    found = first.get("input")
    shown = repr(found)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    reason = first["msg"].removeprefix("Value error, ")
    return HttpError(
        400,
        f"Invalid parameter {param}={shown}: {reason}. Valid: {valid}.",
        fix=fix,
        param=param,
        code="invalid_parameter",
    )


def parse_request(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body against ``model``; every failure is a 400 :class:`HttpError`."""
    if not isinstance(body, dict):
        raise HttpError(
            400,
            f"The request body is a JSON {type(body).__name__}; it must be a JSON object.",
            fix='send an object such as {"prompt": "Hello", "max_tokens": 16}',
            code="invalid_body",
        )
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _to_http_error(exc, model) from None


# --- responses ----------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    #: ``{"cached_tokens": n}``: prompt tokens served from the prompt cache.
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


FinishReason = Literal["stop", "length", "tool_calls"]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class FunctionCall(BaseModel):
    name: str
    #: The arguments as a JSON-encoded object, as the OpenAI API sends them.
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    """The answer. ``content`` is ``None`` when the model only called tools;
    ``reasoning_content`` and ``tool_calls`` are present only when there are some."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    def wire(self) -> dict[str, Any]:
        data = self.model_dump(exclude_none=True)
        data["content"] = self.content
        return data


class ChatChoice(BaseModel):
    index: int = 0
    #: :meth:`ChatMessageOut.wire`: keys that have no value are left out.
    message: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    #: ``{"role": "assistant", "content": ""}`` first, then ``{"content": ...}``,
    #: ``{"reasoning_content": ...}`` or ``{"tool_calls": [...]}``; ``{}`` last.
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class _Envelope(BaseModel):
    id: str
    created: int
    model: str


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlx-loom"
    #: The sampling values (and ``max_tokens``) a request that omits them gets:
    #: the checkpoint's ``generation_config.json`` under the server's flags.
    defaults: dict[str, Any] = Field(default_factory=dict)
    #: Whether the model is resident now (a server of several loads each on first use).
    loaded: bool = True


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

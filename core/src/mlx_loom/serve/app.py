"""Request handling without HTTP: validate a body into a job, shape results as OpenAI JSON.

:class:`ServeApp` is what the HTTP handler calls. Validation runs in the
handler's thread, before the job is queued, so a bad request is answered at
once (never after waiting for another client's generation) and every
failure carries the request field at fault in ``param``.

What a request asks of the model — its prompt ids, sampling values, stop
strings, speculation — is checked by the engine's one validator,
:func:`~mlx_loom.engine.make_request`, whose errors name the field; this
module checks only what the wire format adds (the JSON schema, the
server's own limits, chat templates, which model or adapter is named) and
maps the engine's errors to HTTP answers.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from ..engine import EngineSettings, Speculation
from ..engine.defaults import check_defaults, generation_defaults
from ..engine.params import SamplingParams
from ..engine.request import encode_prompt, kv_quantization, make_request
from ..errors import CapabilityRefused, LoomError, RequestError, TemplateBudgetExceeded
from ..generation.stream import DEFAULT_MAX_TOKENS
from ..host import GENERATE, Registry
from ..model import Model
from ..text import TemplateBudget, Tokenizer
from ..text.output_parser import Content, OutputParser, Reasoning, ToolCallFound
from ..text.tool_calls import ToolCall
from . import schemas, wire
from .adapters import ServedAdapters
from .errors import NOT_FOUND, HttpError, from_loom_error
from .prefill import continues_final_message
from .routine import OPENAI_IGNORED, log_ignored, thinking_kwargs
from .structured import request_constraint
from .tools import ChatFormat, ToolPlan, output_parser, plan_tools, prompt_suffix
from .worker import GenerationWorker, Job, Piece

#: The largest ``max_tokens`` a request may ask for unless the server is started
#: with another ``--max-tokens-limit``.
DEFAULT_MAX_TOKENS_LIMIT = 4096

#: Requests that may wait for a free row before the server answers 503.
DEFAULT_MAX_QUEUED = 64

#: The most choices (``n``) one request may ask for: each is a full generation.
MAX_CHOICES = 16

#: The longest prompt text (a raw prompt, or a rendered chat) the server
#: tokenizes unless told otherwise: about 260k tokens of English, the longest
#: context of the supported families. What it costs (tokenizers 0.23, this
#: machine): ordinary text ~0.3 GB and ~1.5 s; the worst case, text outside
#: the vocabulary (4 byte-tokens per character: 4 M tokens), ~0.9 GB and ~7 s.
#: Twice this was 1.7 GB and 14 s in that worst case.
DEFAULT_MAX_PROMPT_CHARS = 1024 * 1024

#: The most token entries one answer may ask for: ``max_tokens`` × ``n`` ×
#: (1 + top log-probabilities per token). An answer is built in memory (a
#: whole one before it is sent, a stream's pieces as they come), ~110 bytes of
#: JSON an entry with log-probabilities: a 110-byte request (``n: 16``,
#: ``logprobs: 20``, 1,000 tokens) answered 38 MB and grew the server by
#: ~375 MB. 131,072 entries keep an answer near 15 MB, and still admit the
#: largest ``max_tokens`` with ``n: 16`` and no log-probabilities, or with 20
#: log-probabilities and ``n: 1``.
DEFAULT_MAX_RESPONSE_ENTRIES = 131072

#: The token bound for a model whose config states no context length.
DEFAULT_MAX_PROMPT_TOKENS = 131072

#: A ``logit_bias`` key: a token id in decimal, as OpenAI sends them. (``int()``
#: alone would also take ``" 1 "``, ``"1_0"`` and non-ASCII digits.)
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,20}")

#: ``chat_template_kwargs`` keys the server sets itself.
_RESERVED_TEMPLATE_KEYS = frozenset(
    {
        "messages",
        "tools",
        "system",
        "template_name",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "special_tokens",
        # the tokenizer's and the renderer's own arguments: a client setting one
        # would collide with the server's (a 500) or override its template budget
        "template_budget",
        "budget",
        "tokenize",
        "self",
    }
)


@dataclass
class Choice:
    """One of a request's ``n`` answers: its job, and what has been read of it so far."""

    index: int
    job: Job
    #: Splits chat output into content, reasoning and tool calls (``None`` for completions).
    parser: OutputParser | None = None
    pieces: list[Piece] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[schemas.ToolCallOut] = field(default_factory=list)
    finish_reason: schemas.FinishReason | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Prepared:
    """A validated request: the jobs to run plus how to shape their answer."""

    chat: bool
    id: str
    created: int
    model: str
    choices: list[Choice]
    stream: bool = False
    include_usage: bool = False
    #: Report per-token log-probabilities (chat ``logprobs: true``, or
    #: completions ``logprobs`` given as a count).
    report_logprobs: bool = False
    top_logprobs: int = 0
    #: ``parallel_tool_calls``: ``False`` ends each answer after its first call.
    parallel_tool_calls: bool = True

    @property
    def jobs(self) -> list[Job]:
        return [c.job for c in self.choices]


class ServeApp:
    """One loaded model served over the OpenAI API; owns the generation worker.

    ``model_id`` is the id clients see in ``GET /v1/models`` and may send as
    ``model``; a request naming any other model is refused (404), never
    silently answered by this one. Adapters registered on the model
    (``model.adapter_set``, what ``loom serve --adapter`` builds) are served
    too, each as ``<model_id>:<name>`` (:mod:`mlx_loom.serve.adapters`).

    Server-wide options, each validated here (a bad one fails start-up, not
    the first request): ``engine`` sets how the model's engine batches
    (concurrency, prefill chunking, the prefix store, the queue bound);
    ``tool_call_parser`` names the tool-call format,
    overriding what the model declares (``registry`` — by default the
    default host's — holds the registered parsers and the model type's
    default format);
    ``chat_template_args`` are template variables under each request's
    ``chat_template_kwargs``; ``kv_bits``/``kv_group_size``/
    ``quantized_kv_start``/``kv_codec`` store every request's KV cache in a
    codec (affine unless ``kv_codec`` names another; ``kv_group_size=None``
    picks one that fits the model's heads, checked here, at start);
    ``max_prompt_chars`` bounds the text that reaches the tokenizer and
    ``max_prompt_tokens`` (default: the model's context) the tokens that
    reach the engine.

    Sampling defaults: a request that leaves out ``temperature``, ``top_p``,
    ``top_k``, ``min_p`` or ``repetition_penalty`` gets the model's
    ``generation_config.json`` value (as vLLM applies it), overridden by
    ``sampling_defaults`` (``loom serve --temp --top-p --top-k --min-p``;
    checked here, a bad one fails start-up); ``default_max_tokens``
    (``--max-tokens``) is the ``max_tokens`` of a request that gives none.
    ``generation_config=False`` leaves the checkpoint's values out.
    """

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        *,
        model_id: str | None = None,
        max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
        engine: EngineSettings | None = None,
        template_budget: TemplateBudget | None = None,
        tool_call_parser: str | None = None,
        registry: Registry | None = None,
        chat_template_args: Mapping[str, Any] | None = None,
        kv_bits: int | None = None,
        kv_group_size: int | None = None,
        quantized_kv_start: int = 0,
        kv_codec: str | None = None,
        max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
        max_prompt_tokens: int | None = None,
        speculation: Speculation | None = None,
        max_response_entries: int = DEFAULT_MAX_RESPONSE_ENTRIES,
        sampling_defaults: Mapping[str, Any] | None = None,
        default_max_tokens: int | None = None,
        generation_config: bool = True,
    ) -> None:
        _check_count("max_tokens_limit", max_tokens_limit, "--max-tokens-limit", 4096)
        _check_count(
            "max_response_entries",
            max_response_entries,
            "--max-response-entries",
            DEFAULT_MAX_RESPONSE_ENTRIES,
        )
        #: Token entries one answer may ask for (see DEFAULT_MAX_RESPONSE_ENTRIES).
        self.max_response_entries = max_response_entries
        _check_count(
            "max_prompt_chars", max_prompt_chars, "--max-prompt-chars", DEFAULT_MAX_PROMPT_CHARS
        )
        if max_prompt_tokens is not None:
            _check_count("max_prompt_tokens", max_prompt_tokens, "--max-prompt-tokens", 8192)
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id or model.model_dir.name
        self.max_tokens_limit = max_tokens_limit
        #: Characters of prompt text (raw, or the rendered chat) tokenized at most.
        self.max_prompt_chars = max_prompt_chars
        #: Prompt tokens accepted at most: by default the model's context.
        self.max_prompt_tokens = (
            max_prompt_tokens or model.context_length or (DEFAULT_MAX_PROMPT_TOKENS)
        )
        self.template_budget = template_budget or TemplateBudget.from_env()
        self.default_max_tokens = min(DEFAULT_MAX_TOKENS, max_tokens_limit)
        if default_max_tokens is not None:
            _check_count("default_max_tokens", default_max_tokens, "--max-tokens", 256)
            if default_max_tokens > max_tokens_limit:
                raise RequestError(
                    f"A default max_tokens of {default_max_tokens} is past the largest a "
                    f"request may ask for, {max_tokens_limit}.",
                    fix="lower --max-tokens, or raise --max-tokens-limit",
                    param="max_tokens",
                )
            self.default_max_tokens = default_max_tokens
        #: Sampling values a request that omits the field gets (engine/defaults.py).
        self.sampling_defaults: dict[str, Any] = {
            **(generation_defaults(model.model_dir) if generation_config else {}),
            **check_defaults(sampling_defaults or {}, source="server sampling defaults"),
        }
        self.created = int(time.time())
        self.chat_template_args = _template_args(chat_template_args)
        # Checked now, so a bad --kv-* flag fails start-up, not the first request.
        checked = kv_quantization(
            model,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            quantized_kv_start=quantized_kv_start,
            kv_codec=kv_codec,
        )
        self.kv: dict[str, Any] = {
            "kv_bits": kv_bits,
            "kv_group_size": checked.group_size,  # the one the default rule picked, if none
            "quantized_kv_start": quantized_kv_start,
            "kv_codec": kv_codec,
        }
        self.chat_format = ChatFormat.for_model(
            model, tokenizer, registry=registry, override=tool_call_parser
        )
        self.adapters = (
            ServedAdapters(model.adapter_set, self.model_id)
            if model.adapter_set is not None
            else None
        )
        why = model.mtp_refusal() if speculation is not None and speculation.mtp else None
        if why is not None:  # refused at start, not on every request
            raise CapabilityRefused(
                f"--draft mtp drafts with the model's multi-token-prediction head, but {why}.",
                fix="Serve a checkpoint that ships its mtp.* weights, or use --draft ngram or "
                "--draft-model.",
            )
        self.worker = GenerationWorker(model, tokenizer, engine or server_engine_settings())
        #: Every request's speculation unless it asks otherwise (``draft`` field).
        self.speculation = speculation

    def close(self) -> None:
        self.worker.close()

    # --- residency (what a model pool asks of a served model) ---------------------------

    def busy(self) -> bool:
        """Rows running or waiting in this model's engine."""
        stats = self.worker.stats()
        return stats.engine.active > 0 or stats.queued > 0

    def kv_bytes(self) -> int:
        """Bytes of KV caches this model's engine keeps (its prefix store)."""
        return self.worker.stats().engine.prefix_bytes

    # --- GET endpoints --------------------------------------------------------

    def _accepted_ids(self) -> set[str]:
        directory = self.model.model_dir
        return {self.model_id, str(directory), str(directory.resolve()), directory.name}

    @property
    def model_ids(self) -> list[str]:
        """The base model's id, then ``<model>:<name>`` for each served adapter."""
        return self.adapters.ids if self.adapters is not None else [self.model_id]

    def models(self) -> dict[str, Any]:
        cards = [self._card(i) for i in self.model_ids]
        return schemas.ModelList(data=cards).model_dump()

    def model_card(self, model_id: str) -> dict[str, Any]:
        adapter = self._check_model(model_id, param=None)
        return self._card(self._served_id(adapter)).model_dump()

    def _card(self, served_id: str) -> schemas.ModelCard:
        defaults = {**self.sampling_defaults, "max_tokens": self.default_max_tokens}
        return schemas.ModelCard(id=served_id, created=self.created, defaults=defaults)

    def _served_id(self, adapter: str | None) -> str:
        return self.model_id if adapter is None else f"{self.model_id}:{adapter}"

    def health(self) -> tuple[int, dict[str, Any]]:
        """``(status, body)``: 503 once the engine has been shut down.

        ``queued`` counts requests waiting for a free row, ``active_rows`` the
        requests being prefilled or decoded; ``kv_bytes`` the KV bytes they
        reserve and the budget (``--max-kv-bytes``; ``max`` null: none).
        """
        worker = self.worker
        ok = worker.alive
        stats = worker.stats()
        engine = stats.engine
        settings = worker.service.settings
        fmt = self.chat_format
        return (200 if ok else 503), {
            "status": "ok" if ok else "unavailable",
            "model": self.model_id,
            "busy": engine.active > 0,
            "queued": stats.queued,
            "active_rows": engine.active,
            "prefilling": engine.prefilling,
            "decoding": engine.decoding,
            "decode_concurrency": settings.decode_concurrency,
            "max_queued": settings.max_queued,
            "kv_bytes": {"reserved": engine.kv_bytes_reserved, "max": settings.max_kv_bytes},
            "prompt_cache": {
                "entries": engine.prefix_entries,
                "bytes": engine.prefix_bytes,
                "hits": engine.prefix_hits,
                "misses": engine.prefix_misses,
                "checkpoints": engine.prefix_checkpoints,
                "checkpoint_bytes": engine.prefix_checkpoint_bytes,
                "disk_bytes": engine.prefix_disk_bytes,
                "disk_files": engine.prefix_disk_files,
                "disk_hits": engine.prefix_disk_hits,
            },
            "tool_call_parser": fmt.tool_parser.name if fmt.tool_parser else None,
            "reasoning": fmt.reasoning.name if fmt.reasoning else None,
        }

    # --- validation -------------------------------------------------------------

    def _check_model(self, name: str | None, *, param: str | None = "model") -> str | None:
        """Refuse a model id not served here; return the adapter it names (``<model>:<name>``)."""
        if name is None or name in self._accepted_ids():
            return None
        if self.adapters is not None:
            base, adapter = self.adapters.split(name, self._accepted_ids())
            if adapter is not None:
                return adapter
            name = base
        served = ", ".join(repr(i) for i in self.model_ids)
        raise HttpError(
            404,
            f"The model {name!r} is not served here; this server serves {served}.",
            fix=f"omit model, or pass model={self.model_id!r} (see GET /v1/models)",
            type=NOT_FOUND if param is None else "invalid_request_error",
            param=param,
            code="model_not_found",
        )

    def _pick_adapter(
        self, request: schemas._GenerationRequest, from_model: str | None
    ) -> str | None:
        """The registered adapter a request runs with (``None``: the base model)."""
        if self.adapters is None:
            asked = next(
                (f for f in ("adapter", "adapters") if getattr(request, f) is not None), None
            )
            if asked is not None:
                raise HttpError(
                    400,
                    f"The request names an adapter ({asked}={getattr(request, asked)!r}), "
                    "but this server serves none.",
                    fix="start the server with --adapter NAME=PATH, or drop the field",
                    param=asked,
                    code="invalid_parameter",
                )
            return None
        return self.adapters.pick(from_model, request.adapter, request.adapters)

    def _max_tokens(self, request: schemas._GenerationRequest) -> int:
        both = (request.max_tokens, request.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            raise HttpError(
                400,
                f"max_tokens={both[0]} and max_completion_tokens={both[1]} disagree.",
                fix="pass only one of max_tokens and max_completion_tokens",
                param="max_completion_tokens",
                code="invalid_parameter",
            )
        name = "max_completion_tokens" if both[1] is not None else "max_tokens"
        value = both[1] if both[1] is not None else both[0]
        if value is None:
            return self.default_max_tokens
        if not 1 <= value <= self.max_tokens_limit:
            raise HttpError(
                400,
                f"Invalid parameter {name}={value}: it must be an integer in "
                f"[1, {self.max_tokens_limit}] (this server's --max-tokens-limit).",
                fix=f"pass {name} between 1 and {self.max_tokens_limit}",
                param=name,
                code="invalid_parameter",
            )
        return value

    def _logit_bias(self, raw: dict[str, Any] | None) -> dict[int, Any] | None:
        if raw is None:
            return None
        out: dict[int, Any] = {}
        for key, bias in raw.items():
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise HttpError(
                    400,
                    f"Invalid parameter logit_bias: key {key[:40]!r} is not a token id.",
                    fix='use token ids in decimal as keys, e.g. {"50": -100}',
                    param="logit_bias",
                    code="invalid_parameter",
                )
            out[int(key)] = bias
        return out

    def _check_prompt_tokens(self, ids: Sequence[int], param: str) -> None:
        """The server's own bound on prompt tokens (``--max-prompt-tokens``).

        The context's bound is the engine's (``make_request``); the tighter of
        the two speaks.
        """
        limit = self.model.context_length
        bound = self.max_prompt_tokens
        if len(ids) > bound and (limit is None or bound < limit):
            raise HttpError(
                400,
                f"The {param} is {len(ids)} tokens long; this server accepts prompts of at "
                f"most {bound} tokens (--max-prompt-tokens).",
                fix="shorten the prompt, or start the server with a higher --max-prompt-tokens",
                param=param,
                code="prompt_too_long",
            )

    def _check_prompt_chars(self, text: str, param: str) -> None:
        """Refuse prompt text past ``max_prompt_chars`` before the tokenizer sees it."""
        if len(text) > self.max_prompt_chars:
            what = "rendered conversation" if param == "messages" else "prompt"
            raise HttpError(
                400,
                f"The {what} is {len(text)} characters long; this server tokenizes at most "
                f"{self.max_prompt_chars} characters (--max-prompt-chars).",
                fix="shorten the prompt, or start the server with a higher --max-prompt-chars",
                param=param,
                code="prompt_too_long",
            )

    def _text_prompt(self, request: schemas.CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, str):
            self._check_prompt_chars(prompt, "prompt")
        try:
            ids = encode_prompt(self.tokenizer, prompt)
        except LoomError as err:
            raise from_loom_error(err, param="prompt") from None
        self._check_prompt_tokens(ids, "prompt")
        return ids

    def _chat_prompt(
        self,
        request: schemas.ChatCompletionRequest,
        plan: ToolPlan,
        *,
        generation_prompt: bool = True,
    ) -> tuple[list[int], bool]:
        """The prompt ids, and whether the reply starts inside a thinking section.

        ``generation_prompt=False`` renders the conversation closed, as
        ``/tokenize`` may ask: no assistant turn opened, none continued.
        """
        if not self.tokenizer.has_chat_template:
            raise HttpError(
                400,
                f"The model {self.model_id!r} has no chat template, so /v1/chat/completions "
                "cannot format a conversation.",
                fix="use /v1/completions with a raw prompt, or add chat_template.jinja "
                "(or 'chat_template' in tokenizer_config.json) to the model directory",
                param="messages",
                code="no_chat_template",
            )
        messages = [_message_dict(i, m) for i, m in enumerate(request.messages)]
        asked = dict(request.chat_template_kwargs or {})
        reserved = _RESERVED_TEMPLATE_KEYS & asked.keys()
        if reserved:
            raise HttpError(
                400,
                f"chat_template_kwargs may not set {sorted(reserved)}.",
                fix="remove those keys from chat_template_kwargs",
                param="chat_template_kwargs",
                code="invalid_parameter",
            )
        # The server's template variables, then reasoning_effort's switch, then
        # the request's own chat_template_kwargs, each overriding the one before.
        kwargs = {**self.chat_template_args, **thinking_kwargs(request.reasoning_effort), **asked}
        prefill = generation_prompt and continues_final_message(messages)
        if prefill and plan.forced is not None:
            raise HttpError(
                400,
                "The conversation ends with an assistant message to continue (prefill), and "
                "tool_choice forces a tool call: the reply cannot be both.",
                fix="drop the final assistant message, or let tool_choice be auto",
                param="tool_choice",
                code="invalid_parameter",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=plan.tools,
                template_budget=self.template_budget,
                add_generation_prompt=generation_prompt and not prefill,
                continue_final_message=prefill,
                **kwargs,
            )
        except TemplateBudgetExceeded as err:
            raise HttpError(
                400, err.message, fix=err.fix, param="messages", code="template_budget_exceeded"
            ) from None
        except LoomError as err:
            raise from_loom_error(err, param="messages") from None
        in_reasoning = False
        if generation_prompt:
            reasoning = self.chat_format.reasoning
            in_reasoning = reasoning is not None and reasoning.opens_inside(text)
            text += prompt_suffix(plan, self.chat_format, in_reasoning=in_reasoning)
        self._check_prompt_chars(text, "messages")
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        except LoomError as err:
            raise from_loom_error(err, param="messages") from None
        self._check_prompt_tokens(ids, "messages")
        return ids, in_reasoning

    def prepare(self, body: Any, *, chat: bool) -> Prepared:
        """Validate a decoded JSON body for one of the completion endpoints.

        Raises :class:`HttpError` (400 bad value, 404 other model, 422
        refusal) before anything is queued.
        """
        model = schemas.ChatCompletionRequest if chat else schemas.CompletionRequest
        request = schemas.parse_request(model, body)
        log_ignored(request, OPENAI_IGNORED, "/v1/chat/completions" if chat else "/v1/completions")
        adapter = self._pick_adapter(request, self._check_model(request.model))
        try:
            self.model.require(GENERATE, asked="text generation")
        except LoomError as err:
            raise from_loom_error(err) from None
        if not 1 <= request.n <= MAX_CHOICES:
            raise HttpError(
                400,
                f"Invalid parameter n={request.n}: it must be an integer in [1, {MAX_CHOICES}].",
                fix=f"ask for between 1 and {MAX_CHOICES} choices",
                param="n",
                code="invalid_parameter",
            )
        if request.stream_options is not None and not request.stream:
            raise HttpError(
                400,
                "stream_options is only allowed when stream is true.",
                fix="set stream to true, or drop stream_options",
                param="stream_options",
                code="invalid_parameter",
            )
        max_tokens = self._max_tokens(request)
        stop = request.stop_list()
        # The server's defaults, under what the request gives.
        options = dict(self.sampling_defaults)
        options.update(
            (name, getattr(request, name))
            for name in schemas.SAMPLING_FIELDS
            if getattr(request, name) is not None
        )
        bias = self._logit_bias(request.logit_bias)
        if bias is not None:
            options["logit_bias"] = bias
        if chat:
            report, top = request.logprobs, request.top_logprobs
            if top is not None and not report:
                raise HttpError(
                    400,
                    "top_logprobs needs logprobs set to true.",
                    fix="set logprobs to true, or drop top_logprobs",
                    param="top_logprobs",
                    code="invalid_parameter",
                )
            count_field = "top_logprobs"
        else:
            report, top = request.logprobs is not None, request.logprobs
            count_field = "logprobs"
        if top is not None:
            options["logprobs"] = top
        # The request field each engine field came from, where their names differ.
        renamed = {"logprobs": count_field, "prompt": "messages" if chat else "prompt"}
        try:
            params = SamplingParams.parse(**options)
        except RequestError as err:
            raise self._engine_error(err, renamed) from None

        plan = ToolPlan()
        if chat:
            plan = plan_tools(request, self.chat_format)
            ids, in_reasoning = self._chat_prompt(request, plan)
        else:
            ids, in_reasoning = self._text_prompt(request), False
        constraint = request_constraint(
            request, self.tokenizer, plan=plan, chat_format=self.chat_format
        )
        sampling = params.model_dump()
        speculation = self._speculation(request.draft, request.num_draft_tokens, adapter)
        try:
            engine_request = make_request(
                self.model,
                self.tokenizer,
                ids,
                max_tokens=max_tokens,
                params=params,
                stop=stop,
                adapter=adapter,
                speculation=speculation,
                constraint=constraint,
                **self.kv,
            )
        except LoomError as err:
            raise self._engine_error(err, renamed) from None
        # After make_request: its limit is max_tokens cut to the room the context leaves.
        self._check_response_size(engine_request.limit, request.n, params.logprobs, count_field)
        choices = []
        for index in range(request.n):
            seeded = dict(sampling)
            choice_request = engine_request
            if index and seeded.get("seed") is not None:
                # Each choice is its own sample: the same seed would repeat choice 0.
                seeded["seed"] += index
                try:
                    choice_params = SamplingParams(**seeded)
                except RequestError as err:
                    raise self._engine_error(err, renamed) from None
                choice_request = dataclasses.replace(engine_request, params=choice_params)
            job = Job(
                prompt=ids,
                max_tokens=max_tokens,
                stop=stop,
                sampling=seeded,
                adapter=adapter,
                speculation=speculation,
                request=choice_request,
                constraint=constraint,
                **self.kv,
            )
            parser = (
                output_parser(plan, self.chat_format, in_reasoning=in_reasoning) if chat else None
            )
            choices.append(Choice(index=index, job=job, parser=parser))
        return Prepared(
            chat=chat,
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self._served_id(adapter),
            choices=choices,
            stream=request.stream,
            include_usage=bool(request.stream_options and request.stream_options.include_usage),
            report_logprobs=report,
            top_logprobs=params.logprobs,
            parallel_tool_calls=plan.parallel,
        )

    def _check_response_size(self, max_tokens: int, n: int, top: int, top_field: str) -> None:
        """Refuse a request whose answer could exceed ``max_response_entries`` token entries."""
        entries = max_tokens * n * (1 + top)
        if entries <= self.max_response_entries:
            return
        raise HttpError(
            400,
            f"The answer asked for could hold {entries} token entries (max_tokens {max_tokens} "
            f"x n {n} x (1 + {top_field} {top})); this server answers at most "
            f"{self.max_response_entries} (--max-response-entries).",
            fix="ask for fewer tokens, choices or log-probabilities per token, or split the "
            "request",
            param="max_tokens",
            code="response_too_large",
        )

    def _engine_error(self, err: LoomError, renamed: Mapping[str, str]) -> HttpError:
        """The answer to an error of the engine's validator, naming the field as sent."""
        param = getattr(err, "param", None)
        return from_loom_error(err, param=renamed.get(param, param) if param else None)

    def _adapter_speculation(
        self, draft: str | None, count: int | None, adapter: str
    ) -> Speculation | None:
        """An adapter request's speculation: always ``None``; one that asks to draft is refused."""
        if draft in (None, "none") and count is None:
            return None
        served = self._served_id(adapter)
        asked = "num_draft_tokens" if draft in (None, "none") else "draft"
        raise HttpError(
            400,
            f"Model {served!r} runs an adapter, and speculative decoding does not combine with "
            "an adapter yet (the speculative step runs the base model).",
            fix=f'drop "{asked}" (adapter requests decode without drafting), or send '
            f'"model": "{self.model_id}" to speculate on the base model',
            param=asked,
            code="invalid_parameter",
        )

    def _speculation(
        self, draft: str | None, count: int | None, adapter: str | None = None
    ) -> Speculation | None:
        """A request's speculation: the server's default unless ``draft`` names another.

        The draft count's bounds are the engine's (``make_request``). An adapter
        request never speculates (the speculative step runs the base model): the
        server's default draft is not applied to it, and a ``draft`` field asking
        for drafting is refused naming the field.
        """
        default = self.speculation
        if adapter is not None and draft in (None, "none", "ngram", "mtp", "model"):
            return self._adapter_speculation(draft, count, adapter)
        if count is not None:
            n = count
        else:
            n = default.num_draft if default is not None else 3
        if draft is None:
            if default is None:
                if count is not None:
                    raise HttpError(
                        400,
                        "num_draft_tokens was given but this request does not speculate.",
                        fix='add "draft": "ngram" (or start the server with a draft), or drop '
                        "num_draft_tokens",
                        param="num_draft_tokens",
                        code="invalid_parameter",
                    )
                return None
            return Speculation(default.draft, n, mtp=default.mtp)
        if draft == "none":
            return None
        if draft in ("ngram", "mtp"):
            return Speculation(None, n, mtp=draft == "mtp")
        if draft == "model":
            if default is None or default.draft is None:
                raise HttpError(
                    400,
                    'This server has no draft model, so "draft": "model" cannot be honoured.',
                    fix='start the server with --draft-model MODEL, or send "draft": "ngram"',
                    param="draft",
                    code="invalid_parameter",
                )
            return Speculation(default.draft, n)
        raise HttpError(
            400,
            f"Invalid parameter draft={draft!r}: it must be 'ngram', 'mtp', 'model' or 'none'.",
            fix='send "draft": "ngram" for prompt lookup, "mtp" for the model\'s own '
            'multi-token-prediction head, "model" for the server\'s draft model, or "none"',
            param="draft",
            code="invalid_parameter",
        )

    # --- answers ------------------------------------------------------------------

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _usage(self, prep: Prepared) -> schemas.Usage:
        """Prompt counted once, completions summed over the choices (as OpenAI counts n > 1)."""
        first = prep.choices[0].pieces[-1]
        completion = sum(c.pieces[-1].generation_tokens for c in prep.choices if c.pieces)
        return schemas.Usage(
            prompt_tokens=first.prompt_tokens,
            completion_tokens=completion,
            total_tokens=first.prompt_tokens + completion,
            prompt_tokens_details={"cached_tokens": first.cached_tokens},
        )

    def _chat_logprobs(self, pieces: Iterable[Piece]) -> schemas.ChatLogprobs:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self._token_text(token)
            return {
                "token": text,
                "logprob": wire.logprob(logprob),
                "bytes": list(text.encode("utf-8")),
            }

        return schemas.ChatLogprobs(
            content=[
                schemas.TokenLogprob(
                    **entry(p.token, p.logprob),
                    top_logprobs=[schemas.TopLogprob(**entry(t, v)) for t, v in p.top_logprobs],
                )
                for p in pieces
            ]
        )

    def _completion_logprobs(
        self, prep: Prepared, pieces: Sequence[Piece], offset: int = 0
    ) -> schemas.CompletionLogprobs:
        tokens = [self._token_text(p.token) for p in pieces]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        top = None
        if prep.top_logprobs:
            top = [
                {self._token_text(t): wire.logprob(v) for t, v in p.top_logprobs} for p in pieces
            ]
        return schemas.CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[wire.logprob(p.logprob) for p in pieces],
            top_logprobs=top,
            text_offset=offsets,
        )

    def absorb(self, prep: Prepared, choice: Choice, piece: Piece) -> list[dict[str, Any]]:
        """Take one generated piece into ``choice``; return the chat deltas it completes.

        Each delta is ``{"content": ...}``, ``{"reasoning_content": ...}`` or a
        ``{"tool_calls": [...]}`` fragment (a call's id and name, then its
        arguments). Sets ``choice.finish_reason`` when the choice is done:
        the generation finished, or — with ``parallel_tool_calls`` false —
        its first call is complete (the caller then cancels the job).
        """
        if choice.done:
            return []
        choice.pieces.append(piece)
        if choice.parser is None:
            choice.content.append(piece.text)
            if piece.finish_reason is not None:
                choice.finish_reason = _finish_reason(piece.finish_reason)
            return []
        final = piece.finish_reason is not None
        events = choice.parser.feed(piece.text)
        if final:
            events += choice.parser.finish()
        deltas: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, Content):
                choice.content.append(event.text)
                deltas.append({"content": event.text})
            elif isinstance(event, Reasoning):
                choice.reasoning.append(event.text)
                deltas.append({"reasoning_content": event.text})
            elif isinstance(event, ToolCallFound):
                index = len(choice.tool_calls)
                call = _tool_call_out(event.call)
                choice.tool_calls.append(call)
                head = {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": ""},
                }
                deltas.append({"tool_calls": [{"index": index, **head}]})
                args = {"index": index, "function": {"arguments": call.function.arguments}}
                deltas.append({"tool_calls": [args]})
                if not prep.parallel_tool_calls:
                    choice.finish_reason = "tool_calls"
                    return deltas
        if final:
            reason = piece.finish_reason
            choice.finish_reason = (
                "tool_calls" if reason == "stop" and choice.tool_calls else _finish_reason(reason)
            )
        return deltas

    def response(self, prep: Prepared) -> dict[str, Any]:
        """The whole (non-streamed) answer, from what each choice's job produced."""
        usage = self._usage(prep)
        if prep.chat:
            out = []
            for c in prep.choices:
                text = "".join(c.content)
                message = schemas.ChatMessageOut(
                    content=None if c.tool_calls and not text else text,
                    reasoning_content="".join(c.reasoning) or None,
                    tool_calls=c.tool_calls or None,
                )
                out.append(
                    schemas.ChatChoice(
                        index=c.index,
                        message=message.wire(),
                        logprobs=self._chat_logprobs(c.pieces) if prep.report_logprobs else None,
                        finish_reason=c.finish_reason,
                    )
                )
            return schemas.ChatCompletionResponse(
                id=prep.id, created=prep.created, model=prep.model, usage=usage, choices=out
            ).model_dump()
        texts = [
            schemas.CompletionChoice(
                index=c.index,
                text="".join(c.content),
                logprobs=self._completion_logprobs(prep, c.pieces)
                if prep.report_logprobs
                else None,
                finish_reason=c.finish_reason,
            )
            for c in prep.choices
        ]
        return schemas.CompletionResponse(
            id=prep.id, created=prep.created, model=prep.model, usage=usage, choices=texts
        ).model_dump()

    def _chunk(self, prep: Prepared, choices: list[Any], usage: schemas.Usage | None = None):
        cls = schemas.ChatCompletionChunk if prep.chat else schemas.CompletionResponse
        chunk = cls(
            id=prep.id, created=prep.created, model=prep.model, choices=choices, usage=usage
        )
        # OpenAI sends "usage" in chunks only when the client asked for it.
        return chunk.model_dump(exclude=None if prep.include_usage else {"usage"})

    def first_chunks(self, prep: Prepared, choice: Choice) -> list[dict[str, Any]]:
        """What a chat stream opens each choice with: the assistant role and empty content."""
        if not prep.chat:
            return []
        delta = {"role": "assistant", "content": ""}
        return [self._chunk(prep, [schemas.ChatChunkChoice(index=choice.index, delta=delta)])]

    def chunks(self, prep: Prepared, choice: Choice, piece: Piece) -> list[dict[str, Any]]:
        """The stream chunks for one generated token (none while text is held back)."""
        if choice.done:
            return []
        out: list[dict[str, Any]] = []
        if prep.chat:
            deltas = self.absorb(prep, choice, piece)
            if prep.report_logprobs and not deltas:
                deltas = [{"content": ""}]
            for i, delta in enumerate(deltas):
                logprobs = None
                if prep.report_logprobs and i == 0:
                    logprobs = self._chat_logprobs([piece])
                item = schemas.ChatChunkChoice(index=choice.index, delta=delta, logprobs=logprobs)
                out.append(self._chunk(prep, [item]))
            if choice.done:
                item = schemas.ChatChunkChoice(
                    index=choice.index, delta={}, finish_reason=choice.finish_reason
                )
                out.append(self._chunk(prep, [item]))
            return out
        offset = sum(len(self._token_text(p.token)) for p in choice.pieces)
        self.absorb(prep, choice, piece)
        if piece.text or choice.done or prep.report_logprobs:
            text_logprobs = (
                self._completion_logprobs(prep, [piece], offset) if prep.report_logprobs else None
            )
            text_item = schemas.CompletionChoice(
                index=choice.index,
                text=piece.text,
                logprobs=text_logprobs,
                finish_reason=choice.finish_reason,
            )
            out.append(self._chunk(prep, [text_item]))
        return out

    def last_chunks(self, prep: Prepared) -> list[dict[str, Any]]:
        """After every choice: the usage chunk, when the client asked for it."""
        if not prep.include_usage:
            return []
        return [self._chunk(prep, [], usage=self._usage(prep))]


def _check_count(name: str, value: Any, flag: str, example: int) -> None:
    """A server-wide bound must be an int >= 1 (a bad one fails start-up)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(
            f"{name}={value!r} is invalid; it must be an int >= 1.",
            fix=f"pass a positive {flag}, such as {example}",
        )


def _finish_reason(reason: str | None) -> schemas.FinishReason | None:
    """The engine's finish reason (``stop``, ``length``) as the wire's literal type."""
    return cast("schemas.FinishReason | None", reason)


def _tool_call_out(call: ToolCall) -> schemas.ToolCallOut:
    return schemas.ToolCallOut(
        id=call.id or f"call_{uuid.uuid4().hex[:24]}",
        function=schemas.FunctionCall(
            name=call.name, arguments=json.dumps(call.arguments, ensure_ascii=False)
        ),
    )


def _template_args(args: Mapping[str, Any] | None) -> dict[str, Any]:
    """Server-wide template variables, checked once (``--chat-template-args``)."""
    if args is None:
        return {}
    if not isinstance(args, Mapping):
        raise RequestError(
            f"chat_template_args is a {type(args).__name__}; it must be a JSON object.",
            fix="""pass --chat-template-args as an object, e.g. '{"enable_thinking": false}'""",
        )
    reserved = _RESERVED_TEMPLATE_KEYS & args.keys()
    if reserved:
        raise RequestError(
            f"chat_template_args may not set {sorted(reserved)}; the server sets them.",
            fix="remove those keys from --chat-template-args",
        )
    return dict(args)


def server_engine_settings(**changes: Any) -> EngineSettings:
    """The engine settings ``loom serve`` uses unless told otherwise (mlx-lm's defaults).

    Unlike the Python API's default engine, the server keeps a prefix store
    (``prompt_cache_size`` 10), bounds its queue (``max_queued`` 64) and keeps
    its engine thread for its whole life (no idle exit and restart).
    """
    defaults = {"prompt_cache_size": 10, "max_queued": DEFAULT_MAX_QUEUED, "idle_seconds": None}
    return EngineSettings(**{**defaults, **changes})


def _message_dict(index: int, message: schemas.ChatMessage) -> dict[str, Any]:
    """A message as the chat template sees it: text parts joined, extra keys kept."""
    data = message.model_dump()
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise HttpError(
                    400,
                    f"messages[{index}].content[{j}] is a {part.type!r} part; this server "
                    "serves text only.",
                    fix='send text parts only: {"type": "text", "text": "..."}',
                    param=f"messages[{index}].content",
                    code="unsupported_content",
                )
            texts.append(part.text)
        data["content"] = "".join(texts)
    elif content is None:
        data["content"] = ""
    return data

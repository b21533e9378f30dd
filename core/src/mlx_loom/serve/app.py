"""Request handling without HTTP: validate a body into a job, shape results as OpenAI JSON.

:class:`ServeApp` is what the HTTP handler calls. Validation runs in the
handler's thread, before the job is queued, so a bad request is answered at
once (never after waiting for another client's generation) and every
failure carries the request field at fault in ``param``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine import EngineSettings, Speculation
from ..engine.request import MAX_DRAFT
from ..errors import LoomError, RequestError
from ..generate import SamplingParams
from ..generate.stream import DEFAULT_MAX_TOKENS
from ..host import GENERATE
from ..model import Model
from ..text import StopStrings, Tokenizer
from . import schemas
from .errors import NOT_FOUND, HttpError, from_loom_error
from .worker import GenerationWorker, Job, Piece

#: The largest ``max_tokens`` a request may ask for unless the server is started
#: with another ``--max-tokens-limit``.
DEFAULT_MAX_TOKENS_LIMIT = 4096

#: Requests that may wait for a free row before the server answers 503.
DEFAULT_MAX_QUEUED = 64


@dataclass
class Prepared:
    """A validated request: the job to run plus how to shape its answer."""

    chat: bool
    id: str
    created: int
    model: str
    job: Job
    stream: bool = False
    include_usage: bool = False
    #: Report per-token log-probabilities (chat ``logprobs: true``, or
    #: completions ``logprobs`` given as a count).
    report_logprobs: bool = False
    top_logprobs: int = 0
    pieces: list[Piece] = field(default_factory=list)


class ServeApp:
    """One loaded model served over the OpenAI API; owns the generation worker.

    ``model_id`` is the id clients see in ``GET /v1/models`` and may send as
    ``model``; a request naming any other model is refused (404), never
    silently answered by this one. ``engine`` sets how the model's engine
    batches (concurrency, prefill chunking, the prefix store, the queue bound).
    """

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        *,
        model_id: str | None = None,
        max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
        engine: EngineSettings | None = None,
        speculation: Speculation | None = None,
    ) -> None:
        if (
            isinstance(max_tokens_limit, bool)
            or not isinstance(max_tokens_limit, int)
            or (max_tokens_limit < 1)
        ):
            raise RequestError(
                f"max_tokens_limit={max_tokens_limit!r} is invalid; it must be an int >= 1.",
                fix="pass a positive --max-tokens-limit, such as 4096",
            )
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id or model.model_dir.name
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = min(DEFAULT_MAX_TOKENS, max_tokens_limit)
        self.created = int(time.time())
        self.worker = GenerationWorker(model, tokenizer, engine or server_engine_settings())
        #: Every request's speculation unless it asks otherwise (``draft`` field).
        self.speculation = speculation

    def close(self) -> None:
        self.worker.close()

    # --- GET endpoints --------------------------------------------------------

    def _accepted_ids(self) -> set[str]:
        directory = self.model.model_dir
        return {self.model_id, str(directory), str(directory.resolve()), directory.name}

    def models(self) -> dict[str, Any]:
        card = schemas.ModelCard(id=self.model_id, created=self.created)
        return schemas.ModelList(data=[card]).model_dump()

    def model_card(self, model_id: str) -> dict[str, Any]:
        self._check_model(model_id, param=None)
        return schemas.ModelCard(id=self.model_id, created=self.created).model_dump()

    def health(self) -> tuple[int, dict[str, Any]]:
        """``(status, body)``: 503 once the engine has been shut down.

        ``queued`` counts requests waiting for a free row, ``active_rows`` the
        requests being prefilled or decoded.
        """
        worker = self.worker
        ok = worker.alive
        stats = worker.stats()
        engine = stats.engine
        settings = worker.service.settings
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
            "prompt_cache": {"entries": engine.prefix_entries, "bytes": engine.prefix_bytes},
        }

    # --- validation -------------------------------------------------------------

    def _check_model(self, name: str | None, *, param: str | None = "model") -> None:
        if name is None or name in self._accepted_ids():
            return
        raise HttpError(
            404,
            f"The model {name!r} is not served here; this server serves {self.model_id!r}.",
            fix=f"omit model, or pass model={self.model_id!r} (see GET /v1/models)",
            type=NOT_FOUND if param is None else "invalid_request_error",
            param=param,
            code="model_not_found",
        )

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
            try:
                token = int(key)
            except ValueError:
                raise HttpError(
                    400,
                    f"Invalid parameter logit_bias: key {key!r} is not a token id.",
                    fix='use token ids as keys, e.g. {"50": -100}',
                    param="logit_bias",
                    code="invalid_parameter",
                ) from None
            out[token] = bias
        return out

    def _sampling(self, options: dict[str, Any], *, renamed: dict[str, str]) -> SamplingParams:
        """Parse with :meth:`SamplingParams.parse`; a failure names the request field at fault.

        ``renamed`` maps a SamplingParams field to the request field it came
        from (chat's ``top_logprobs`` arrives as ``logprobs``).
        """
        try:
            params = SamplingParams.parse(**options)
        except RequestError as err:
            name = _failing_option(options)
            raise from_loom_error(err, param=renamed.get(name, name)) from None
        vocab = self.model.vocab_size
        if vocab is not None:
            try:
                params.validate_logit_bias(vocab)
            except RequestError as err:
                raise from_loom_error(err, param="logit_bias") from None
        return params

    def _check_prompt(self, ids: Sequence[int], param: str) -> None:
        if not ids:
            raise HttpError(
                400,
                f"The {param} encodes to no tokens.",
                fix="pass a non-empty prompt (text or token ids)",
                param=param,
                code="empty_prompt",
            )
        vocab = self.model.vocab_size
        if vocab is not None:
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise HttpError(
                    400,
                    f"The {param} holds token id(s) {bad[:5]} outside the vocabulary "
                    f"(ids 0..{vocab - 1}).",
                    fix="encode the prompt with this model's tokenizer",
                    param=param,
                    code="invalid_token",
                )
        limit = self.model.context_length
        if limit is not None and len(ids) >= limit:
            # Generation stops at the context (finish_reason "length"); a prompt
            # that fills it leaves no room for a single token.
            raise HttpError(
                400,
                f"The {param} is {len(ids)} tokens long; this model's context "
                f"(max_position_embeddings) is {limit} tokens, which leaves no room to generate.",
                fix=f"shorten the prompt to fewer than {limit} tokens",
                param=param,
                code="context_length_exceeded",
            )

    def _text_prompt(self, request: schemas.CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, str):
            if not prompt:
                raise HttpError(
                    400,
                    "The prompt is empty.",
                    fix="pass a non-empty prompt (text or token ids)",
                    param="prompt",
                    code="empty_prompt",
                )
            ids = self.tokenizer.encode_prompt(prompt)
        else:
            ids = list(prompt)
        self._check_prompt(ids, "prompt")
        return ids

    def _chat_prompt(self, request: schemas.ChatCompletionRequest) -> list[int]:
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
        kwargs = dict(request.chat_template_kwargs or {})
        reserved = {"messages", "tools", "system", "template_name"} & kwargs.keys()
        if reserved:
            raise HttpError(
                400,
                f"chat_template_kwargs may not set {sorted(reserved)}.",
                fix="remove those keys from chat_template_kwargs",
                param="chat_template_kwargs",
                code="invalid_parameter",
            )
        try:
            ids = self.tokenizer.encode_chat(messages, **kwargs)
        except LoomError as err:
            raise from_loom_error(err, param="messages") from None
        self._check_prompt(ids, "messages")
        return ids

    def prepare(self, body: Any, *, chat: bool) -> Prepared:
        """Validate a decoded JSON body for one of the completion endpoints.

        Raises :class:`HttpError` (400 bad value, 404 other model, 422
        refusal) before anything is queued.
        """
        model = schemas.ChatCompletionRequest if chat else schemas.CompletionRequest
        request = schemas.parse_request(model, body)
        self._check_model(request.model)
        try:
            self.model.require(GENERATE, asked="text generation")
        except LoomError as err:
            raise from_loom_error(err) from None
        if request.n != 1:
            raise HttpError(
                400,
                f"Invalid parameter n={request.n}: this server returns one choice per request.",
                fix="omit n, or send one request per choice",
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
        try:
            StopStrings(stop)
        except RequestError as err:
            raise from_loom_error(err, param="stop") from None

        options = {
            name: getattr(request, name)
            for name in schemas.SAMPLING_FIELDS
            if getattr(request, name) is not None
        }
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
        params = self._sampling(options, renamed={"logprobs": count_field})

        ids = self._chat_prompt(request) if chat else self._text_prompt(request)
        sampling = params.model_dump()
        speculation = self._speculation(request.draft, request.num_draft_tokens)
        return Prepared(
            chat=chat,
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_id,
            job=Job(
                prompt=ids,
                max_tokens=max_tokens,
                stop=stop,
                sampling=sampling,
                speculation=speculation,
            ),
            stream=request.stream,
            include_usage=bool(request.stream_options and request.stream_options.include_usage),
            report_logprobs=report,
            top_logprobs=params.logprobs,
        )

    def _speculation(self, draft: str | None, count: int | None) -> Speculation | None:
        """A request's speculation: the server's default unless ``draft`` names another."""
        default = self.speculation
        if count is not None and not 1 <= count <= MAX_DRAFT:
            raise HttpError(
                400,
                f"Invalid parameter num_draft_tokens={count}: it must be from 1 to {MAX_DRAFT}.",
                fix=f"send num_draft_tokens from 1 to {MAX_DRAFT} (3 is a good start), or omit it",
                param="num_draft_tokens",
                code="invalid_parameter",
            )
        n = count or (default.num_draft if default is not None else 3)
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
            return Speculation(default.draft, n)
        if draft == "none":
            return None
        if draft == "ngram":
            return Speculation(None, n)
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
            f"Invalid parameter draft={draft!r}: it must be 'ngram', 'model' or 'none'.",
            fix='send "draft": "ngram" for prompt lookup, "model" for the server\'s draft '
            'model, or "none"',
            param="draft",
            code="invalid_parameter",
        )

    # --- answers ------------------------------------------------------------------

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _usage(self, last: Piece) -> schemas.Usage:
        return schemas.Usage(
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.generation_tokens,
            total_tokens=last.prompt_tokens + last.generation_tokens,
            prompt_tokens_details={"cached_tokens": last.cached_tokens},
        )

    def _chat_logprobs(self, prep: Prepared, pieces: Iterable[Piece]) -> schemas.ChatLogprobs:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self._token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

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
            top = [{self._token_text(t): v for t, v in p.top_logprobs} for p in pieces]
        return schemas.CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[p.logprob for p in pieces],
            top_logprobs=top,
            text_offset=offsets,
        )

    def response(self, prep: Prepared) -> dict[str, Any]:
        """The whole (non-streamed) answer, from the pieces the job produced."""
        pieces = prep.pieces
        last = pieces[-1]
        text = "".join(p.text for p in pieces)
        envelope = dict(id=prep.id, created=prep.created, model=prep.model, usage=self._usage(last))
        if prep.chat:
            choice = schemas.ChatChoice(
                message=schemas.ChatMessageOut(content=text),
                logprobs=self._chat_logprobs(prep, pieces) if prep.report_logprobs else None,
                finish_reason=last.finish_reason,
            )
            return schemas.ChatCompletionResponse(choices=[choice], **envelope).model_dump()
        choice = schemas.CompletionChoice(
            text=text,
            logprobs=self._completion_logprobs(prep, pieces) if prep.report_logprobs else None,
            finish_reason=last.finish_reason,
        )
        return schemas.CompletionResponse(choices=[choice], **envelope).model_dump()

    def _chunk(self, prep: Prepared, choices: list[Any], usage: schemas.Usage | None = None):
        cls = schemas.ChatCompletionChunk if prep.chat else schemas.CompletionResponse
        chunk = cls(
            id=prep.id, created=prep.created, model=prep.model, choices=choices, usage=usage
        )
        # OpenAI sends "usage" in chunks only when the client asked for it.
        return chunk.model_dump(exclude=None if prep.include_usage else {"usage"})

    def first_chunks(self, prep: Prepared) -> list[dict[str, Any]]:
        """What a chat stream opens with: the assistant role and empty content."""
        if not prep.chat:
            return []
        delta = {"role": "assistant", "content": ""}
        return [self._chunk(prep, [schemas.ChatChunkChoice(delta=delta)])]

    def chunks(self, prep: Prepared, piece: Piece) -> list[dict[str, Any]]:
        """The stream chunks for one generated token (none while text is held back)."""
        prep.pieces.append(piece)
        out: list[dict[str, Any]] = []
        final = piece.finish_reason is not None
        if prep.chat:
            if piece.text or prep.report_logprobs:
                logprobs = self._chat_logprobs(prep, [piece]) if prep.report_logprobs else None
                choice = schemas.ChatChunkChoice(delta={"content": piece.text}, logprobs=logprobs)
                out.append(self._chunk(prep, [choice]))
            if final:
                choice = schemas.ChatChunkChoice(delta={}, finish_reason=piece.finish_reason)
                out.append(self._chunk(prep, [choice]))
        elif piece.text or final or prep.report_logprobs:
            offset = sum(len(self._token_text(p.token)) for p in prep.pieces[:-1])
            logprobs = (
                self._completion_logprobs(prep, [piece], offset) if prep.report_logprobs else None
            )
            choice = schemas.CompletionChoice(
                text=piece.text, logprobs=logprobs, finish_reason=piece.finish_reason
            )
            out.append(self._chunk(prep, [choice]))
        if final and prep.include_usage:
            out.append(self._chunk(prep, [], usage=self._usage(piece)))
        return out


def server_engine_settings(**changes: Any) -> EngineSettings:
    """The engine settings ``loom serve`` uses unless told otherwise (mlx-lm's defaults).

    Unlike the Python API's default engine, the server keeps a prefix store
    (``prompt_cache_size`` 10), bounds its queue (``max_queued`` 64) and keeps
    its engine thread for its whole life (no idle exit and restart).
    """
    defaults = {"prompt_cache_size": 10, "max_queued": DEFAULT_MAX_QUEUED, "idle_seconds": None}
    return EngineSettings(**{**defaults, **changes})


def _failing_option(options: dict[str, Any]) -> str:
    """The first option ``SamplingParams`` refuses on its own: the ``param`` to report."""
    for name, value in options.items():
        try:
            SamplingParams.parse(**{name: value})
        except RequestError:
            return name
    return next(iter(options), "")


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

"""The tokenizer of a model artifact, read from Hugging Face files without transformers.

Files read from the model directory:

* ``tokenizer.json`` (required) — the full ``tokenizers`` pipeline. Its
  post-processor alone decides whether ``encode`` adds BOS; a
  ``tokenizer_config.json`` ``add_bos_token`` is read but not applied, as
  transformers (v5) also drops it when ``tokenizer.json`` exists.
* ``tokenizer_config.json`` — special-token strings (plain or
  ``{"content": ...}``), ``chat_template`` (a string or a list of named ones),
  ``tool_parser_type`` (the tool-call format's name, as mlx-lm spells it).
* ``special_tokens_map.json`` — fills special tokens the config lacks.
* ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` — when
  present they replace the config's templates, as in transformers.
* ``generation_config.json`` — ``eos_token_id`` (an int or a list).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import tokenizers
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from mlx_loom.bounded_json import read_json_file
from mlx_loom.errors import RequestError, TokenizerError
from mlx_loom.text.chat_template import NO_TEMPLATE_FIX, ChatTemplate
from mlx_loom.text.detokenizer import DecodePlan, StreamingDetokenizer
from mlx_loom.text.template_budget import TemplateBudget

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
GENERATION_CONFIG_FILE = "generation_config.json"
#: ``tokenizer.json`` is parsed by the tokenizers library (whose JSON parser
#: stops at 128 levels of nesting); we bound its size before it reads it. The
#: largest published ones are ~35 MB.
MAX_TOKENIZER_BYTES = 512 * 1024 * 1024

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_content(value: Any) -> str | None:
    """A special token as written in config files: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"expected a string or an object with 'content', got {value!r}")


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        raise ValueError(f"expected a token id or a list of them, got {value!r}")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(type(v) is int for v in value):
        return list(value)
    raise ValueError(f"expected a token id or a list of them, got {value!r}")


class TokenizerConfig(BaseModel):
    """The fields of ``tokenizer_config.json`` (and ``special_tokens_map.json``) we use."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    sep_token: str | None = None
    pad_token: str | None = None
    cls_token: str | None = None
    mask_token: str | None = None
    add_bos_token: bool | None = None
    chat_template: str | dict[str, str] | None = None
    #: The tool-call format, by parser name (mlx-lm's key; see ``mlx_loom.text.tool_calls``).
    tool_parser_type: str | None = None

    @field_validator(*SPECIAL_TOKEN_NAMES, mode="before")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        return _token_content(value)

    @field_validator("chat_template", mode="before")
    @classmethod
    def _named_templates(cls, value: Any) -> Any:
        # transformers serializes several templates as [{"name": ..., "template": ...}].
        if isinstance(value, list):
            try:
                return {item["name"]: item["template"] for item in value}
            except (TypeError, KeyError) as exc:
                raise ValueError("chat_template list entries need 'name' and 'template'") from exc
        return value


def _read_json(path: Path) -> Any:
    fix = f"restore {path.name} from the original model files"
    try:
        return read_json_file(path, error=TokenizerError, fix=fix)
    except FileNotFoundError:
        raise TokenizerError(f"{path} could not be read: it does not exist", fix=fix) from None


class Tokenizer:
    """Encode, decode, stream-decode and chat-format for one model artifact.

    Build it with :meth:`from_dir`. Instances are immutable after loading and
    safe to share; each generation gets its own :meth:`detokenizer`.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: TokenizerConfig,
        *,
        templates: Mapping[str, ChatTemplate] | None = None,
        extra_eos_ids: Iterable[int] = (),
        source: str = "tokenizer",
    ) -> None:
        self._backend = backend
        self.config = config
        self.source = source
        self._templates = dict(templates or {})
        self._plan = DecodePlan.for_backend(backend)
        eos = [int(i) for i in extra_eos_ids]
        if (eos_id := self.token_to_id(config.eos_token)) is not None:
            eos.insert(0, eos_id)
        self._eos_order = tuple(dict.fromkeys(eos))  # tokenizer's own first, then configs'
        self._eos_ids = frozenset(eos)

    # --- loading -------------------------------------------------------------

    @classmethod
    def from_dir(
        cls, path: str | Path, *, config_eos: int | Sequence[int] | None = None
    ) -> Tokenizer:
        """Load the tokenizer files of a model directory.

        ``config_eos`` is the model ``config.json``'s ``eos_token_id`` (an int
        or a list), which the caller has already parsed; it is added to the
        stop ids together with the tokenizer's and ``generation_config.json``'s.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise TokenizerError(
                f"tokenizer directory {directory} does not exist",
                fix="point at the model directory that holds tokenizer.json",
            )
        backend = _load_backend(directory / TOKENIZER_FILE)
        config = _load_config(directory)
        templates = _load_templates(directory, config)
        try:
            extra = _as_id_list(config_eos)
        except ValueError as exc:
            raise TokenizerError(
                f"eos_token_id from config.json is invalid: {exc}",
                fix="set eos_token_id in config.json to a token id or a list of ids",
            ) from exc
        extra += _generation_eos(directory / GENERATION_CONFIG_FILE)
        return cls(backend, config, templates=templates, extra_eos_ids=extra, source=str(directory))

    # --- vocabulary ----------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (read-only use)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``len()`` of an HF tokenizer)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    @property
    def bos_token(self) -> str | None:
        return self.config.bos_token

    @property
    def eos_token(self) -> str | None:
        return self.config.eos_token

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.config.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.config.pad_token)

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence id, as in transformers and mlx-lm.

        The tokenizer's own ``eos_token`` when it has one; otherwise the first
        id ``config.json``/``generation_config.json`` declare. Generation stops
        on any of :attr:`eos_token_ids`, not only this one.
        """
        return self._eos_order[0] if self._eos_order else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: tokenizer, config.json and generation_config eos."""
        return self._eos_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of added tokens marked special (what ``skip_special_tokens`` drops)."""
        return self._plan.special_ids

    @property
    def special_tokens(self) -> dict[str, str]:
        """``{"bos_token": "<s>", ...}`` for the named special tokens that are set."""
        return {
            name: value
            for name in SPECIAL_TOKEN_NAMES
            if (value := getattr(self.config, name)) is not None
        }

    # --- encode / decode -----------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; the post-processor adds BOS/EOS when asked.

        Text holding a lone UTF-16 surrogate (possible in Python strings, e.g.
        from JSON ``"\\ud800"``) is not valid Unicode; it is a
        :class:`~mlx_loom.errors.RequestError` rather than the library's TypeError.

        Why ``encode_batch`` of one text: the library's ``encode`` keeps the
        GIL while it works (a 1 Mi-character prompt stalled every other thread
        of a server for 2-3 s, ``tokenizers`` 0.23), ``encode_batch`` lets it
        go, so other threads run while a long text is encoded. Same ids.
        """
        try:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:
            bad = next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), None)
            if not isinstance(text, str) or bad is None:
                raise
            raise RequestError(
                f"the text to encode holds a lone UTF-16 surrogate "
                f"({ascii(text[bad])}) at character {bad}, which is not valid Unicode",
                fix="pass valid Unicode text: remove the surrogate or complete its pair",
            ) from None

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a raw (un-templated) prompt, adding BOS unless the text already starts with it.

        This is mlx-lm's rule for raw prompts, so a prompt pasted with its
        ``<s>`` does not get a second one.
        """
        bos = self.config.bos_token
        return self.encode(text, add_special_tokens=bos is None or not text.startswith(bos))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def detokenizer(self, *, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        """A fresh streaming detokenizer (one per generated sequence)."""
        return StreamingDetokenizer(self._plan, skip_special_tokens=skip_special_tokens)

    # --- chat ----------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @property
    def chat_template_names(self) -> tuple[str, ...]:
        return tuple(self._templates)

    def chat_template(
        self, name: str | None = None, *, tools: Sequence[Any] | None = None
    ) -> ChatTemplate:
        """The template to render with: ``name``, else ``tool_use`` when tools are
        given and it exists, else ``default`` (the same choice transformers makes)."""
        if not self._templates:
            raise TokenizerError(
                f"the tokenizer in {self.source} has no chat template "
                f"(looked for {TEMPLATE_FILE} and 'chat_template' in {CONFIG_FILE})",
                fix=NO_TEMPLATE_FIX,
            )
        if name is None:
            if tools is not None and "tool_use" in self._templates:
                name = "tool_use"
            elif "default" in self._templates:
                name = "default"
            else:
                raise TokenizerError(
                    f"the tokenizer in {self.source} has several chat templates "
                    f"({', '.join(sorted(self._templates))}) and none is named 'default'",
                    fix="choose one by name",
                )
        try:
            return self._templates[name]
        except KeyError:
            raise TokenizerError(
                f"chat template {name!r} is not in {self.source} "
                f"(it has: {', '.join(sorted(self._templates))})",
                fix="choose one of the listed templates",
            ) from None

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Any],
        *,
        tokenize: Literal[False] = False,
        add_generation_prompt: bool = True,
        system: str | None = None,
        tools: Sequence[Any] | None = None,
        continue_final_message: bool = False,
        template_name: str | None = None,
        template_budget: TemplateBudget | None = None,
        **template_kwargs: Any,
    ) -> str: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Any],
        *,
        tokenize: Literal[True],
        add_generation_prompt: bool = True,
        system: str | None = None,
        tools: Sequence[Any] | None = None,
        continue_final_message: bool = False,
        template_name: str | None = None,
        template_budget: TemplateBudget | None = None,
        **template_kwargs: Any,
    ) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        *,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        system: str | None = None,
        tools: Sequence[Any] | None = None,
        continue_final_message: bool = False,
        template_name: str | None = None,
        template_budget: TemplateBudget | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation to prompt text, or with ``tokenize=True`` to its token ids.

        ``tokenize=True`` gives what :meth:`encode_chat` gives (and what
        transformers' and mlx-lm's ``apply_chat_template`` return): the
        rendered text encoded without adding special tokens, since the
        template writes its own. Unlike transformers, text is the default
        here, and ``add_generation_prompt`` defaults to True (a prompt about
        to be answered), the way mlx-lm always calls it.

        ``system`` prepends a system message. ``template_kwargs`` are template
        variables (``enable_thinking=False`` ...), and may override the special
        token strings the template sees. The render runs under
        ``template_budget`` (default: :meth:`TemplateBudget.from_env`, 1 s and
        2 Mi characters); running out raises
        :class:`~mlx_loom.errors.TemplateBudgetExceeded`.
        """
        if tokenize is not True and tokenize is not False:
            raise TokenizerError(
                f"apply_chat_template(tokenize={tokenize!r}) needs a bool",
                fix="pass tokenize=True for token ids, or tokenize=False (the default) for text",
            )
        chat = list(messages)
        if system is not None:
            chat.insert(0, {"role": "system", "content": system})
        if not chat:
            raise TokenizerError(
                "the conversation to format is empty",
                fix="pass at least one message",
            )
        template = self.chat_template(template_name, tools=tools)
        text = template.render(
            chat,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            continue_final_message=continue_final_message,
            special_tokens=self.special_tokens,
            budget=template_budget,
            **template_kwargs,
        )
        # A template that wants BOS writes ``{{ bos_token }}`` itself, so the
        # post-processor's special tokens would double it; transformers and
        # mlx-lm encode rendered chats the same way.
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def encode_chat(self, messages: Sequence[Any], **kwargs: Any) -> list[int]:
        """Token ids of a rendered conversation: ``apply_chat_template(..., tokenize=True)``."""
        return self.apply_chat_template(messages, tokenize=True, **kwargs)


# --- file readers ----------------------------------------------------------------


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        sentencepiece = path.with_name("tokenizer.model")
        hint = (
            f" (found {sentencepiece.name}: convert it to {TOKENIZER_FILE}"
            " by saving a fast tokenizer)"
            if sentencepiece.is_file()
            else ""
        )
        raise TokenizerError(
            f"{path} is missing{hint}",
            fix=f"copy {TOKENIZER_FILE} from the original model into {path.parent}",
        )
    size = path.stat().st_size
    if size > MAX_TOKENIZER_BYTES:
        raise TokenizerError(
            f"{path} is {size} bytes; the limit is {MAX_TOKENIZER_BYTES} bytes",
            fix=f"restore {TOKENIZER_FILE} from the original model files",
        )
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust loader raises plain Exception subclasses
        raise TokenizerError(
            f"{path} could not be loaded by the tokenizers library: {exc}",
            fix=f"restore {TOKENIZER_FILE} from the original model files "
            "(it may be truncated, or from a newer tokenizers version)",
        ) from exc


def _load_config(directory: Path) -> TokenizerConfig:
    data: dict[str, Any] = {}
    config_path = directory / CONFIG_FILE
    if config_path.is_file():
        loaded = _read_json(config_path)
        if not isinstance(loaded, dict):
            raise TokenizerError(
                f"{config_path} holds a {type(loaded).__name__}, not a JSON object",
                fix=f"restore {CONFIG_FILE} from the original model files",
            )
        data.update(loaded)
    special_path = directory / SPECIAL_TOKENS_FILE
    if special_path.is_file():
        special = _read_json(special_path)
        if isinstance(special, dict):
            for name in SPECIAL_TOKEN_NAMES:
                if data.get(name) is None and special.get(name) is not None:
                    data[name] = special[name]
    try:
        return TokenizerConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise TokenizerError(
            f"{config_path} field {field!r} is invalid: {first['msg']}",
            fix=f"correct {field!r} in {CONFIG_FILE}",
        ) from exc


def _load_templates(directory: Path, config: TokenizerConfig) -> dict[str, ChatTemplate]:
    sources: dict[str, tuple[str, str]] = {}  # name -> (source, origin)
    template_file = directory / TEMPLATE_FILE
    if template_file.is_file():
        sources["default"] = (_read_text(template_file), str(template_file))
    template_dir = directory / TEMPLATE_DIR
    if template_dir.is_dir():
        for file in sorted(template_dir.glob("*.jinja")):
            sources[file.stem] = (_read_text(file), str(file))
    if not sources:
        origin = f"{directory / CONFIG_FILE} ('chat_template'"
        if isinstance(config.chat_template, str):
            sources["default"] = (config.chat_template, origin + ")")
        elif isinstance(config.chat_template, dict):
            for name, text in config.chat_template.items():
                sources[name] = (text, f"{origin} entry {name!r})")
    return {name: ChatTemplate(text, origin=origin) for name, (text, origin) in sources.items()}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(
            f"{path} could not be read: {exc}",
            fix=f"restore {path.name} from the original model files",
        ) from exc


def _generation_eos(path: Path) -> list[int]:
    if not path.is_file():
        return []
    data = _read_json(path)
    try:
        return _as_id_list(data.get("eos_token_id") if isinstance(data, dict) else None)
    except ValueError as exc:
        raise TokenizerError(
            f"{path} field 'eos_token_id' is invalid: {exc}",
            fix=f"set eos_token_id in {GENERATION_CONFIG_FILE} to a token id or a list of ids",
        ) from exc

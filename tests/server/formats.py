"""Chat templates that teach each tool-call format, tiny checkpoints that ship them,
and a scripted stand-in for the generation worker.

The templates are written for these tests (ChatML turns; tools described in
the system turn; earlier calls and tool results rendered in each format's
own syntax) and carry the markers the format is recognised by. Every
checkpoint's tokenizer has its format's markers as added tokens, so they
encode as one token each, as in the published models.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

import mlx_loom
from mlx_loom.serve.worker import END, Job, Piece
from mlx_loom.testing.checkpoints import write_checkpoint
from mlx_loom.testing.tokenizer import write_tokenizer

_SKELETON = r"""
{%- set ns = namespace(system='') -%}
{%- if messages[0].role == 'system' -%}{%- set ns.system = messages[0].content -%}{%- endif -%}
{%- if tools or ns.system -%}
{{ '<|im_start|>system\n' + ns.system }}
{%- if tools -%}@TOOLS@{%- endif -%}
{{ '<|im_end|>\n' }}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{ '<|im_start|>assistant\n' }}
{%- if m.reasoning_content -%}{{ '@TS@\n' + m.reasoning_content + '\n@TE@\n\n' }}{%- endif -%}
{{ m.content or '' }}
{%- for tool_call in m.tool_calls or [] -%}
{%- if tool_call.function -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
@CALL@
{%- endfor -%}
{{ '<|im_end|>\n' }}
{%- elif m.role == 'tool' -%}
{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- elif m.role != 'system' -%}
{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking -%}{{ '@TS@\n' }}
{%- elif enable_thinking is defined -%}{{ '@TS@\n\n@TE@\n\n' }}{%- endif -%}
{%- endif -%}
"""

_TOOLS = (
    r"""{{ '\n\n# Tools\n<tools>' }}{%- for tool in tools -%}{{ '\n' + (tool | tojson) }}"""
    r"""{%- endfor -%}{{ '\n</tools>' }}"""
)


def _args(separator: str, pair: str) -> str:
    """Jinja that renders ``tool_call.arguments`` as ``key<pair>value`` items."""
    return (
        "{%- for key, value in tool_call.arguments | items -%}"
        f"{{{{ ('{separator}' if not loop.first else '') + {pair} }}}}"
        "{%- endfor -%}"
    )


_TEXT = "(value if value is string else value | tojson)"


@dataclass(frozen=True)
class Format:
    """One tool-call format as a chat template teaches it."""

    parser: str
    call: str  # Jinja for one call in an assistant turn (``tool_call`` = name + arguments)
    tokens: tuple[str, ...]  # markers, added to the vocabulary
    think: tuple[str, str] = ("<think>", "</think>")
    tools: str = _TOOLS

    @property
    def template(self) -> str:
        return (
            _SKELETON.replace("@TOOLS@", self.tools)
            .replace("@CALL@", self.call)
            .replace("@TS@", self.think[0])
            .replace("@TE@", self.think[1])
        )

    def write(self, path: Path, *, call_text: str = "") -> None:
        """Give the checkpoint at ``path`` this format's template and marker tokens."""
        add_tokens(path, (*self.tokens, *self.think_tokens))
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = self.template
        config_path.write_text(json.dumps(config, indent=2))

    @property
    def think_tokens(self) -> tuple[str, ...]:
        if self.think[0] == "<|channel>thought":
            return ("<|channel>", "<channel|>")
        return self.think


FORMATS: dict[str, Format] = {
    "json_tools": Format(
        parser="json_tools",
        call=r"""{{ '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' """
        r"""+ (tool_call.arguments | tojson) + '}\n</tool_call>' }}""",
        # "_" is not in the trained test vocabulary; function names hold it.
        tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "_"),
        tools=_TOOLS
        + r"""{{ '\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>' }}""",
    ),
    "qwen3_coder": Format(
        parser="qwen3_coder",
        call=r"""{{ '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}"""
        + _args("", r"'<parameter=' + key + '>\n' + " + _TEXT + r" + '\n</parameter>\n'")
        + r"""{{ '</function>\n</tool_call>' }}""",
        # The trained test vocabulary lacks '<', '>' and '_': the call's markup is added
        # whole, so a forced call can be held to the format's grammar.
        tokens=(
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
            "<function=",
            "<parameter=",
            "</parameter>",
            "</function>",
            ">",
            "_",
        ),
    ),
    "gemma4": Format(
        parser="gemma4",
        call="{{ '<|tool_call>call:' + tool_call.name + '{' }}"
        + _args(
            ",",
            """key + ':' + ('<|"|>' + value + '<|"|>' if value is string else """
            """value | tojson)""",
        )
        + "{{ '}<tool_call|>' }}",
        tokens=(
            "<|tool_call>",
            "<tool_call|>",
            '<|"|>',
            "<tool_response>",
            "</tool_response>",
            "_",
        ),
        think=("<|channel>thought", "<channel|>"),
    ),
    "minicpm5": Format(
        parser="minicpm5",
        call="""{{ '<function name="' + tool_call.name + '">' }}"""
        + _args("", """'<param name="' + key + '">' + """ + _TEXT + """ + '</param>'""")
        + "{{ '</function>' }}",
        # The trained test vocabulary lacks '<', '>' and '_': the call's markup is added
        # whole, so a constrained call can be written.
        tokens=(
            "<tool_response>",
            "</tool_response>",
            "<function name=",
            '<param name="',
            '">',
            "</param>",
            "</function>",
            "_",
        ),
    ),
    "pythonic": Format(
        parser="pythonic",
        call="{{ '<|tool_call_start|>[' + tool_call.name + '(' }}"
        + _args(", ", "key + '=' + (value | tojson)")
        + "{{ ')]<|tool_call_end|>' }}",
        tokens=(
            "<|tool_call_start|>",
            "<|tool_call_end|>",
            "<|tool_list_start|>",
            "<|tool_list_end|>",
            "<tool_response>",
            "</tool_response>",
            "_",
        ),
        tools=r"""{{ '\n<|tool_list_start|>' + (tools | tojson) + '<|tool_list_end|>' }}""",
    ),
    "mistral": Format(
        parser="mistral",
        call="{{ '[TOOL_CALLS]' + tool_call.name + '[ARGS]' + (tool_call.arguments | tojson) }}",
        tokens=("[TOOL_CALLS]", "[ARGS]", "<tool_response>", "</tool_response>", "_"),
    ),
}

#: What a model that calls get_weather(city="Paris", days=2) writes, per format.
#: The days argument is text where the format writes text; the tool's schema
#: makes it the integer 2.
SCRIPTED_CALLS = {
    "json_tools": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 2}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>',
    "minicpm5": '<function name="get_weather"><param name="city">Paris</param>'
    '<param name="days">2</param></function>',
    "pythonic": '<|tool_call_start|>[get_weather(city="Paris", days=2)]<|tool_call_end|>',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}',
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

#: Ids the trained test tokenizer may use; the rest of the vocabulary is room
#: for the marker tokens.
_TRAINED_VOCAB = 224


def add_tokens(path: Path, tokens: tuple[str, ...]) -> None:
    """Retrain the checkpoint's tokenizer smaller and add ``tokens`` as single tokens."""
    write_tokenizer(path, _TRAINED_VOCAB)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in dict.fromkeys(tokens)])
    tok.save(str(path / "tokenizer.json"))


def write_format_checkpoint(path: Path, fmt: Format, *, model_type: str = "llama") -> Path:
    """A tiny random-weight checkpoint of ``model_type`` whose template uses ``fmt``.

    Its context is at least 4096 tokens: tool schemas make long prompts.
    """
    claim = mlx_loom.default_host().registry.model_types[model_type]
    config = dict(claim.tiny_config)
    if "max_position_embeddings" in config:
        config["max_position_embeddings"] = max(config["max_position_embeddings"], 4096)
    write_checkpoint(path, config, claim.checkpoint_tensors(config), tokenizer=True)
    fmt.write(path)
    return path


class ScriptedWorker:
    """Stands in for the generation worker: answers each job with the next scripted reply.

    A reply is ``(text, finish_reason)``; its text arrives in pieces of
    ``chunk`` characters, so markers are split across pieces as they are
    when a model writes them token by token. ``delay`` (seconds per piece)
    feeds them from a thread, checking for cancellation, like a real
    generation. ``jobs`` records every job submitted.
    """

    def __init__(self, *, chunk: int = 3, delay: float = 0.0) -> None:
        self.replies: queue.Queue[tuple[str, str]] = queue.Queue()
        self.jobs: list[Job] = []
        self.chunk = chunk
        self.delay = delay
        self.busy = False
        self.queued = 0
        self.alive = True

    def clear(self) -> None:
        """Forget replies no request took (one refused before generating leaves its own)."""
        self.replies = queue.Queue()

    def script(self, *replies: str | tuple[str, str]) -> None:
        for reply in replies:
            self.replies.put(reply if isinstance(reply, tuple) else (reply, "stop"))

    def submit(self, job: Job) -> None:
        self.jobs.append(job)
        try:
            text, finish = self.replies.get_nowait()
        except queue.Empty:
            text, finish = "(no scripted reply)", "stop"
        pieces = [text[i : i + self.chunk] for i in range(0, len(text), self.chunk)] or [""]
        if self.delay:
            threading.Thread(target=self._feed, args=(job, pieces, finish), daemon=True).start()
        else:
            self._feed(job, pieces, finish)

    def _feed(self, job: Job, pieces: list[str], finish: str) -> None:
        for n, text in enumerate(pieces, start=1):
            if job.cancelled:
                break
            last = n == len(pieces)
            job.events.put(
                Piece(
                    text=text,
                    token=0,
                    logprob=0.0,
                    top_logprobs=[],
                    prompt_tokens=len(job.prompt),
                    generation_tokens=n,
                    cached_tokens=0,
                    finish_reason=finish if last else None,
                )
            )
            if self.delay:
                time.sleep(self.delay)
        job.events.put(END)

    def close(self) -> None:
        self.alive = False


def scripted(server, **options: Any) -> ScriptedWorker:
    """Replace ``server``'s generation worker by a :class:`ScriptedWorker`."""
    server.app.worker.close()
    worker = ScriptedWorker(**options)
    server.app.worker = worker
    return worker

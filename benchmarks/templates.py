"""What the template budget costs: render time with and without it, on real chat templates.

Usage::

    python benchmarks/templates.py DIR [DIR ...] [--messages 40] [--repeat 200]

Every ``*.jinja`` file under the directories is rendered with a conversation
of ``--messages`` alternating user/assistant messages (each ~400 characters,
a system message first when the template accepts one), ``--repeat`` times,
interleaved, in two environments built from the same options, globals and
filters:

* ``stock``: jinja2's ``ImmutableSandboxedEnvironment`` (what mlx-loom used
  before templates were budgeted, and what transformers uses);
* ``budgeted``: :class:`mlx_loom.text.ChatTemplate` as it renders in the
  engine (time and size budget active).

It prints one row per template (median microseconds per render, the ratio)
and checks that both environments render identical text. Templates that
refuse the conversation in both environments are listed as skipped.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlx_loom.errors import TokenizerError
from mlx_loom.text import chat_template as ct


def stock_environment() -> jinja2.Environment:
    """The engine's template environment on jinja's stock sandbox (no budget)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[ct._GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = ct._tojson
    env.globals.update(
        raise_exception=ct._raise_exception,
        strftime_now=ct._strftime_now,
        namespace=ct._TemplateNamespace,
        dict=ct._TemplateDict(),
    )
    return env


def conversation(n: int, system: bool) -> list[dict[str, str]]:
    text = "The quick brown fox jumps over the lazy dog. " * 9
    out = [{"role": "system", "content": "You are a helpful assistant."}] if system else []
    for i in range(n):
        out.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {text}"})
    if out[-1]["role"] == "assistant":
        out.append({"role": "user", "content": "and then?"})
    return out


SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
VARIABLES = {**SPECIAL, "add_generation_prompt": True, "tools": None, "documents": None}


def render_stock(template: jinja2.Template, messages: list[dict[str, str]]) -> str:
    """What ChatTemplate.render did before budgets: normalise the messages, then render."""
    return template.render(messages=ct.normalize_messages(messages), **VARIABLES)


def render_budgeted(template: ct.ChatTemplate, messages: list[dict[str, str]]) -> str:
    return template.render(messages, add_generation_prompt=True, special_tokens=SPECIAL)


def median_us(first, second, repeat: int) -> tuple[float, float]:
    """Median microseconds of each, the two calls interleaved so load noise hits both."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for fn, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e6, statistics.median(times[1]) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--messages", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args(argv)

    files = sorted(p for d in args.dirs for p in d.rglob("*.jinja"))
    stock = stock_environment()
    rows, skipped = [], []
    for path in files:
        source = path.read_text(encoding="utf-8")
        budgeted = ct.ChatTemplate(source, origin=str(path))
        plain = stock.from_string(source)
        before = functools.partial(render_stock, plain)
        after = functools.partial(render_budgeted, budgeted)
        for system in (True, False):
            messages = conversation(args.messages, system)
            try:
                want, got = before(messages), after(messages)
            except (jinja2.TemplateError, TokenizerError, TypeError):
                continue
            break
        else:
            skipped.append(path.name)
            continue
        assert got == want, f"{path}: the budgeted render differs from the stock render"
        t_stock, t_budget = median_us(
            functools.partial(before, messages), functools.partial(after, messages), args.repeat
        )
        rows.append((path.name, len(source), len(got), t_stock, t_budget))

    print(f"{len(rows)} templates, {args.messages} messages, median of {args.repeat} renders\n")
    print("| template | source chars | output chars | stock us | budgeted us | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, src, out, a, b in rows:
        print(f"| {name} | {src} | {out} | {a:.0f} | {b:.0f} | {b / a:.2f} |")
    if rows:
        ratios = [b / a for *_, a, b in rows]
        print(f"\nmedian ratio {statistics.median(ratios):.2f}, max {max(ratios):.2f}")
    if skipped:
        print(f"skipped (refuse this conversation in both): {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

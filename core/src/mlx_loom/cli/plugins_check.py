"""``loom plugins check NAME``: run the conformance suite against one installed plugin.

Prints one line per check (``PASS name — detail``, ``FAIL ...``, ``SKIP ...``)
and a summary. Exit codes: 0 when every check passes, 1 when any fails, 3
(a refusal) when the plugin is not installed, blocked by the plugin policy,
or quarantined — with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..host import PluginHost
from ..host._advice import allow_plugin_fix, quarantine_fix

EXIT_OK, EXIT_FAILED, EXIT_UNAVAILABLE = 0, 1, 3


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "check",
        help="run the conformance suite against an installed plugin",
        description="Check one installed plugin against the core's contracts: hooks, "
        "registrations, collisions, construction from a tiny checkpoint, forward shapes, the "
        "cache protocol for each declared capability, determinism, batching, weight coverage "
        "and kernel refusals. Exit 0 only when every check passes.",
    )
    parser.add_argument("name", help="the plugin's name (its entry-point name)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    from ..testing.conformance import run_conformance  # start-up: the kit imports pytest

    # Respect the host as this environment builds it: a plugin it blocks or
    # quarantines (a collision with another installed plugin among the causes)
    # is reported as such, not checked alone behind the user's back.
    host = PluginHost()
    record = host.record(args.name)
    if record is not None and record.status == "blocked":
        return _unavailable(
            args,
            f"plugin {args.name!r} is {record.reason}",
            allow_plugin_fix(args.name, host.policy),
        )
    if record is not None and record.status == "quarantined":
        return _unavailable(
            args,
            f"plugin {args.name!r} ({record.distribution} {record.version}) is quarantined: "
            f"{record.reason}",
            quarantine_fix(record, host),
        )
    report = run_conformance(args.name)
    if not report.available:
        reason = report.results[0].detail if report.results else "unavailable"
        fix = (
            f"pip install the package that provides {args.name!r}"
            if record is None
            else "fix or reinstall it (`loom plugins --traceback` shows the cause)"
        )
        return _unavailable(args, reason, fix)
    if args.json:
        print(
            json.dumps(
                {
                    "plugin": report.plugin,
                    "passed": report.passed,
                    "checks": [
                        {"name": r.name, "status": r.status, "detail": r.detail}
                        for r in report.results
                    ],
                    "seconds": round(report.seconds, 3),
                },
                indent=2,
            )
        )
    else:
        for result in report.results:
            print(result.line(), flush=True)
        print(report.summary())
    return EXIT_OK if report.passed else EXIT_FAILED


def _unavailable(args: argparse.Namespace, reason: str, fix: str) -> int:
    if args.json:
        print(
            json.dumps(
                {
                    "plugin": args.name,
                    "passed": False,
                    "error": reason,
                    "fix": fix,
                    "exit_code": EXIT_UNAVAILABLE,
                },
                indent=2,
            )
        )
    else:
        print(f"loom: refused: {reason}", file=sys.stderr)
        print(f"fix: {fix}", file=sys.stderr)
    return EXIT_UNAVAILABLE

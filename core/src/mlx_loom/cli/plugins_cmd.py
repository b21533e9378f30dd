"""``loom plugins``: what is installed, loaded, quarantined or blocked.

Sub-commands: ``loom plugins check NAME`` (the conformance suite, see
:mod:`.plugins_check`) and ``loom plugins new NAME --path DIR`` (a new plugin
package from the template, see :mod:`.plugins_new`). Plain ``loom plugins``
lists the plugins.
"""

from __future__ import annotations

import argparse
import json

from ..host import PluginHost, PluginRecord
from ..host._advice import install_command


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plugins",
        help="list discovered plugins and what they register",
        description="List every discovered plugin: name, distribution and version, status "
        "(loaded / quarantined with the reason / blocked by policy) and its registrations.",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--traceback", action="store_true", help="show quarantined plugins' tracebacks"
    )
    parser.set_defaults(handler=run, _parser=parser)
    from . import plugins_check, plugins_new  # start-up: only the subcommand run

    actions = parser.add_subparsers(dest="plugins_command", metavar="ACTION", required=False)
    plugins_check.register(actions)
    plugins_new.register(actions)


def run(args: argparse.Namespace) -> int:
    host = PluginHost()
    if args.json:
        payload = {
            "policy": host.policy.model_dump(mode="json"),
            "plugins": [r.to_dict() for r in host.records],
            "registry_error": host.registry_error.to_dict() if host.registry_error else None,
        }
        print(json.dumps(payload, indent=2, sort_keys=True))
        return 0
    if not host.records:
        print("No mlx-loom plugins are installed.")
        print(f"Install a model family, e.g.: {install_command('minicpm5', 'mlx-loom-minicpm5')}")
        return 0
    print(f"plugin policy: {host.policy.describe()}")
    for record in host.records:
        print(_describe(record, with_traceback=args.traceback))
    if host.registry_error is not None:
        print(f"\nregistry conflict: {host.registry_error.message}")
        print(f"fix: {host.registry_error.fix}")
    return 0


def _describe(record: PluginRecord, *, with_traceback: bool) -> str:
    head = f"{record.name}  {record.distribution} {record.version}  {record.status}"
    lines = [head]
    if record.status != "loaded":
        lines.append(f"  reason: {record.reason}")
        if with_traceback and record.traceback:
            lines.extend("  | " + line for line in record.traceback.rstrip().splitlines())
        return "\n".join(lines)
    lines.append(f"  plugin API: {record.api_version}")
    for kind, names in record.registers.items():
        lines.append(f"  {kind.replace('_', ' ')}: {', '.join(names) if names else '-'}")
    return "\n".join(lines)

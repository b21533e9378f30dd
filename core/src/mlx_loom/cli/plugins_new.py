"""``loom plugins new NAME --path DIR``: write a working out-of-tree plugin package.

The package is rendered from the template files shipped in
``mlx_loom/testing/template`` (``*.tmpl``, placeholders ``__NAME__``,
``__CLASS__`` (the name in CamelCase, as in ``__CLASS__Config``),
``__PACKAGE__``, ``__DIST__``, ``__CORE_VERSION__``). It installs with
``pip install DIR``, is discovered by ``loom plugins``, claims checkpoints
whose ``model_type`` is ``NAME``, and passes ``loom plugins check NAME`` and
its own tests as written — the starting point an author then reshapes.
"""

from __future__ import annotations

import argparse
import keyword
import re
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from .. import __version__
from ..errors import RequestError
from ..host import PluginHost

TEMPLATE_PACKAGE = "mlx_loom.testing"
TEMPLATE_DIR = "template"
SUFFIX = ".tmpl"
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def _core_version() -> str:
    # A source tree reports "0.0.0+unknown"; a floor of 0 is then the honest pin.
    return __version__.split("+")[0] if "+" not in __version__ else "0"


def check_name(name: str) -> str:
    if not _NAME.match(name) or keyword.iskeyword(name) or name.endswith("_"):
        raise RequestError(
            f"Plugin name {name!r} is not usable: it becomes the entry-point name, the "
            "model_type it claims and part of the import package name.",
            fix="Use lowercase letters, digits and underscores, starting with a letter "
            "(e.g. 'mydecoder').",
        )
    return name


def placeholders(name: str) -> dict[str, str]:
    return {
        "__PACKAGE__": f"mlx_loom_{name}",
        "__DIST__": f"mlx-loom-{name.replace('_', '-')}",
        "__CORE_VERSION__": _core_version(),
        "__CLASS__": "".join(part.capitalize() for part in name.split("_")),
        "__NAME__": name,
    }


def _render(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace(key, value)
    return text


def _walk(node: Traversable, prefix: tuple[str, ...] = ()):
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.is_dir():
            if child.name != "__pycache__":
                yield from _walk(child, (*prefix, child.name))
        elif child.name.endswith(SUFFIX):
            yield (*prefix, child.name.removesuffix(SUFFIX)), child


def write_plugin_package(name: str, path: str | Path) -> list[Path]:
    """Render the template for plugin ``name`` into ``path``; return the files written.

    ``path`` must not exist or be an empty directory: an existing project is
    never overwritten.
    """
    check_name(name)
    root = Path(path)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise RequestError(
            f"{root} already exists and is not an empty directory.",
            fix="Pass --path to a new (or empty) directory.",
        )
    values = placeholders(name)
    written = []
    for parts, source in _walk(files(TEMPLATE_PACKAGE) / TEMPLATE_DIR):
        target = root.joinpath(*(_render(p, values) for p in parts))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_render(source.read_text(encoding="utf-8"), values), encoding="utf-8")
        written.append(target)
    return written


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "new",
        help="write a new plugin package from the template",
        description="Write a working out-of-tree plugin package for a model family NAME "
        "(pyproject with the entry point, a small decoder graph, loader and profile, and tests "
        "that use the conformance kit).",
    )
    parser.add_argument("name", help="plugin name: also the model_type it claims")
    parser.add_argument("--path", required=True, help="directory to create (must be new or empty)")
    parser.set_defaults(handler=run, _parser=parser)


def refuse_claimed_model_type(name: str) -> None:
    """Refuse ``name`` when an installed plugin already claims it as a model type.

    The new plugin claims the model type ``name``; installed beside a plugin
    that claims it too, the host quarantines both (and the other family's
    checkpoints stop loading).
    """
    for record in PluginHost().records:
        if name in record.registers.get("model_types", ()):
            raise RequestError(
                f"model_type {name!r} is already claimed by plugin {record.name!r} "
                f"({record.distribution}): a plugin claiming it too would quarantine both.",
                fix=f"Choose another name (e.g. '{name}_custom'); to tune how {name!r} "
                "checkpoints run, write an implementation-only plugin (docs/plugin-authors.md).",
            )


def run(args: argparse.Namespace) -> int:
    check_name(args.name)
    refuse_claimed_model_type(args.name)
    written = write_plugin_package(args.name, args.path)
    root = Path(args.path)
    values = placeholders(args.name)
    print(f"wrote {values['__DIST__']} ({len(written)} files) in {root}:")
    for file in written:
        print(f"  {file.relative_to(root)}")
    print("next:")
    print(f"  pip install -e {root}")
    print(f"  loom plugins check {args.name}")
    print(f"  cd {root} && pytest")
    return 0

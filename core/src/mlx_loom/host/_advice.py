"""Fixes that depend on how this installation is set up, so that they are true here.

A refusal's fix is only useful if the user can run it. "pip install
mlx-loom-minicpm5" works once the families are on a package index, but not
for someone who installed the core from a clone of the repository or from a
wheel — they need the plugin from the same place. pip records where a
distribution came from in ``direct_url.json`` (PEP 610); we read it and name
the matching command:

* an (editable) install from a directory: the family's directory next to it,
  ``pip install [-e] <checkout>/plugins/<family>``;
* a wheel file: the family's wheel beside it if there is one, else how to
  build it;
* an index (no ``direct_url.json``): ``pip install <distribution>``.

The plugin policy's fix likewise depends on the policy's form: a deny list
(``-name``) is fixed by removing the entry, an allow list by adding the name.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from ..bounded_json import parse_json
from ..errors import LoomError
from ._policy import POLICY_ENV, PluginPolicy

if TYPE_CHECKING:  # the plugin host imports this module
    from ._discovery import PluginHost, PluginRecord

__all__ = ["allow_plugin_fix", "install_command", "quarantine_fix"]

CORE_DISTRIBUTION = "mlx-loom"


def _core_origin() -> tuple[Path, bool] | None:
    """Where pip installed the core from, and whether editable; ``None`` for an index."""
    try:
        text = metadata.distribution(CORE_DISTRIBUTION).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    try:  # pip wrote it, but it is a file on disk like any other: parse it bounded
        data = parse_json(text, source="direct_url.json", error=LoomError, fix="")
    except LoomError:
        return None
    if not isinstance(data, dict):
        return None
    url = urlparse(str(data.get("url", "")))
    if url.scheme != "file":
        return None
    editable = bool((data.get("dir_info") or {}).get("editable"))
    return Path(unquote(url.path)), editable


def install_command(plugin: str, distribution: str) -> str:
    """The command that installs family ``plugin`` (``distribution``) the way the core was."""
    origin = _core_origin()
    if origin is not None:
        path, editable = origin
        if path.is_dir():
            source = path.parent / "plugins" / plugin
            if (source / "pyproject.toml").is_file():
                return f"pip install {'-e ' if editable else ''}{source}"
        elif path.suffix == ".whl":
            stem = distribution.replace("-", "_")
            wheels = sorted(path.parent.glob(f"{stem}-*.whl"))
            if wheels:
                return f"pip install {wheels[-1]}"
            return (
                f"pip install {distribution} from the index or wheel it is published in; to "
                f"build its wheel, run `pip wheel --no-deps plugins/{plugin}` in a clone of "
                "the mlx-loom repository"
            )
    return f"pip install {distribution}"


def allow_plugin_fix(name: str, policy: PluginPolicy) -> str:
    """How to let ``policy`` load plugin ``name`` (which it currently blocks)."""
    if policy.mode == "deny":
        rest = ",".join(f"-{n}" for n in sorted(policy.names - {name}))
        how = f"set {POLICY_ENV}={rest}" if rest else f"it is the only entry, so unset {POLICY_ENV}"
        return f"Remove '-{name}' from {POLICY_ENV} ({how}), or from the host's deny policy."
    if policy.mode == "none":
        return f"Set {POLICY_ENV}={name} (it is empty, which allows no plugin), or unset it."
    allowed = ",".join(sorted(policy.names | {name}))
    return f"Add {name!r} to {POLICY_ENV} (e.g. {POLICY_ENV}={allowed}) or to the host's policy."


def quarantine_fix(record: PluginRecord, host: PluginHost) -> str:
    """How to get quarantined plugin ``record`` loaded again.

    A plugin quarantined for colliding with others is not broken: one of the
    colliding plugins has to go (uninstalled, or disallowed by the policy).
    Any other quarantine is the plugin's own fault.
    """
    if not record.conflicts_with:
        return (
            f"Fix or reinstall {record.distribution} (`loom plugins --json` shows the traceback)."
        )
    others = [host.record(n) for n in record.conflicts_with]
    dists = [o.distribution for o in others if o is not None] or list(record.conflicts_with)
    policy = host.policy
    partner = record.conflicts_with[0]
    if policy.mode == "allow":
        kept = ",".join(sorted(policy.names - {partner})) or '""'
        disallow = f"{POLICY_ENV}={kept}"
    else:
        denied = sorted(policy.names | {partner}) if policy.mode == "deny" else [partner]
        disallow = f"{POLICY_ENV}={','.join('-' + n for n in denied)}"
    return (
        f"Uninstall or disallow one of them: `pip uninstall {' '.join(dists)}` (or "
        f"`pip uninstall {record.distribution}`), or set {disallow} to load "
        f"{record.name!r} without {partner!r}."
    )

"""Turn what a user typed (``./my-model``, ``org/name``, ``org/name@rev``) into a directory.

Resolution order, and why:

1. Something that exists on disk is a local model, even if it also looks like
   a repo id or a short name: the user's files win over everything else.
2. A short name (:data:`SHORT_NAMES`: ``tiny`` for the bundled model) is the
   model shipped with the core. A bare word is never a repo id (those need
   ``org/name``), so short names cannot shadow anything on the Hub.
3. A Hugging Face repo id is looked up in the local hub cache first, with
   ``local_files_only=True``, so a cached model never touches the network.
4. Not cached and ``HF_HUB_OFFLINE`` set: refuse at once with the command that
   fixes it. We read the variable when called (``huggingface_hub`` reads it
   once at import), so a host that sets it later is still honoured and we
   never sit on a network timeout.
5. Otherwise download only what the engine reads — config, tokenizer files,
   chat templates, safetensors and their index — never pickles or code.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

from mlx_loom.artifacts.config import CONFIG_FILE
from mlx_loom.assets import BUNDLED_MODEL, BUNDLED_MODEL_ALIAS, BUNDLED_MODEL_NAME
from mlx_loom.errors import ConfigError, ModelNotFound

__all__ = [
    "ALLOW_PATTERNS",
    "SHORT_NAMES",
    "hub_cache_dir",
    "hub_command",
    "hub_offline",
    "parse_repo_ref",
    "resolve_model_ref",
]

#: Model references that name a model shipped with the core, and where it is.
SHORT_NAMES: dict[str, Path] = {
    BUNDLED_MODEL_ALIAS: BUNDLED_MODEL,
    BUNDLED_MODEL_NAME: BUNDLED_MODEL,
}

#: The files a download fetches: what the engine reads, and nothing executable.
ALLOW_PATTERNS = (
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
)

# Hub naming rules: alphanumerics, '-', '_', '.'; no leading/trailing '-' or '.',
# no '--' or '..'. The org part is mandatory here: a bare name is too easily a typo
# of a local path.
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REVISION = r"[A-Za-z0-9][A-Za-z0-9._/-]*"
_REPO_RE = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>{_REVISION}))?$")
_TRUE = {"1", "on", "yes", "true"}


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def hub_offline() -> bool:
    """Whether the host forbids hub traffic, read from the environment now."""
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def hub_cache_dir() -> Path:
    """The hub cache, resolved from the environment now (same precedence as huggingface_hub)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(os.path.expanduser(explicit)))
    home = os.environ.get("HF_HOME")
    if home:
        base = Path(os.path.expandvars(os.path.expanduser(home)))
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = Path(xdg) / "huggingface"
    return base / "hub"


def hub_command(action: str) -> str:
    """The Hub CLI command for ``action`` (``"download"``, ``"login"``) as installed here.

    huggingface_hub 0.34 replaced ``huggingface-cli`` with ``hf`` (and moved
    login under ``hf auth``); a fix must name the command the user has.
    """
    major, minor = (int(p) for p in re.findall(r"\d+", huggingface_hub.__version__)[:2])
    if (major, minor) >= (0, 34):
        return {"login": "hf auth login"}.get(action, f"hf {action}")
    return f"huggingface-cli {action}"


def parse_repo_ref(ref: str) -> tuple[str, str | None] | None:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; ``None`` if not a repo id."""
    match = _REPO_RE.match(ref)
    if match is None:
        return None
    repo = match["repo"]
    revision = match["revision"]
    if "--" in repo or ".." in repo or (revision and ".." in revision):
        return None
    return repo, revision


def _checked_dir(path: Path, *, what: str) -> Path:
    if not path.is_dir():
        raise ModelNotFound(
            f"{what} {path} is a file, not a model directory",
            fix=f"pass the directory that contains {CONFIG_FILE}",
        )
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(
            f"{what} {path} has no {CONFIG_FILE}",
            fix=f"pass a model directory that contains {CONFIG_FILE} "
            "(and its *.safetensors and tokenizer files)",
        )
    return path


def resolve_model_ref(ref: str | os.PathLike[str]) -> Path:
    """Resolve a model reference to a local directory holding ``config.json``.

    Raises :class:`ModelNotFound` when nothing matches and :class:`ConfigError`
    when the directory has no ``config.json``.
    """
    if not isinstance(ref, str):
        path = Path(ref).expanduser()
        if not path.exists():
            raise ModelNotFound(
                f"model directory {path} does not exist",
                fix="check the path, or pass a Hugging Face repo id such as org/name",
            )
        return _checked_dir(path, what="model directory")

    path = Path(ref).expanduser()
    if ref and path.exists():
        return _checked_dir(path, what="model directory")
    if ref in SHORT_NAMES:
        return _checked_dir(SHORT_NAMES[ref], what=f"bundled model {ref!r},")

    parsed = parse_repo_ref(ref)
    if parsed is None:
        names = ", ".join(repr(n) for n in SHORT_NAMES)
        raise ModelNotFound(
            f"model {ref!r} is neither an existing directory, a short name ({names}) "
            "nor a Hugging Face repo id",
            fix="pass a model directory that exists, a repo id such as org/name "
            "(optionally org/name@revision), or a short name; `loom models` lists the "
            "models on this machine",
        )
    repo_id, revision = parsed
    shown = repo_id if revision is None else f"{repo_id}@{revision}"
    cache_dir = hub_cache_dir()

    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=True,
            allow_patterns=list(ALLOW_PATTERNS),
        )
        return _checked_dir(Path(snapshot), what=f"cached snapshot of {shown},")
    except IncompleteSnapshotError:
        cached = "only partly in the local hub cache"
    except (LocalEntryNotFoundError, FileNotFoundError):
        cached = "not in the local hub cache"
    except ValueError as err:  # HFValidationError and friends
        raise ModelNotFound(f"model {shown!r}: {err}", fix="check the repo id") from err

    download = f"{hub_command('download')} {repo_id}"
    if revision:
        download += f" --revision {revision}"
    if hub_offline():
        raise ModelNotFound(
            f"model {shown} is not a local directory, is {cached} ({cache_dir}), "
            "and HF_HUB_OFFLINE is set",
            fix=f"run `{download}` on a connected machine (same HF_HOME/HF_HUB_CACHE), "
            "or unset HF_HUB_OFFLINE to let mlx-loom download it",
        )
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=list(ALLOW_PATTERNS),
        )
    except Exception as err:  # any hub, network or validation failure is "not found" here
        raise ModelNotFound(
            f"model {shown} could not be downloaded from the Hugging Face Hub: "
            f"{type(err).__name__}: {err}",
            fix=f"check the repo id, your network and token (`{hub_command('login')}`), "
            f"or download it with `{download}`",
        ) from err
    return _checked_dir(Path(snapshot), what=f"downloaded snapshot of {shown},")

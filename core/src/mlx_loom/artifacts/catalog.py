"""The models already on this machine: the bundled one and the Hugging Face cache.

``loom models`` starts here. Each entry carries the reference a user would
type to run it — a short name for the bundled model, ``org/name`` for the
snapshot the cache's ``main`` ref points at, ``org/name@ref`` (or
``@commit``) for any other snapshot — so every name listed resolves through
:func:`~mlx_loom.artifacts.reference.resolve_model_ref` to the same
directory, without touching the network.

The cache is read with ``huggingface_hub.scan_cache_dir``, which knows the
layout (``models--org--name/{refs,snapshots,blobs}``) and reports damaged
repositories as warnings instead of failing the whole scan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import huggingface_hub
from huggingface_hub.errors import CacheNotFound

from mlx_loom.artifacts.reference import hub_cache_dir
from mlx_loom.assets import BUNDLED_MODEL, BUNDLED_MODEL_ALIAS
from mlx_loom.errors import ArtifactError

__all__ = ["LocalModel", "local_models"]


@dataclass(frozen=True)
class LocalModel:
    """One model directory on this machine and the name that runs it."""

    name: str
    path: Path
    source: Literal["bundled", "hub-cache"]


def local_models(cache_dir: Path | None = None) -> list[LocalModel]:
    """The bundled model, then every model snapshot in the hub cache, sorted by name.

    Only directories with a ``config.json`` are listed; whether an installed
    plugin can run one is the caller's question (``loom models`` resolves each).
    """
    found = [LocalModel(BUNDLED_MODEL_ALIAS, BUNDLED_MODEL, "bundled")]
    return found + sorted(_hub_snapshots(cache_dir or hub_cache_dir()), key=lambda m: m.name)


def _hub_snapshots(cache_dir: Path) -> list[LocalModel]:
    try:
        info = huggingface_hub.scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    except (OSError, ValueError) as err:  # a file where the cache should be, no permission
        raise ArtifactError(
            f"the Hugging Face cache {cache_dir} cannot be read: {err}",
            fix="point HF_HUB_CACHE (or HF_HOME) at a readable cache directory, or unset it",
        ) from err
    found = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            snapshot = Path(revision.snapshot_path)
            if not (snapshot / "config.json").is_file():
                continue
            found.append(LocalModel(_reference(repo.repo_id, revision), snapshot, "hub-cache"))
    return found


def _reference(repo_id: str, revision: huggingface_hub.CachedRevisionInfo) -> str:
    if "main" in revision.refs:
        return repo_id
    if revision.refs:
        return f"{repo_id}@{sorted(revision.refs)[0]}"
    return f"{repo_id}@{revision.commit_hash}"

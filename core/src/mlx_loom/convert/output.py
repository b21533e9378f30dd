"""Writing a converted or fused model directory, and (optionally) uploading it.

The directory is assembled under a temporary name beside the destination and
renamed into place only when complete, so an interrupted or failed run never
leaves something that looks like a model. Contents, as ``mlx_lm.convert``
writes them:

* the weights, sharded (:func:`mlx_loom.artifacts.writer.write_weights`), with
  a progress bar over bytes while each tensor is read, transformed and written;
* ``config.json``: the source config with the new ``quantization`` (copied to
  ``quantization_config`` for the Hub's model tree), without
  ``_name_or_path`` and ``vision_config`` (the towers are not written), keys
  sorted, 4-space indented;
* the tokenizer and generation files copied byte for byte from the source
  (never ``*.py``: nothing executable is copied);
* a minimal model card (``README.md``) saying the library is MLX and naming
  the base model when it came from the Hub.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_loom.artifacts import CONFIG_FILE, hub_offline, parse_repo_ref
from mlx_loom.artifacts.staging import remove_orphans, temp_name
from mlx_loom.artifacts.writer import MAX_SHARD_BYTES, write_weights
from mlx_loom.errors import ConvertError, HubRefused

__all__ = [
    "check_destination",
    "in_checkpoint_layout",
    "check_upload",
    "copy_tokenizer_files",
    "hub_repo",
    "model_card",
    "upload",
    "write_model",
]

#: Files besides weights and config that a model directory carries.
_COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_COPIED_SUFFIXES = (".tiktoken", ".jinja")
_DROPPED_CONFIG_KEYS = ("_name_or_path", "vision_config")


#: Where mlx-lm's converter keeps a wrapper checkpoint's language model (the
#: prefixes the core's config view reads back, ``TEXT_LAYOUT``).
_WRAPPER_PREFIXES = (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))


def in_checkpoint_layout(
    tensors: dict[str, mx.array], config: dict[str, Any]
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensor names (and quantization overrides) as the written config's layout wants them.

    A family's graph holds the text model under its own names (``model.*``,
    ``lm_head``). A wrapper config (``text_config``, e.g. ``gemma4``,
    ``qwen3_5``) is written the way mlx-lm writes it, under
    ``language_model.``: mlx-lm's wrapper loaders need that, and the core's
    config view maps it back.
    """
    if not isinstance(config.get("text_config"), dict):
        return tensors, config

    def wrapped(name: str) -> str:
        for old, new in _WRAPPER_PREFIXES:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    renamed = {wrapped(name): value for name, value in tensors.items()}
    config = dict(config)
    for key in ("quantization", "quantization_config"):
        spec = config.get(key)
        if isinstance(spec, dict):
            config[key] = {
                (k if k in ("group_size", "bits", "mode") else wrapped(k + ".")[:-1]): v
                for k, v in spec.items()
            }
    return renamed, config


def check_destination(path: Path) -> None:
    """Refuse an existing destination (mlx-lm refuses too: nothing is overwritten)."""
    if path.exists():
        raise ConvertError(
            f"{path} already exists",
            fix="remove it, or choose another output path (--mlx-path / --save-path)",
        )


def check_upload(repo: str | None) -> None:
    """Refuse an upload up front when the host forbids the Hub, before any work is done."""
    if repo is not None and hub_offline():
        raise HubRefused(
            f"uploading to {repo} needs the Hugging Face Hub, and HF_HUB_OFFLINE is set",
            fix="drop --upload-repo and upload the written directory later from a connected "
            f"machine (`huggingface-cli upload {repo} PATH`), or unset HF_HUB_OFFLINE",
        )


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for file in sorted(src.iterdir()):
        if file.is_file() and (file.name in _COPIED or file.name.endswith(_COPIED_SUFFIXES)):
            shutil.copy2(file, dst / file.name)
            copied.append(file.name)
    return copied


def hub_repo(ref: str | os.PathLike[str]) -> str | None:
    """``org/name`` when ``ref`` names a Hub repo rather than a local directory."""
    if not isinstance(ref, str) or Path(ref).expanduser().exists():
        return None
    parsed = parse_repo_ref(ref)
    return parsed[0] if parsed else None


def model_card(base_model: str | None) -> str:
    lines = ["---", "library_name: mlx", "pipeline_tag: text-generation", "tags:", "- mlx"]
    if base_model:
        lines.append(f"base_model: {base_model}")
    return "\n".join([*lines, "---", ""])


def _config_text(config: dict[str, Any]) -> str:
    out = {k: v for k, v in config.items() if k not in _DROPPED_CONFIG_KEYS}
    if "quantization" in out:
        out["quantization_config"] = out["quantization"]
    return json.dumps(dict(sorted(out.items())), indent=4) + "\n"


class _Progress:
    """A byte-counting bar on stderr (tqdm), or nothing."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm  # only when a bar is shown

            self._bar = tqdm(
                total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=True
            )

    def __call__(self, name: str, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(name[-40:], refresh=False)
            self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def write_model(
    dst: Path,
    *,
    source_dir: Path,
    tensors: MutableMapping[str, mx.array],
    config: dict[str, Any],
    progress: bool = True,
    max_shard_bytes: int | None = None,
    desc: str = "writing",
    base_model: str | None = None,
) -> Path:
    """Write a complete model directory at ``dst`` (see module doc); ``tensors`` is consumed.

    ``max_shard_bytes`` ``None``: :data:`MAX_SHARD_BYTES`.
    """
    if max_shard_bytes is None:
        max_shard_bytes = MAX_SHARD_BYTES
    check_destination(dst)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        # Staging directories of a run that was killed (kill -9) are removed
        # here, by the next run to the same target (mlx_loom.artifacts.staging).
        remove_orphans(dst.parent, _staging_prefix(dst))
        staging = dst.parent / temp_name(_staging_prefix(dst))
        staging.mkdir()
    except OSError as err:
        raise _write_failed(dst, err) from None
    try:
        total = sum(int(a.nbytes) for a in tensors.values())
        bar = _Progress(total, desc, progress)
        try:
            write_weights(staging, tensors, max_shard_bytes=max_shard_bytes, on_tensor=bar)
        finally:
            bar.close()
        (staging / CONFIG_FILE).write_text(_config_text(config))
        copy_tokenizer_files(source_dir, staging)
        (staging / "README.md").write_text(model_card(base_model))
        os.replace(staging, dst)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, OSError):  # the files are written by Python (artifacts.writer)
            raise _write_failed(dst, err) from None
        raise
    return dst


def _staging_prefix(dst: Path) -> str:
    return f".{dst.name}.partial-"


def _write_failed(dst: Path, err: BaseException) -> ConvertError:
    """A write that failed (a full disk, no permission) as one clean error."""
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return ConvertError(
        f"cannot write the converted model to {str(dst)!r}: {reason} (nothing was left at "
        f"{str(dst)!r}; the partial output was removed)",
        fix="free space on that disk (the output needs about the size of the converted "
        "weights), or choose another output directory",
    )


def upload(path: Path, repo: str) -> None:
    """Upload ``path`` to the Hub repo ``repo`` (created if needed); the local copy stays."""
    check_upload(repo)
    try:
        import huggingface_hub  # start-up: only to upload

        api = huggingface_hub.HfApi()
        api.create_repo(repo_id=repo, exist_ok=True)
        api.upload_folder(folder_path=str(path), repo_id=repo, repo_type="model")
    except Exception as err:  # network, auth, validation: all one outcome here
        raise HubRefused(
            f"uploading {path} to {repo} failed: {type(err).__name__}: {err}",
            fix=f"the converted model is complete at {path}; check your network and token "
            f"(`huggingface-cli login`) and run `huggingface-cli upload {repo} {path}`",
        ) from err

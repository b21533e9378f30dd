"""Specification of model-reference resolution: local paths, the hub cache, and offline refusals.

No test touches the network: the hub cache is a fake directory tree in the
layout huggingface_hub writes, and downloads are replaced by spies.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

from mlx_loom.artifacts import (
    ALLOW_PATTERNS,
    hub_cache_dir,
    hub_command,
    parse_repo_ref,
    resolve_model_ref,
)
from mlx_loom.errors import ConfigError, ModelNotFound

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def cache_snapshot(
    cache: Path,
    repo: str,
    commit: str = COMMIT,
    ref: str | None = "main",
    files: dict[str, str] | None = None,
) -> Path:
    """Lay out ``models--org--name/{refs,snapshots}`` the way huggingface_hub does."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    if files is None:
        files = {"config.json": '{"model_type": "llama"}'}
    for name, text in files.items():
        (snapshot / name).write_text(text)
    if ref is not None:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty hub cache selected by HF_HUB_CACHE, with the hub offline."""
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    for var in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


# --- local directories ------------------------------------------------------------


def test_a_local_directory_with_config_json_resolves_to_itself(tmp_path):
    d = model_dir(tmp_path / "tiny")
    assert resolve_model_ref(str(d)) == d
    assert resolve_model_ref(d) == d


def test_a_local_directory_without_config_json_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty has no config\.json"):
        resolve_model_ref(tmp_path / "empty")


def test_a_file_is_not_a_model(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(ModelNotFound, match="is a file, not a model directory"):
        resolve_model_ref(str(f))


def test_a_missing_path_object_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model_ref(tmp_path / "nowhere")


def test_a_string_that_is_neither_a_path_nor_a_repo_id_is_named(hub):
    with pytest.raises(ModelNotFound, match=r"'not a model!' is neither an existing directory"):
        resolve_model_ref("not a model!")


def test_an_existing_directory_wins_over_a_repo_id_of_the_same_spelling(hub, tmp_path, monkeypatch):
    cache_snapshot(hub, "org/tiny")
    monkeypatch.chdir(tmp_path)
    local = model_dir(tmp_path / "org" / "tiny")
    assert resolve_model_ref("org/tiny").resolve() == local.resolve()


# --- the hub cache -----------------------------------------------------------------


def test_a_cached_repo_resolves_to_its_snapshot_without_network(hub):
    snapshot = cache_snapshot(hub, "org/tiny")
    assert resolve_model_ref("org/tiny") == snapshot


def test_hf_home_locates_the_cache_when_hf_hub_cache_is_unset(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = cache_snapshot(tmp_path / "hf" / "hub", "org/tiny")
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    assert resolve_model_ref("org/tiny") == snapshot


def test_a_revision_selects_a_branch_ref(hub):
    cache_snapshot(hub, "org/tiny")
    dev = cache_snapshot(hub, "org/tiny", commit=OTHER_COMMIT, ref="dev")
    assert resolve_model_ref("org/tiny@dev") == dev


def test_a_commit_hash_revision_selects_that_snapshot(hub):
    cache_snapshot(hub, "org/tiny")
    pinned = cache_snapshot(hub, "org/tiny", commit=OTHER_COMMIT, ref=None)
    assert resolve_model_ref(f"org/tiny@{OTHER_COMMIT}") == pinned


def test_a_cached_snapshot_without_config_json_is_a_config_error(hub):
    cache_snapshot(hub, "org/tiny", files={"tokenizer.json": "{}"})
    with pytest.raises(ConfigError, match="org/tiny"):
        resolve_model_ref("org/tiny")


def test_offline_and_uncached_fails_at_once_naming_repo_and_fix(hub, monkeypatch):
    calls: list[dict] = []
    real = huggingface_hub.snapshot_download

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    start = time.monotonic()
    with pytest.raises(ModelNotFound) as info:
        resolve_model_ref("org/absent@v2")
    assert time.monotonic() - start < 5
    assert "org/absent@v2" in info.value.message and "HF_HUB_OFFLINE" in info.value.message
    assert f"{hub_command('download')} org/absent --revision v2" in info.value.fix
    assert "unset HF_HUB_OFFLINE" in info.value.fix
    assert [c["local_files_only"] for c in calls] == [True]


def test_offline_with_a_partial_snapshot_says_it_is_incomplete(hub, monkeypatch):
    def partial(repo_id, **kwargs):
        raise IncompleteSnapshotError("1 file(s) are missing", snapshot_path=str(hub))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", partial)
    with pytest.raises(ModelNotFound, match="only partly in the local hub cache"):
        resolve_model_ref("org/tiny")


# --- downloading (spied, never real) -------------------------------------------------


def fake_hub(monkeypatch, on_download):
    calls: list[dict] = []

    def fake(repo_id, **kwargs):
        calls.append({"repo_id": repo_id, **kwargs})
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        return on_download(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return calls


def test_online_and_uncached_downloads_only_engine_files(hub, tmp_path, monkeypatch):
    target = model_dir(tmp_path / "downloaded")
    calls = fake_hub(monkeypatch, lambda repo_id, **kw: str(target))
    assert resolve_model_ref("org/tiny@main") == target
    download = calls[-1]
    assert download["repo_id"] == "org/tiny" and download["revision"] == "main"
    assert download["cache_dir"] == hub
    assert "local_files_only" not in download
    patterns = download["allow_patterns"]
    assert patterns == list(ALLOW_PATTERNS)
    assert {"*.json", "*.safetensors", "*.jinja", "tokenizer.model"} <= set(patterns)
    assert not any(p.endswith((".py", ".bin", ".pt", ".pth", ".pkl")) for p in patterns)


def test_a_hub_error_during_download_becomes_model_not_found(hub, monkeypatch):
    def boom(repo_id, **kwargs):
        raise RuntimeError("401 Client Error: repository not found")

    fake_hub(monkeypatch, boom)
    with pytest.raises(ModelNotFound) as info:
        resolve_model_ref("org/private")
    assert "org/private" in info.value.message and "401" in info.value.message
    assert hub_command("login") in info.value.fix
    assert isinstance(info.value.__cause__, RuntimeError)


# --- repo id syntax ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "parsed"),
    [
        ("org/name", ("org/name", None)),
        ("Org-1/name_2.v3", ("Org-1/name_2.v3", None)),
        ("org/name@main", ("org/name", "main")),
        ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
        ("name", None),
        ("org/", None),
        ("./org/name", None),
        ("org/na--me", None),
        ("org/name/extra", None),
        ("org/name@", None),
        ("../secrets", None),
    ],
)
def test_repo_id_syntax(ref, parsed):
    assert parse_repo_ref(ref) == parsed


@pytest.mark.parametrize(
    ("version", "download", "login"),
    [
        ("0.33.4", "huggingface-cli download", "huggingface-cli login"),
        ("0.34.0", "hf download", "hf auth login"),
        ("1.2.0.dev0", "hf download", "hf auth login"),
    ],
)
def test_hub_fixes_name_the_command_this_huggingface_hub_installs(
    version, download, login, monkeypatch
):
    monkeypatch.setattr(huggingface_hub, "__version__", version)
    assert (hub_command("download"), hub_command("login")) == (download, login)


def test_a_short_name_resolves_to_the_bundled_model_without_the_hub(hub):
    from mlx_loom import BUNDLED_MODEL

    assert resolve_model_ref("tiny") == BUNDLED_MODEL


def test_an_unknown_bare_name_lists_the_short_names(hub):
    with pytest.raises(ModelNotFound, match="short name \\('tiny', 'tiny-minicpm5'\\)") as info:
        resolve_model_ref("tinyy")
    assert "loom models" in info.value.fix

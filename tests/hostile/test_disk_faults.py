"""Faults while writing: a full disk, a writer killed mid-save, threads saving to one path.

Before: on a full disk ``PromptCache.save`` raised an untyped ``RuntimeError``
and ``loom convert`` printed a raw traceback; ``kill -9`` during a save or a
convert left temporary files and staging directories that nothing cleaned;
threads saving to one path shared a per-process temporary name and raised
spurious ``CacheError``s. The full disk is simulated without privileges by a
file-size limit (``RLIMIT_FSIZE``, with ``SIGXFSZ`` ignored): writes past it
fail exactly as on a full disk.
"""

from __future__ import annotations

import os
import threading

import mlx_loom
from mlx_loom.generation import PromptCache

from .bounded import run_bounded

_FULL_DISK = """
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
def full_disk(nbytes=4096):
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))
"""

_FILLED_CACHE = """
import mlx_loom
from mlx_loom.generation import PromptCache
model, tok = mlx_loom.load(ARGS["model"])
cache = PromptCache(model)
list(mlx_loom.stream_generate(model, tok, tok.encode("a few tokens to keep"),
                              prompt_cache=cache, max_tokens=2))
"""


def leftovers(directory, keep=()):
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


def test_a_full_disk_during_a_prompt_cache_save_is_a_cache_error(family_dirs, tmp_path):
    target = tmp_path / "c.safetensors"
    outcome = run_bounded(
        _FULL_DISK + _FILLED_CACHE + "full_disk()\ncache.save(ARGS['path'])",
        args={"model": str(family_dirs["llama"]), "path": str(target)},
        timeout_s=60,
    )
    outcome.expect_error("CacheError", "cannot write", "the disk may be full")
    assert leftovers(tmp_path) == []  # no target, no temporary


def test_a_full_disk_during_loom_convert_is_one_clean_error(family_dirs, tmp_path):
    out = tmp_path / "converted"
    outcome = run_bounded(
        _FULL_DISK
        + """
from mlx_loom.cli.main import main
full_disk(64 * 1024)
RESULT = main(["convert", "--hf-path", ARGS["model"], "--mlx-path", ARGS["out"],
               "--no-progress"])
""",
        args={"model": str(family_dirs["llama"]), "out": str(out)},
        timeout_s=90,
    )
    assert outcome.expect_ok() not in (0, None)
    assert "cannot write the converted model" in outcome.stderr, outcome.stderr
    assert "Traceback" not in outcome.stderr, outcome.stderr
    assert leftovers(tmp_path) == []  # neither the target nor a staging directory


def _killed_at_the_rename(code: str, args: dict) -> None:
    """Run ``code`` in a child that dies by SIGKILL when it tries to rename into place."""
    outcome = run_bounded(
        "import os, signal\nos.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n" + code,
        args=args,
        timeout_s=90,
    )
    assert outcome.status == "crashed", outcome.describe()


def test_a_save_killed_before_its_rename_leaves_a_temporary_the_next_save_removes(
    family_dirs, tmp_path
):
    target = tmp_path / "c.safetensors"
    args = {"model": str(family_dirs["llama"]), "path": str(target)}
    _killed_at_the_rename(_FILLED_CACHE + "cache.save(ARGS['path'])", args)
    orphans = leftovers(tmp_path)
    assert len(orphans) == 1 and orphans[0].startswith(".c.tmp-"), orphans
    # A live writer's temporary (this process's pid) is never touched.
    live = tmp_path / f".c.tmp-{os.getpid()}-0123456789ab.safetensors"
    live.write_bytes(b"being written")
    outcome = run_bounded(_FILLED_CACHE + "cache.save(ARGS['path'])", args=args, timeout_s=60)
    outcome.expect_ok()
    assert leftovers(tmp_path) == sorted([live.name, "c.safetensors"])


def test_a_convert_killed_before_its_rename_leaves_staging_the_next_convert_removes(
    family_dirs, tmp_path
):
    out = tmp_path / "converted"
    code = """
from mlx_loom.cli.main import main
main(["convert", "--hf-path", ARGS["model"], "--mlx-path", ARGS["out"], "--no-progress"])
"""
    args = {"model": str(family_dirs["llama"]), "out": str(out)}
    _killed_at_the_rename(code, args)
    staging = leftovers(tmp_path)
    assert len(staging) == 1 and staging[0].startswith(".converted.partial-"), staging
    outcome = run_bounded(code.replace("main([", "RESULT = main(["), args=args, timeout_s=90)
    assert outcome.expect_ok() == 0, outcome.stderr
    assert leftovers(tmp_path) == ["converted"]
    mlx_loom.load(out)  # and the target is a whole model


def test_threads_saving_to_one_path_never_collide(family_dirs, tmp_path):
    model, tok = mlx_loom.load(family_dirs["llama"])
    cache = PromptCache(model)
    prompt = tok.encode("shared")
    list(mlx_loom.stream_generate(model, tok, prompt, prompt_cache=cache, max_tokens=2))
    target = tmp_path / "shared.safetensors"
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def save() -> None:
        start.wait()
        try:
            for _ in range(5):
                cache.save(target)
        except BaseException as err:  # noqa: BLE001 - collected for the assertion
            errors.append(err)

    threads = [threading.Thread(target=save) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert leftovers(tmp_path) == ["shared.safetensors"]
    assert PromptCache.load(target, model).tokens == cache.tokens

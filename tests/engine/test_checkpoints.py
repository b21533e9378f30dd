"""Checkpoints in the prefix store: caches that cannot trim reuse a shared prefix exactly.

A conversation is turns closed by an end-of-turn token; prompts are long
enough (over 32 tokens a chunk) that prefill arithmetic depends on where
chunks end, so a restored checkpoint matching a fresh run bit for bit shows
the chunks line up. Every run is compared with the same request on an engine
with no store.
"""

from __future__ import annotations

import pytest

from mlx_loom.engine import Engine, EngineSettings, Speculation

from .conftest import alone, assert_same_run, drive, ids, request

EOT = 3  # stands for a chat template's end-of-turn token
NON_TRIMMING = ["qwen3_next", "qwen3_5", "gemma4_text", "gemma4", "llama-sliding"]


def msg(n: int, seed: int) -> list[int]:
    return ids(n, seed) + [EOT]


SYSTEM = msg(40, 1)
USER = msg(8, 2)
HEADER = ids(2, 3)  # the template's "assistant" header, then the model answers
FIRST = SYSTEM + USER + HEADER


def ask(model, prompt, **options):
    options.setdefault("max_tokens", 4)
    return request(model, prompt=prompt, eos=frozenset({EOT}), **options)


def turn(engine, model, prompt, **options):
    return drive(engine, {0: [("r", ask(model, prompt, **options))]})["r"]


def cold(model, prompt, **options):
    return alone(model, ask(model, prompt, **options))


def store(model, **settings):
    return Engine(model, EngineSettings(prompt_cache_size=8, **settings))


@pytest.mark.parametrize("name", NON_TRIMMING)
def test_regenerate_edit_and_follow_up_reuse_checkpoints_and_match_a_fresh_run(loaded, name):
    model, _ = loaded(name)
    engine = store(model)
    first = turn(engine, model, FIRST)
    assert first.events[0].cached_tokens == 0
    # Regenerate: the whole prompt but its last token comes from the prompt-end checkpoint.
    again = turn(engine, model, FIRST)
    assert again.events[0].cached_tokens == len(FIRST) - 1
    assert_same_run(again, cold(model, FIRST), f"{name} regenerate")
    # An edited last message: everything before it is reused.
    edited = SYSTEM + msg(8, 4) + HEADER
    run = turn(engine, model, edited)
    assert run.events[0].cached_tokens == len(SYSTEM)
    assert_same_run(run, cold(model, edited), f"{name} edit")
    # A follow-up turn: the conversation up to the last turn boundary is reused.
    follow = FIRST + first.tokens + [EOT] + msg(5, 5) + HEADER
    run = turn(engine, model, follow)
    assert run.events[0].cached_tokens == len(SYSTEM) + len(USER)
    assert run.events[0].cached_tokens >= 0.8 * (len(FIRST) + len(first.tokens))
    assert_same_run(run, cold(model, follow), f"{name} follow-up")
    assert engine.stats().prefix_checkpoint_hits == 3


def test_a_long_prompt_is_checkpointed_every_few_chunks(loaded):
    model, _ = loaded("qwen3_next")
    engine = store(model, checkpoint_chunks=2)
    long = ids(45, 7)
    turn(engine, model, long, prefill_step_size=8)
    other = long[:37] + ids(6, 8)
    run = turn(engine, model, other, prefill_step_size=8)
    assert run.events[0].cached_tokens == 32  # the checkpoints sit every 2 x 8 tokens
    assert_same_run(run, cold(model, other, prefill_step_size=8), "chunk checkpoint")


def test_a_checkpoint_is_not_served_where_the_new_prompt_would_not_end_a_chunk(loaded):
    model, _ = loaded("qwen3_next")
    engine = store(model)
    turn(engine, model, FIRST)
    # Shares FIRST's prompt-end position, but for this prompt it is no chunk end.
    longer = FIRST + ids(3, 9)
    run = turn(engine, model, longer)
    assert run.events[0].cached_tokens == len(SYSTEM) + len(USER)
    assert_same_run(run, cold(model, longer), "no mid-chunk restore")


@pytest.mark.parametrize("name", ["qwen3_next", "gemma4_text"])
def test_a_restored_row_decodes_in_a_batch_as_it_would_alone(loaded, name):
    model, _ = loaded(name)
    engine = store(model)
    turn(engine, model, FIRST)
    edited = SYSTEM + msg(6, 11) + HEADER
    fresh = ids(20, 12)
    both = [
        ("edited", ask(model, edited, max_tokens=6)),
        ("fresh", ask(model, fresh, max_tokens=6)),
    ]
    runs = drive(engine, {0: both})
    assert runs["edited"].events[0].cached_tokens == len(SYSTEM)
    assert_same_run(runs["edited"], cold(model, edited, max_tokens=6), "batched restored")
    assert_same_run(runs["fresh"], cold(model, fresh, max_tokens=6), "batched fresh")


@pytest.mark.parametrize("name", ["qwen3_next", "gemma4"])
def test_a_restored_row_decodes_speculatively_as_it_would_from_nothing(loaded, name):
    model, _ = loaded(name)
    engine = store(model)
    spec = {"speculation": Speculation(model, 3), "max_tokens": 8}
    turn(engine, model, FIRST, **spec)
    edited = SYSTEM + msg(8, 13) + HEADER
    run = turn(engine, model, edited, **spec)
    assert run.events[0].cached_tokens == len(SYSTEM)
    assert_same_run(run, cold(model, edited, **spec), "speculative restored")


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_a_restored_recurrent_row_with_quantized_attention_matches_a_fresh_run(loaded, name):
    model, _ = loaded(name)
    engine = store(model)
    options = {"kv_bits": 8, "kv_group_size": 32}
    turn(engine, model, FIRST, **options)
    edited = SYSTEM + msg(8, 15) + HEADER
    run = turn(engine, model, edited, **options)
    assert run.events[0].cached_tokens == len(SYSTEM)
    assert_same_run(run, cold(model, edited, **options), f"{name} affine8")


@pytest.mark.parametrize(
    ("options", "reused"),
    [
        ({"kv_bits": 8, "kv_group_size": 32}, len(SYSTEM)),
        # The full-attention layer turned quantized at 44, after the boundary at
        # 41: trimming it back would not give the plain cache a fresh run has there.
        ({"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 44}, 0),
        ({"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 30}, len(SYSTEM)),
        ({"kv_codec": "turboquant"}, len(SYSTEM)),
    ],
    ids=["affine8", "affine8-late", "affine8-early", "turbo4"],
)
def test_a_restored_row_in_a_kv_codec_matches_a_fresh_run(loaded, options, reused):
    model, _ = loaded("gemma4_text")
    engine = store(model)
    turn(engine, model, FIRST, **options)
    edited = SYSTEM + msg(8, 14) + HEADER
    run = turn(engine, model, edited, **options)
    assert run.events[0].cached_tokens == reused
    assert_same_run(run, cold(model, edited, **options), f"codec {options}")
    # A request in another codec never sees these caches.
    assert turn(engine, model, edited).events[0].cached_tokens == 0


def test_checkpoints_count_against_the_byte_bound_and_the_earliest_go_first(loaded):
    model, _ = loaded("qwen3_next")
    probe = store(model)
    turn(probe, model, FIRST)
    stats = probe.stats()
    assert stats.prefix_checkpoints == 3  # after the system turn, the user turn, the prompt end
    assert 0 < stats.prefix_checkpoint_bytes < stats.prefix_bytes
    per_checkpoint = stats.prefix_checkpoint_bytes // 3
    entry = stats.prefix_bytes - stats.prefix_checkpoint_bytes
    engine = store(model, prompt_cache_bytes=entry + 2 * per_checkpoint)
    turn(engine, model, FIRST)
    assert engine.stats().prefix_checkpoints == 2
    edited = SYSTEM + msg(8, 4) + HEADER  # its boundary was the earliest checkpoint: gone
    assert turn(engine, model, edited).events[0].cached_tokens == 0


# --- the disk tier ---------------------------------------------------------------


def disk_store(model, directory, **settings):
    return store(model, prompt_cache_dir=str(directory), **settings)


@pytest.mark.parametrize("name", ["qwen3_next", "gemma4", "llama"])
def test_a_restarted_engine_reuses_what_the_last_one_wrote_to_disk(loaded, tmp_path, name):
    model, _ = loaded(name)
    first_engine = disk_store(model, tmp_path)
    first = turn(first_engine, model, FIRST)
    first_engine.flush()  # what stopping the engine does
    assert first_engine.stats().prefix_disk_files > 0
    # A new engine (a restarted server): memory is empty, the directory is not.
    engine = disk_store(model, tmp_path)
    again = turn(engine, model, FIRST)
    assert again.events[0].cached_tokens == len(FIRST) - 1
    assert_same_run(again, cold(model, FIRST), f"{name} regenerate after restart")
    engine = disk_store(model, tmp_path)
    follow = FIRST + first.tokens + [EOT] + msg(5, 5) + HEADER
    run = turn(engine, model, follow)
    assert run.events[0].cached_tokens >= len(SYSTEM) + len(USER)
    if name != "llama":  # a trimmed Llama entry is the status quo, not a checkpoint
        assert_same_run(run, cold(model, follow), f"{name} follow-up after restart")
    assert engine.stats().prefix_disk_hits == 1


def test_entries_evicted_from_memory_go_to_disk_and_come_back(loaded, tmp_path):
    model, _ = loaded("qwen3_next")
    engine = store(model, prompt_cache_dir=str(tmp_path))
    engine.configure(engine.settings.model_copy(update={"prompt_cache_size": 1}))
    turn(engine, model, FIRST)
    turn(engine, model, ids(20, 30))  # evicts FIRST's entry: written to disk
    assert engine.stats().prefix_disk_files > 0
    again = turn(engine, model, FIRST)
    assert again.events[0].cached_tokens == len(FIRST) - 1
    assert_same_run(again, cold(model, FIRST), "back from disk")


def test_unusable_files_are_skipped_with_a_log_line(loaded, tmp_path, caplog):
    model, _ = loaded("qwen3_next")
    engine = disk_store(model, tmp_path)
    turn(engine, model, FIRST)
    engine.flush()
    files = sorted(tmp_path.glob("*.safetensors"))
    assert files
    for f in files:  # flip one byte near the end of each (the tensors' bytes)
        data = bytearray(f.read_bytes())
        data[-3] ^= 0xFF
        f.write_bytes(bytes(data))
    (tmp_path / "truncated.safetensors").write_bytes(files[0].read_bytes()[:100])
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    engine = disk_store(model, tmp_path)
    with caplog.at_level("WARNING", logger="mlx_loom.engine"):
        run = turn(engine, model, FIRST)
    assert run.events[0].cached_tokens == 0
    assert_same_run(run, cold(model, FIRST), "after skipping")
    skipped = [r for r in caplog.records if "skipping the prompt-cache file" in r.getMessage()]
    assert len(skipped) >= 3  # the two unreadable files and the tampered one that was tried


def test_another_models_files_are_never_used(loaded, tmp_path):
    qwen, _ = loaded("qwen3_next")
    engine = disk_store(qwen, tmp_path)
    turn(engine, qwen, FIRST)
    engine.flush()
    other, _ = loaded("qwen3_5")
    engine = disk_store(other, tmp_path)
    assert engine.stats().prefix_disk_files == 0
    assert turn(engine, other, FIRST).events[0].cached_tokens == 0


def test_the_disk_tier_keeps_to_its_byte_bound_least_recently_used_first(loaded, tmp_path):
    model, _ = loaded("qwen3_next")
    probe = disk_store(model, tmp_path / "probe")
    turn(probe, model, FIRST)
    probe.flush()
    sizes = [f.stat().st_size for f in (tmp_path / "probe").glob("*.safetensors")]
    bound = sum(sizes) + max(sizes) // 2
    engine = disk_store(model, tmp_path / "bounded", prompt_cache_disk_bytes=bound)
    turn(engine, model, FIRST)
    turn(engine, model, SYSTEM + msg(8, 21) + HEADER)
    engine.flush()
    stats = engine.stats()
    assert 0 < stats.prefix_disk_bytes <= bound
    on_disk = sum(f.stat().st_size for f in (tmp_path / "bounded").glob("*.safetensors"))
    assert on_disk == stats.prefix_disk_bytes


def test_an_unwritable_prompt_cache_directory_is_refused_where_it_is_configured(loaded, tmp_path):
    from mlx_loom.errors import CacheError

    model, _ = loaded("qwen3_next")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CacheError, match="cannot be created"):
        model.engine.configure(prompt_cache_size=4, prompt_cache_dir=str(blocker / "cache"))
    with pytest.raises(CacheError, match="cannot be created"):
        disk_store(model, blocker / "cache")


def test_a_long_history_keeps_only_its_latest_checkpoints_while_prefilling(loaded, monkeypatch):
    import mlx_loom.engine.core as core

    monkeypatch.setattr(core, "MAX_CHECKPOINTS_PER_ENTRY", 3)
    model, _ = loaded("qwen3_next")
    engine = store(model)
    history = [t for i in range(8) for t in msg(4, 40 + i)]  # eight short messages
    seen = []
    drive(
        engine,
        {0: [("r", ask(model, history + HEADER))]},
        on_step=lambda _, __: seen.extend(len(r.checkpoints) for r in engine._prefilling),
    )
    assert seen and max(seen) <= 3

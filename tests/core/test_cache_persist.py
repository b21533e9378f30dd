"""Prompt caches round-trip through .safetensors, and a file cannot name code."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlx_loom.cache import (
    CACHE_KINDS,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    kind_table,
    load_prompt_cache,
    persist,
    save_prompt_cache,
)
from mlx_loom.cache.persist import HEADER_KEY
from mlx_loom.errors import CacheError

H, D = 2, 32


def kv(step: int, L: int, B: int = 1) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((B, H, L, D), key=mx.random.key(2 * step))
    v = mx.random.normal((B, H, L, D), key=mx.random.key(2 * step + 1))
    return k, v


def filled_caches() -> list:
    caches = [
        KVCache(),
        RotatingKVCache(4, keep=1),
        QuantizedKVCache(group_size=32, bits=4),
        QuantizedRotatingKVCache(4, group_size=32, bits=8),
        BatchKVCache([1, 0]),
        BatchRotatingKVCache(4, [0, 2]),
        KVCache(),  # stays empty
    ]
    for step, L in enumerate([3, 1, 1, 1]):
        for c in caches[:4]:
            c.update_and_fetch(*kv(step, L))
        for c in caches[4:6]:
            c.update_and_fetch(*kv(step, L, B=2))
    return caches


def flat(x) -> list[mx.array]:
    return list(x) if isinstance(x, tuple) else [x]


def test_every_standard_kind_round_trips_with_metadata(tmp_path):
    caches = filled_caches()
    path = tmp_path / "prompt.safetensors"
    save_prompt_cache(path, caches, {"model": "tiny", "tokens": "6"})
    loaded, meta = load_prompt_cache(path)
    assert meta == {"model": "tiny", "tokens": "6"}
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    assert loaded[-1].empty()
    for a, b in zip(caches[:-1], loaded[:-1], strict=True):
        assert a.meta_state == b.meta_state
        ka, va = a.keys_and_values()
        kb, vb = b.keys_and_values()
        for x, y in zip(flat(ka) + flat(va), flat(kb) + flat(vb), strict=True):
            assert x.dtype == y.dtype and mx.array_equal(x, y).item()


def test_loaded_caches_continue_exactly_like_the_originals(tmp_path):
    caches = filled_caches()[:4]
    path = tmp_path / "p.safetensors"
    save_prompt_cache(path, caches)
    loaded, _ = load_prompt_cache(path)
    for a, b in zip(caches, loaded, strict=True):
        ka, _ = a.update_and_fetch(*kv(99, 1))
        kb, _ = b.update_and_fetch(*kv(99, 1))
        assert all(mx.array_equal(x, y).item() for x, y in zip(flat(ka), flat(kb), strict=True))


def write_cache_file(path, layers: list[dict], arrays: dict, metadata=None) -> None:
    """A prompt-cache file with exactly these layers and tensors, and a correct checksum."""
    header = persist._Header(
        format=persist.FORMAT,
        version=persist.FORMAT_VERSION,
        layers=layers,
        metadata=metadata or {},
        checksum="sha256:" + "0" * 64,
    )
    header = header.model_copy(update={"checksum": persist.array_checksum(header, arrays)})
    mx.save_safetensors(str(path), arrays, {HEADER_KEY: header.model_dump_json()})


def write_hostile(path, kind: str) -> None:
    arrays = {"0.0": mx.zeros((1, 1, 1, 4)), "0.1": mx.zeros((1, 1, 1, 4))}
    write_cache_file(path, [{"kind": kind, "meta_state": [], "n_arrays": 2}], arrays)


@pytest.mark.parametrize("kind", ["os.system", "ArraysCache", "__class__", "_BaseCache"])
def test_a_file_naming_an_unregistered_kind_is_refused_by_name(tmp_path, kind):
    path = tmp_path / "hostile.safetensors"
    write_hostile(path, kind)
    with pytest.raises(CacheError, match=f"names cache kind '{kind}', which is not registered"):
        load_prompt_cache(path)


def test_a_caller_table_decides_which_kinds_load(tmp_path):
    path = tmp_path / "kv.safetensors"
    save_prompt_cache(path, filled_caches()[:1])
    assert isinstance(load_prompt_cache(path, kinds=kind_table(KVCache))[0][0], KVCache)
    with pytest.raises(CacheError, match="'KVCache', which is not registered"):
        load_prompt_cache(path, kinds=kind_table(RotatingKVCache))


def test_a_file_without_the_cache_header_is_refused(tmp_path):
    path = tmp_path / "weights.safetensors"
    mx.save_safetensors(str(path), {"w": mx.zeros((2,))})
    with pytest.raises(CacheError, match="not an mlx-loom prompt cache"):
        load_prompt_cache(path)


def test_tensors_that_do_not_match_the_header_are_refused(tmp_path):
    path = tmp_path / "altered.safetensors"
    header = {
        "format": "mlx-loom-prompt-cache",
        "version": 2,
        "layers": [{"kind": "KVCache", "meta_state": [], "n_arrays": 2}],
        "metadata": {},
        "checksum": "sha256:" + "0" * 64,
    }
    arrays = {"0.0": mx.zeros((1, 1, 1, 4))}
    mx.save_safetensors(str(path), arrays, {HEADER_KEY: json.dumps(header)})
    with pytest.raises(CacheError, match=r"missing \['0.1'\]"):
        load_prompt_cache(path)


def test_a_malformed_header_is_refused(tmp_path):
    path = tmp_path / "bad.safetensors"
    mx.save_safetensors(str(path), {}, {HEADER_KEY: '{"format": "other"}'})
    with pytest.raises(CacheError, match="malformed"):
        load_prompt_cache(path)


def test_a_truncated_file_is_refused(tmp_path):
    path = tmp_path / "cut.safetensors"
    save_prompt_cache(path, filled_caches()[:1])
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CacheError, match="runs past the end of the file"):
        load_prompt_cache(path)


def test_saving_an_unregistered_cache_class_is_refused(tmp_path):
    class HomeMade(KVCache):
        kind = "HomeMade"

    with pytest.raises(CacheError, match="layer 0 holds a HomeMade"):
        save_prompt_cache(tmp_path / "x.safetensors", [HomeMade()])


def test_the_path_must_be_a_safetensors_file(tmp_path):
    with pytest.raises(CacheError, match="does not end in .safetensors"):
        save_prompt_cache(tmp_path / "cache.bin", [KVCache()])


def test_kind_table_refuses_two_classes_claiming_one_kind():
    class Impostor(KVCache):
        pass  # inherits kind "KVCache"

    with pytest.raises(CacheError, match="claimed by both"):
        kind_table(KVCache, Impostor)


def test_the_package_table_is_immutable_and_lists_the_standard_kinds():
    assert set(CACHE_KINDS) >= {
        "KVCache",
        "RotatingKVCache",
        "StackedRotatingKVCache",
        "BatchKVCache",
        "BatchRotatingKVCache",
        "RecurrentCache",
    }
    with pytest.raises(TypeError):
        CACHE_KINDS["Evil"] = object  # type: ignore[index]


# --- verification: checksum, counts, old files, atomic saves ----------------------------


def saved(tmp_path, name="c.safetensors"):
    path = tmp_path / name
    save_prompt_cache(path, filled_caches()[:4], {"tokens": "[1, 2]"})
    return path


def flip_byte(path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_saved_file_carries_a_sha256_checksum(tmp_path):
    header = persist.read_safetensors_header(saved(tmp_path))
    doc = json.loads(header.metadata[HEADER_KEY])
    assert doc["version"] == 2 and doc["checksum"].startswith("sha256:")
    assert len(doc["checksum"]) == len("sha256:") + 64


@pytest.mark.parametrize("offset_from_end", [1, 100, 2000])
def test_a_flipped_bit_in_the_body_is_detected(tmp_path, offset_from_end):
    path = saved(tmp_path)
    flip_byte(path, offset_from_end)
    with pytest.raises(CacheError, match="do not match the checksum") as info:
        load_prompt_cache(path)
    assert str(path) in info.value.message and "rebuild" in info.value.fix


def test_edited_metadata_is_detected_by_the_checksum(tmp_path):
    path = saved(tmp_path)
    header = persist.read_safetensors_header(path)
    doc = json.loads(header.metadata[HEADER_KEY])
    doc["metadata"]["tokens"] = "[9, 9]"
    arrays = mx.load(str(path))
    mx.save_safetensors(str(path), arrays, {HEADER_KEY: json.dumps(doc)})
    with pytest.raises(CacheError, match="do not match the checksum"):
        load_prompt_cache(path)


def test_a_version_1_file_is_refused_with_the_fix_to_rebuild(tmp_path):
    path = tmp_path / "old.safetensors"
    header = {
        "format": "mlx-loom-prompt-cache",
        "version": 1,
        "layers": [{"kind": "KVCache", "meta_state": [], "n_arrays": 0}],
        "metadata": {},
    }
    mx.save_safetensors(str(path), {}, {HEADER_KEY: json.dumps(header)})
    with pytest.raises(CacheError, match="version 1 prompt cache") as info:
        load_prompt_cache(path)
    assert "rebuild" in info.value.fix


def test_an_array_count_past_the_file_is_refused_before_anything_is_built(tmp_path):
    path = tmp_path / "bomb.safetensors"
    header = {
        "format": "mlx-loom-prompt-cache",
        "version": 2,
        "layers": [{"kind": "KVCache", "meta_state": [], "n_arrays": 10**9}],
        "metadata": {},
        "checksum": "sha256:" + "0" * 64,
    }
    mx.save_safetensors(str(path), {"0.0": mx.zeros((1,))}, {HEADER_KEY: json.dumps(header)})
    with pytest.raises(CacheError, match="n_arrays"):
        load_prompt_cache(path)


def test_more_layers_than_the_limit_are_refused(tmp_path):
    path = tmp_path / "wide.safetensors"
    layer = {"kind": "KVCache", "meta_state": [], "n_arrays": 0}
    header = {
        "format": "mlx-loom-prompt-cache",
        "version": 2,
        "layers": [layer] * (persist.MAX_LAYERS + 1),
        "metadata": {},
        "checksum": "sha256:" + "0" * 64,
    }
    mx.save_safetensors(str(path), {}, {HEADER_KEY: json.dumps(header)})
    with pytest.raises(CacheError, match="layers"):
        load_prompt_cache(path)


def test_deeply_nested_header_json_is_a_cache_error(tmp_path):
    path = tmp_path / "deep.safetensors"
    mx.save_safetensors(str(path), {}, {HEADER_KEY: "[" * 100_000 + "]" * 100_000})
    with pytest.raises(CacheError, match="deeper than the limit"):
        load_prompt_cache(path)


def test_a_huge_integer_in_the_header_is_a_cache_error(tmp_path):
    path = tmp_path / "int.safetensors"
    mx.save_safetensors(str(path), {}, {HEADER_KEY: '{"version": ' + "9" * 5000 + "}"})
    with pytest.raises(CacheError, match="5000 digits"):
        load_prompt_cache(path)


@pytest.mark.parametrize("bad", ["-1", "1e3", " 5", "9" * 30, "0x10"])
def test_meta_state_counts_must_be_plain_non_negative_integers(tmp_path, bad):
    k, v = kv(0, 2)
    arrays = {"0.0": k, "0.1": v}
    layer = {"kind": "RotatingKVCache", "meta_state": ["0", "4", bad, "2"], "n_arrays": 2}
    path = tmp_path / "meta.safetensors"
    write_cache_file(path, [layer], arrays)
    with pytest.raises(CacheError, match="not a non-negative integer"):
        load_prompt_cache(path)


def test_window_positions_that_no_window_can_have_are_refused(tmp_path):
    k, v = kv(0, 3)
    arrays = {"0.0": k, "0.1": v}
    # three slots in use but only two tokens seen, write index past the slots
    layer = {"kind": "RotatingKVCache", "meta_state": ["0", "4", "2", "9"], "n_arrays": 2}
    path = tmp_path / "window.safetensors"
    write_cache_file(path, [layer], arrays)
    with pytest.raises(CacheError, match="do not describe a window"):
        load_prompt_cache(path)


def test_saving_replaces_the_file_atomically_and_leaves_no_temporary(tmp_path):
    path = saved(tmp_path)
    save_prompt_cache(path, filled_caches()[:1])
    assert load_prompt_cache(path)[0][0].offset == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]


# --- files that name a kind per layout and codec ---------------------------------------


def _old_file(path, caches) -> None:
    """A file as written when each layout and codec had a class (and kind name) of its own."""
    old_names = {
        ("KVCache", "affine"): "QuantizedKVCache",
        ("RotatingKVCache", "affine"): "QuantizedRotatingKVCache",
        ("BatchKVCache", "affine"): "BatchQuantizedKVCache",
        ("StackedRotatingKVCache", "affine"): "StackedQuantizedRotatingKVCache",
        ("KVCache", "turboquant"): "TurboQuantKVCache",
        ("RotatingKVCache", "turboquant"): "TurboQuantRotatingKVCache",
        ("BatchKVCache", "turboquant"): "BatchTurboQuantKVCache",
        ("StackedRotatingKVCache", "turboquant"): "StackedTurboQuantRotatingKVCache",
    }
    layers, arrays = [], {}
    for i, c in enumerate(caches):
        meta = list(c.meta_state)
        meta.remove(c.codec)  # old files had no codec name: the kind said it
        state = c.state
        arrays.update({f"{i}.{j}": mx.contiguous(a) for j, a in enumerate(state)})
        kind = old_names[(type(c).kind, c.codec)]
        layers.append(persist._Layer(kind=kind, meta_state=meta, n_arrays=len(state)))
    header = persist._Header(
        format=persist.FORMAT,
        version=persist.FORMAT_VERSION,
        layers=layers,
        metadata={},
        checksum="sha256:" + "0" * 64,
    )
    header = header.model_copy(update={"checksum": persist.array_checksum(header, arrays)})
    mx.save_safetensors(str(path), arrays, {HEADER_KEY: header.model_dump_json()})


def _codec_caches() -> list:
    from mlx_loom.cache import (
        BatchQuantizedKVCache,
        BatchTurboQuantKVCache,
        TurboQuantKVCache,
        TurboQuantRotatingKVCache,
    )

    singles = [
        QuantizedKVCache(group_size=32, bits=4),
        QuantizedRotatingKVCache(4, group_size=32, bits=8),
        TurboQuantKVCache(bits=3),
        TurboQuantRotatingKVCache(4, bits=4),
    ]
    for step, L in enumerate([3, 1, 1]):
        for c in singles:
            c.update_and_fetch(*kv(step, L))
    stacked = [type(c).stack([c]) for c in singles[1::2]]
    batches = [BatchQuantizedKVCache([0], group_size=32, bits=4), BatchTurboQuantKVCache([0])]
    for b in batches:
        b.update_and_fetch(*kv(7, 2))
    return singles + stacked + batches


def test_files_naming_the_old_kind_per_codec_load_as_the_layout_in_that_codec(tmp_path):
    caches = _codec_caches()
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    _old_file(old, caches)
    save_prompt_cache(new, caches)
    header = json.loads(mx.load(str(new), return_metadata=True)[1][HEADER_KEY])
    # Files written now name the layout; the codec is in its meta_state.
    assert {layer["kind"] for layer in header["layers"]} <= set(CACHE_KINDS)
    for path in (old, new):
        loaded, _ = load_prompt_cache(path)
        assert len(loaded) == len(caches) == 8
        for a, b in zip(caches, loaded, strict=True):
            assert type(a) is type(b) and a.codec_key == b.codec_key
            assert a.meta_state == b.meta_state
            assert all(mx.array_equal(x, y).item() for x, y in zip(a.state, b.state, strict=True))


def test_an_unknown_codec_name_in_a_state_is_refused(tmp_path):
    cache = QuantizedKVCache(group_size=32, bits=4)
    cache.update_and_fetch(*kv(0, 2))
    with pytest.raises(CacheError, match="names KV codec 'zstd'"):
        KVCache.from_state(cache.state, ("zstd", "32", "4"))

"""Reading one rank's slice of a tensor straight from its safetensors file."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom.artifacts import load_weights
from mlx_loom.artifacts.weights import recording_sources
from mlx_loom.parallel.reading import SliceReader

DTYPES = [mx.float32, mx.bfloat16, mx.float16, mx.uint32]


@pytest.fixture
def stored(tmp_path):
    """A checkpoint of a few tensors, and the lazy arrays load_weights returned for it."""
    key = mx.random.key(3)
    tensors = {
        f"t.{str(dt).removeprefix('mlx.core.')}": (
            mx.random.normal((6, 10, 12), key=key) * 100
        ).astype(dt)
        for dt in DTYPES
    }
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors)
    with recording_sources() as sources:
        loaded = load_weights(tmp_path)
    return tensors, loaded, sources


def _expected(array: mx.array, axis: int, ranges) -> mx.array:
    index = [slice(None)] * array.ndim
    parts = []
    for start, stop in ranges:
        index[axis] = slice(start, stop)
        parts.append(array[tuple(index)])
    return mx.concatenate(parts, axis=axis)


@pytest.mark.parametrize("name", [f"t.{str(d).removeprefix('mlx.core.')}" for d in DTYPES])
@pytest.mark.parametrize(
    ("axis", "ranges"),
    [(0, [(3, 6)]), (1, [(0, 5)]), (2, [(6, 12)]), (2, [(0, 2), (4, 6), (8, 10)])],
)
def test_a_slice_read_from_the_file_equals_the_slice_of_the_tensor(stored, name, axis, ranges):
    tensors, loaded, sources = stored
    reader = SliceReader(sources)
    got = reader.take(name, loaded[name], axis, ranges)
    want = _expected(tensors[name], axis, ranges)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert mx.array_equal(got, want)
    assert reader.bytes_read == want.nbytes and reader.sliced_whole == []


def test_a_transformed_array_is_sliced_after_reading_it_whole(stored):
    tensors, loaded, sources = stored
    reader = SliceReader(sources)
    shifted = loaded["t.float32"] + 1.0  # a loader's transform: no file range of its own
    got = reader.take("t.float32", shifted, 0, [(0, 2)])
    assert mx.array_equal(got, tensors["t.float32"][:2] + 1.0)
    assert reader.bytes_read == 0 and reader.sliced_whole == ["t.float32"]


def test_load_weights_records_nothing_outside_a_recording(tmp_path, stored):
    tensors, _, sources = stored
    assert len(sources) == len(tensors)
    with recording_sources() as inner:
        pass
    load_weights(tmp_path)
    assert inner == {}

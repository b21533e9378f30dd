"""Specification of the safetensors header reader: every rule, and what a failure says."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file

from mlx_loom.artifacts import MAX_HEADER_BYTES, TensorInfo, read_safetensors_header
from mlx_loom.errors import SafetensorsHeaderError


def write_raw(
    path: Path, header: dict | bytes, data: bytes, *, header_len: int | None = None
) -> Path:
    """Write a safetensors file byte by byte, so tests can break any rule."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + blob + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def reject(path: Path, *needles: str) -> SafetensorsHeaderError:
    with pytest.raises(SafetensorsHeaderError) as info:
        read_safetensors_header(path)
    text = str(info.value)
    assert str(path) in text
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"
    assert info.value.fix is not None
    return info.value


def test_file_written_by_mlx_is_read_with_dtypes_shapes_and_metadata(tmp_path):
    path = tmp_path / "m.safetensors"
    mx.save_safetensors(
        str(path),
        {"w": mx.zeros((3, 5), dtype=mx.bfloat16), "q": mx.ones((7,), dtype=mx.uint32)},
        metadata={"format": "mlx"},
    )
    header = read_safetensors_header(path)
    assert header.tensors == {
        "w": TensorInfo("BF16", (3, 5)),
        "q": TensorInfo("U32", (7,)),
    }
    assert header.metadata == {"format": "mlx"}
    assert header.tensors["w"].file == path


def test_file_written_by_the_reference_safetensors_library_is_accepted(tmp_path):
    path = tmp_path / "ref.safetensors"
    save_file(
        {"a": np.zeros((2, 3), np.float16), "b": np.ones(4, np.int64), "c": np.zeros(3, np.bool_)},
        str(path),
    )
    tensors = read_safetensors_header(path).tensors
    assert {k: (v.dtype, v.shape) for k, v in tensors.items()} == {
        "a": ("F16", (2, 3)),
        "b": ("I64", (4,)),
        "c": ("BOOL", (3,)),
    }


def test_manifest_agrees_with_what_mx_load_returns(tmp_path):
    path = tmp_path / "m.safetensors"
    arrays = {
        "f32": mx.zeros((2, 2)),
        "f16": mx.zeros((3,), dtype=mx.float16),
        "i8": mx.zeros((1, 4), dtype=mx.int8),
        "scalar": mx.array(3, dtype=mx.int32),
        "empty": mx.zeros((0, 5)),
    }
    mx.save_safetensors(str(path), arrays)
    loaded = mx.load(str(path))
    tensors = read_safetensors_header(path).tensors
    assert {k: (v.shape, v.mlx_dtype) for k, v in tensors.items()} == {
        k: (tuple(a.shape), a.dtype) for k, a in loaded.items()
    }


def test_json_key_order_need_not_follow_offsets(tmp_path):
    # The reference implementation sorts entries by offset before checking them.
    header = {"second": entry("U8", [2], 2, 4), "first": entry("U8", [2], 0, 2)}
    path = write_raw(tmp_path / "x.safetensors", header, b"\0" * 4)
    assert list(read_safetensors_header(path).tensors) == ["first", "second"]


def test_file_shorter_than_the_length_prefix_is_rejected(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x10\x00\x00")
    reject(path, "3 bytes", "8-byte")


def test_absurd_header_length_is_rejected_before_reading(tmp_path):
    path = write_raw(tmp_path / "huge.safetensors", b"{}", b"", header_len=2**63)
    reject(path, str(2**63), "past the end")


def test_header_length_past_end_of_file_is_rejected(tmp_path):
    path = write_raw(tmp_path / "trunc.safetensors", b'{"a":', b"", header_len=50)
    reject(path, "header length 50", "5 bytes follow")


def test_header_length_over_the_cap_is_rejected_even_if_the_file_is_that_big(tmp_path):
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        fh.truncate(8 + MAX_HEADER_BYTES + 16)  # sparse: no real disk use
    reject(path, f"exceeds the {MAX_HEADER_BYTES}-byte limit")


def test_header_length_below_two_is_rejected(tmp_path):
    path = write_raw(tmp_path / "one.safetensors", b"{", b"}", header_len=1)
    reject(path, "header length is 1")


def test_non_utf8_header_is_rejected(tmp_path):
    path = write_raw(tmp_path / "bin.safetensors", b'{"\xff": 1}', b"")
    reject(path, "not valid UTF-8")


def test_non_json_header_is_rejected_with_line_and_column(tmp_path):
    path = write_raw(tmp_path / "bad.safetensors", b'{"a": nope}', b"")
    reject(path, "not valid JSON", "line 1, column 7")


def test_header_that_is_not_an_object_is_rejected(tmp_path):
    path = write_raw(tmp_path / "list.safetensors", b"[1, 2]", b"")
    reject(path, "JSON list, not an object")


def test_duplicate_tensor_names_are_rejected(tmp_path):
    blob = (
        b'{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},'
        b' "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}'
    )
    path = write_raw(tmp_path / "dup.safetensors", blob, b"\0\0")
    reject(path, "repeats the key 'w'")


def test_unknown_dtype_is_rejected_naming_tensor_and_dtype(tmp_path):
    path = write_raw(tmp_path / "d.safetensors", {"w": entry("Q4", [2], 0, 2)}, b"\0\0")
    reject(path, "tensor 'w'", "unknown dtype 'Q4'")


def test_dtype_mlx_cannot_load_is_rejected_with_that_reason(tmp_path):
    path = write_raw(tmp_path / "f64.safetensors", {"w": entry("F64", [1], 0, 8)}, b"\0" * 8)
    err = reject(path, "tensor 'w'", "F64", "MLX cannot load")
    assert "F32" in err.fix


def test_negative_or_fractional_dimensions_are_rejected(tmp_path):
    neg = write_raw(tmp_path / "neg.safetensors", {"w": entry("U8", [-1], 0, 0)}, b"")
    reject(neg, "tensor 'w'", "non-negative integers")
    frac = write_raw(tmp_path / "frac.safetensors", {"w": entry("U8", [1.5], 0, 0)}, b"")
    reject(frac, "tensor 'w'", "non-negative integers")


def test_offsets_past_the_data_section_are_rejected(tmp_path):
    path = write_raw(tmp_path / "past.safetensors", {"w": entry("F32", [4], 0, 16)}, b"\0" * 8)
    reject(path, "tensor 'w'", "past the end of the data section (8 bytes)")


def test_byte_span_must_equal_shape_times_itemsize(tmp_path):
    path = write_raw(tmp_path / "span.safetensors", {"w": entry("F32", [3], 0, 8)}, b"\0" * 8)
    reject(path, "tensor 'w'", "span 8 bytes", "needs 12")


def test_offsets_that_end_before_they_begin_are_rejected(tmp_path):
    path = write_raw(tmp_path / "rev.safetensors", {"w": entry("U8", [0], 4, 2)}, b"\0" * 4)
    reject(path, "tensor 'w'", "end before they begin")


def test_overlapping_ranges_are_rejected_naming_both_tensors(tmp_path):
    header = {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)}
    path = write_raw(tmp_path / "ovl.safetensors", header, b"\0" * 6)
    reject(path, "tensor 'b'", "overlap tensor 'a'")


def test_a_gap_between_ranges_is_rejected(tmp_path):
    header = {"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 4, 6)}
    path = write_raw(tmp_path / "gap.safetensors", header, b"\0" * 6)
    reject(path, "tensor 'b'", "gap after byte 2")


def test_bytes_after_the_last_tensor_are_rejected(tmp_path):
    path = write_raw(tmp_path / "tail.safetensors", {"a": entry("U8", [2], 0, 2)}, b"\0" * 5)
    reject(path, "cover 2 bytes", "holds 5")


def test_metadata_must_map_strings_to_strings(tmp_path):
    header = {"__metadata__": {"format": 1}, "a": entry("U8", [1], 0, 1)}
    path = write_raw(tmp_path / "meta.safetensors", header, b"\0")
    reject(path, "__metadata__")


def test_entry_missing_a_field_is_rejected(tmp_path):
    path = write_raw(tmp_path / "nof.safetensors", {"a": {"dtype": "U8", "shape": [1]}}, b"\0")
    reject(path, "tensor 'a'", "no 'data_offsets'")


def test_failure_message_carries_the_redownload_fix(tmp_path):
    path = write_raw(tmp_path / "x.safetensors", {"a": entry("U8", [4], 0, 4)}, b"\0")
    err = reject(path)
    assert "re-download" in err.fix
    assert "Fix:" in str(err)

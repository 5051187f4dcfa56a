"""storage.safetensors: strict header parsing, the aligned writer, and corrupt-input errors."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from safetensors.numpy import load_file, save_file

from storage.errors import ColibriError, SafetensorsError
from storage.quant import bf16_to_f32, f32_to_bf16
from storage.safetensors import (
    PAD_PREFIX,
    TensorSpec,
    plan_layout,
    read_header,
    read_tensor,
    write_safetensors,
)


def _raw_shard(path: Path, header: Mapping[str, object] | bytes, data: bytes) -> Path:
    """A shard with a hand-made header (bytes are written verbatim, dicts as JSON)."""
    js = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(js)) + js + data)
    return path


# ----------------------------------------------------------------------------- reading


def test_reads_files_written_by_the_safetensors_library(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays: dict[str, npt.NDArray[Any]] = {
        "a.f32": rng.standard_normal((3, 5)).astype(np.float32),
        "b.f16": rng.standard_normal((4,)).astype(np.float16),
        "c.u8": rng.integers(0, 256, (7,), dtype=np.uint8),
        "d.i64": np.arange(6, dtype=np.int64).reshape(2, 3),
        "e.empty": np.zeros((0, 4), dtype=np.float32),
    }
    path = tmp_path / "lib.safetensors"
    save_file(arrays, str(path), metadata={"format": "np"})
    sh = read_header(path)
    assert sh.metadata == {"format": "np"}
    assert sh.data_start == 8 + sh.header_len
    assert sh.file_size == path.stat().st_size
    assert set(sh.tensors) == set(arrays)
    dtypes = {"a.f32": "F32", "b.f16": "F16", "c.u8": "U8", "d.i64": "I64", "e.empty": "F32"}
    for name, want in arrays.items():
        info = sh.tensors[name]
        assert info.dtype == dtypes[name]
        assert info.shape == want.shape
        assert info.nbytes == want.nbytes
        got = read_tensor(info)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_bf16_tensor_from_a_crafted_header(tmp_path: Path) -> None:
    vals = np.array([[1.0, -2.5, 3.140625], [0.0, -0.0, 65280.0]], dtype=np.float32)
    bits = f32_to_bf16(vals)
    header: dict[str, object] = {"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}}
    path = _raw_shard(tmp_path / "bf16.safetensors", header, bits.tobytes())
    sh = read_header(path)
    info = sh.tensors["w"]
    assert (info.dtype, info.shape) == ("BF16", (2, 3))
    assert (info.start, info.end) == (sh.data_start, sh.data_start + 12)
    raw = read_tensor(info)
    assert raw.dtype == np.uint16
    np.testing.assert_array_equal(
        bf16_to_f32(raw.view(np.uint16)), vals
    )  # all exactly representable


# ----------------------------------------------------------------------------- writing


def test_writer_output_loads_with_the_safetensors_library(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    arrays: dict[str, npt.NDArray[Any]] = {
        "x": rng.standard_normal((5, 3)).astype(np.float32),
        "y": rng.integers(0, 256, (11,), dtype=np.uint8),
        "z": rng.standard_normal((2, 2)).astype(np.float16),
    }
    specs = [TensorSpec(n, {"float32": "F32", "uint8": "U8", "float16": "F16"}[a.dtype.name],
                        a.shape) for n, a in arrays.items()]  # fmt: skip
    path = tmp_path / "ours.safetensors"
    write_safetensors(path, specs, list(arrays.values()), metadata={"k": "v"})
    loaded = load_file(str(path))
    assert set(loaded) == set(arrays)
    for n, a in arrays.items():
        np.testing.assert_array_equal(loaded[n], a)
    sh = read_header(path)
    assert sh.metadata == {"k": "v"}
    assert sh.data_start % 8 == 0  # the library pads the header to 8 bytes too
    assert not (tmp_path / "ours.safetensors.tmp").exists()


def test_writer_honours_alignment_with_padding_tensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, (1000,), dtype=np.uint8)
    b = rng.integers(0, 256, (3000,), dtype=np.uint8)
    c = rng.standard_normal((7,)).astype(np.float32)
    specs = [
        TensorSpec("a", "U8", (1000,), align=4096),
        TensorSpec("b", "U8", (3000,), align=4096),
        TensorSpec("c", "F32", (7,)),
    ]
    path = tmp_path / "aligned.safetensors"
    write_safetensors(path, specs, [a, b, c])
    sh = read_header(path)
    assert sh.data_start % 4096 == 0, "the header is padded to the largest alignment"
    assert sh.tensors["a"].start % 4096 == 0
    assert sh.tensors["b"].start % 4096 == 0
    pads = [n for n in sh.tensors if n.startswith(PAD_PREFIX)]
    assert pads, "a gap after 'a' needs a padding tensor"
    loaded = load_file(str(path))  # still valid safetensors for every other reader
    np.testing.assert_array_equal(loaded["a"], a)
    np.testing.assert_array_equal(loaded["b"], b)
    np.testing.assert_array_equal(loaded["c"], c)
    for p in pads:
        assert not loaded[p].any()
    header, items = plan_layout(specs)
    assert len(header) == sh.data_start
    assert [s.name for s, _ in items if not s.name.startswith(PAD_PREFIX)] == ["a", "b", "c"]


def test_writer_rejects_wrong_sizes_and_leaves_no_tmp(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    with pytest.raises(SafetensorsError, match=r"bad\.safetensors.*'w'.*got 3 bytes"):
        write_safetensors(path, [TensorSpec("w", "U8", (4,))], [b"abc"])
    assert not path.exists()
    assert not (tmp_path / "bad.safetensors.tmp").exists()
    with pytest.raises(SafetensorsError, match="no data given for tensor 'v'"):
        write_safetensors(path, [TensorSpec("w", "U8", (1,)), TensorSpec("v", "U8", (1,))], [b"a"])
    with pytest.raises(SafetensorsError, match="duplicate"):
        plan_layout([TensorSpec("w", "U8", (1,)), TensorSpec("w", "U8", (1,))])


# ----------------------------------------------------------------------------- corrupt input


def _good(tmp_path: Path) -> Path:
    path = tmp_path / "good.safetensors"
    save_file({"t.weight": np.arange(64, dtype=np.float32)}, str(path))
    return path


def _assert_names(
    exc: pytest.ExceptionInfo[SafetensorsError], path: Path, tensor: str | None
) -> None:
    assert isinstance(exc.value, ColibriError)
    msg = str(exc.value)
    assert str(path) in msg
    if tensor is not None:
        assert repr(tensor) in msg


def test_truncated_shard_names_file_and_tensor(tmp_path: Path) -> None:
    path = _good(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(SafetensorsError, match="truncated") as exc:
        read_header(path)
    _assert_names(exc, path, "t.weight")


def test_header_length_past_eof(tmp_path: Path) -> None:
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", 500) + b"{}")
    with pytest.raises(SafetensorsError, match="runs past the end") as exc:
        read_header(path)
    _assert_names(exc, path, None)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsError, match="too short"):
        read_header(tiny)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(SafetensorsError, match="implausible"):
        read_header(huge)


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b'{"a": {"dtype": "F32",', "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[1, 2]", "not an object"),
        (b'{"__metadata__": [1]}', "__metadata__"),
        (b'{"__metadata__": []}', "__metadata__"),  # was taken as {}
        (b'{"__metadata__": {"a": 1}}', "__metadata__ is not an object of strings"),  # "1"
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b"]}}", "not valid JSON"),
    ],
)
def test_bad_json(tmp_path: Path, header: bytes, match: str) -> None:
    path = _raw_shard(tmp_path / "j.safetensors", header, b"")
    with pytest.raises(SafetensorsError, match=match) as exc:
        read_header(path)
    _assert_names(exc, path, None)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}, "do not hold shape"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, None),  # the good one
        ({"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}, "unknown dtype"),
        ({"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}, "unknown dtype"),
        ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, "bad shape"),
        ({"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}, "bad shape"),
        ({"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}, "bad shape"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}, "bad data_offsets"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0]}, "bad data_offsets"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16]}, "bad data_offsets"),
        ({"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}, "outside the file"),
        ([1, 2], "not an object"),
    ],
)
def test_bad_entries_name_file_and_tensor(tmp_path: Path, entry: object, match: str | None) -> None:
    path = _raw_shard(tmp_path / "e.safetensors", {"t.weight": entry}, bytes(16))
    if match is None:
        assert read_header(path).tensors["t.weight"].nbytes == 16
        return
    with pytest.raises(SafetensorsError, match=match) as exc:
        read_header(path)
    _assert_names(exc, path, "t.weight")


def test_overlapping_tensors_are_rejected(tmp_path: Path) -> None:
    header: dict[str, object] = {
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]},
    }
    path = _raw_shard(tmp_path / "o.safetensors", header, bytes(12))
    with pytest.raises(SafetensorsError, match="overlaps") as exc:
        read_header(path)
    _assert_names(exc, path, "b")


def test_duplicate_tensor_key_in_one_header(tmp_path: Path) -> None:
    ent = '{"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}'
    ent2 = '{"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}'
    for meta in ("", '"__metadata__": {"a": "b"}, '):
        js = f'{{{meta}"w": {ent}, "w": {ent2}}}'.encode()
        path = _raw_shard(tmp_path / "d.safetensors", js, bytes(8))
        with pytest.raises(SafetensorsError, match="listed twice") as exc:
            read_header(path)
        _assert_names(exc, path, "w")
    # A repeated key inside an entry is not a hidden tensor: only top-level duplicates count.
    js = b'{"w": {"dtype": "U8", "dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}'
    assert "w" in read_header(_raw_shard(tmp_path / "ok.safetensors", js, bytes(4))).tensors


def test_read_tensor_short_read_after_truncation(tmp_path: Path) -> None:
    path = _good(tmp_path)
    info = read_header(path).tensors["t.weight"]
    path.write_bytes(path.read_bytes()[:-8])  # truncated after the header was read
    with pytest.raises(SafetensorsError, match="short read") as exc:
        read_tensor(info)
    _assert_names(exc, path, "t.weight")
    path.unlink()
    with pytest.raises(SafetensorsError, match="read failed") as exc2:
        read_tensor(info)
    _assert_names(exc2, path, "t.weight")
    with pytest.raises(SafetensorsError, match="cannot read"):
        read_header(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("shift", [-10, -1, 8])
def test_header_length_off_by_a_few_bytes_is_caught(tmp_path: Path, shift: int) -> None:
    """A padded header absorbs a wrong length (its trailing spaces still parse): every tensor
    then reads shifted. The tensors must tile the data section, so it is an error instead."""
    p = tmp_path / "s.safetensors"
    a = np.arange(1024, dtype=np.float32)
    write_safetensors(p, [TensorSpec("a", "F32", (1024,), 4096)], [a])
    raw = bytearray(p.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    assert raw[8 + n - 12 : 8 + n] == b" " * 12  # padded with spaces
    if shift > 0:  # a longer header swallows data bytes: spaces-only data keeps JSON valid
        raw[8 + n : 8 + n + shift] = b" " * shift
    raw[:8] = struct.pack("<Q", n + shift)
    p.write_bytes(bytes(raw))
    with pytest.raises(SafetensorsError, match=r"cover .* data bytes|outside the file"):
        read_header(p)


def test_data_past_the_last_tensor_is_caught(tmp_path: Path) -> None:
    p = tmp_path / "s.safetensors"
    save_file({"a": np.ones(16, dtype=np.float32)}, str(p))
    read_header(p)
    with open(p, "ab") as fh:
        fh.write(b"\0" * 64)
    with pytest.raises(SafetensorsError, match="cover 64 of the 128 data bytes"):
        read_header(p)
    gap = _raw_shard(
        tmp_path / "gap.safetensors",
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}},
        b"\0" * 16,
    )
    with pytest.raises(SafetensorsError, match="starts 8 bytes in"):
        read_header(gap)

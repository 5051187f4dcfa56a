"""safetensors shards: strict header parsing and an aligned, streaming, atomic writer.

Layout of a shard: 8-byte little-endian header length N, N bytes of JSON (may end in spaces), then
the data area. Each JSON entry maps a tensor name to ``dtype``, ``shape`` and ``data_offsets``
(relative to the data area). The writer can pad the header with spaces and insert named padding
tensors (``__pad__.<k>``, U8) so chosen tensors start on a 4 KiB boundary while the file stays
valid safetensors for every other reader.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from storage import jsontext
from storage.errors import SafetensorsError

__all__ = [
    "DTYPE_SIZES",
    "PAD_PREFIX",
    "WRITTEN_BY_COLIBRI",
    "ShardHeader",
    "TensorInfo",
    "TensorSpec",
    "numpy_dtype",
    "plan_layout",
    "read_header",
    "read_tensor",
    "write_safetensors",
]

# A shard's __metadata__ when colibri's own writer made it without a manifest beside it
# (storage.public_layout): its int4 group sizes follow colibri's rule, not the C engine's.
WRITTEN_BY_COLIBRI: dict[str, str] = {"writer": "colibri"}

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip

_NUMPY: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "uint8", "F8_E5M2": "uint8",
    "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "uint16",
    "I32": "int32", "U32": "uint32", "F32": "float32",
    "I64": "int64", "U64": "uint64", "F64": "float64",
}  # fmt: skip

PAD_PREFIX = "__pad__."
MAX_HEADER = 100 * 1024 * 1024


def numpy_dtype(st_dtype: str) -> np.dtype[np.generic]:
    """The numpy dtype holding a safetensors dtype's bytes (BF16 and FP8 as raw unsigned ints)."""
    return np.dtype(_NUMPY[st_dtype])


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of one shard; ``start``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class ShardHeader:
    path: Path
    header_len: int
    data_start: int
    file_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)


def read_header(path: str | os.PathLike[str]) -> ShardHeader:
    """Parse and validate a shard header. Every problem raises :class:`SafetensorsError`
    naming the file (and the tensor where there is one)."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{p}: file is {size} bytes, too short for a header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise SafetensorsError(f"{p}: header length {n} is implausible (> 100 MiB)")
            if 8 + n > size:
                raise SafetensorsError(
                    f"{p}: header length {n} runs past the end of the file ({size} bytes); "
                    "the shard is truncated or not safetensors"
                )
            raw = fh.read(n)
    except OSError as exc:
        raise SafetensorsError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
        doc = jsontext.loads(text)
        # json.loads keeps the last of two equal keys and would silently hide a tensor. A hook
        # on every object costs ~40% of the parse, so only look when the counts disagree.
        if isinstance(doc, dict) and raw.count(b'"data_offsets"') > len(doc) - (
            "__metadata__" in doc
        ):
            dup = _first_duplicate_key(text)
            if dup is not None:
                raise SafetensorsError(f"{p}: tensor {dup!r} is listed twice in the header")
    except (UnicodeDecodeError, ValueError) as exc:  # bad JSON, a huge integer, deep nesting
        raise SafetensorsError(f"{p}: header is not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{p}: header JSON is not an object")
    data_start = 8 + n
    meta_raw = doc.pop("__metadata__", None)
    if meta_raw is None:
        meta_raw = {}
    # an object of strings, as the format says and the official reader requires ([] and
    # {"a": 1} were taken as {} and {"a": "1"})
    if not isinstance(meta_raw, dict) or not all(isinstance(v, str) for v in meta_raw.values()):
        raise SafetensorsError(f"{p}: __metadata__ is not an object of strings")
    tensors: dict[str, TensorInfo] = {}
    for name, ent in doc.items():
        tensors[name] = _entry(p, name, ent, data_start, size)
    _check_overlaps(p, tensors.values())
    _check_coverage(p, tensors.values(), data_start, size)
    return ShardHeader(
        p, n, data_start, size, tensors, {str(k): str(v) for k, v in meta_raw.items()}
    )


class _KeyedDict(dict[str, object]):
    """A JSON object that remembers which of its keys appeared more than once."""

    duplicates: list[str]


def _keyed(pairs: list[tuple[str, object]]) -> _KeyedDict:
    d = _KeyedDict(pairs)
    d.duplicates = []
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                d.duplicates.append(k)
            seen.add(k)
    return d


def _first_duplicate_key(text: str) -> str | None:
    """The first top-level key listed twice in a header (inner objects do not count)."""
    top = json.loads(text, object_pairs_hook=_keyed)
    return top.duplicates[0] if isinstance(top, _KeyedDict) and top.duplicates else None


def _check_overlaps(p: Path, infos: Iterable[TensorInfo]) -> None:
    """Two tensors sharing bytes is a corrupt header (every other reader rejects it too)."""
    prev: TensorInfo | None = None
    for t in sorted((t for t in infos if t.end > t.start), key=lambda t: (t.start, t.end)):
        if prev is not None and t.start < prev.end:
            raise SafetensorsError(
                f"{p}: tensor {t.name!r} [{t.start}, {t.end}) overlaps tensor {prev.name!r} "
                f"[{prev.start}, {prev.end}); the header is corrupt"
            )
        if prev is None or t.end > prev.end:
            prev = t


def _check_coverage(p: Path, infos: Iterable[TensorInfo], data_start: int, size: int) -> None:
    """The tensors must tile the data section exactly, as the safetensors format requires.
    A header length that is off by a few bytes (the header's trailing spaces absorb it, so the
    JSON still parses) shifts every tensor: this is where it shows, as bytes at the start or
    the end of the data that no tensor owns."""
    data_bytes = size - data_start
    covered = sum(t.end - t.start for t in infos)  # no overlaps (checked before)
    first = min((t.start - data_start for t in infos if t.end > t.start), default=None)
    if covered != data_bytes or (first is not None and first != 0):
        gap = "" if first in (None, 0) else f"; the first tensor starts {first} bytes in"
        raise SafetensorsError(
            f"{p}: the tensors cover {covered} of the {data_bytes} data bytes{gap}: the header "
            "length or the offsets are wrong, or the file was cut or extended; re-download it"
        )


def _entry(p: Path, name: str, ent: object, data_start: int, size: int) -> TensorInfo:
    # Runs ~120k times for a GLM-5 container: plain loops and `type(x) is int` (which also
    # rejects JSON true/false, bool being an int subclass) keep it cheap.
    if not isinstance(ent, dict):
        raise SafetensorsError(f"{p}: tensor {name!r}: entry is not an object")
    dtype, shape, offs = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
    itemsize = DTYPE_SIZES.get(dtype) if isinstance(dtype, str) else None
    if itemsize is None:
        raise SafetensorsError(f"{p}: tensor {name!r}: unknown dtype {dtype!r}")
    if type(shape) is not list:
        raise SafetensorsError(f"{p}: tensor {name!r}: bad shape {shape!r}")
    numel = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise SafetensorsError(f"{p}: tensor {name!r}: bad shape {shape!r}")
        numel *= d
    if type(offs) is not list or len(offs) != 2:
        raise SafetensorsError(f"{p}: tensor {name!r}: bad data_offsets {offs!r}")
    lo, hi = offs
    if type(lo) is not int or type(hi) is not int or lo < 0 or hi < lo:
        raise SafetensorsError(f"{p}: tensor {name!r}: bad data_offsets {offs!r}")
    if hi - lo != numel * itemsize:
        raise SafetensorsError(
            f"{p}: tensor {name!r}: {hi - lo} bytes do not hold shape {shape} of {dtype}"
        )
    start, end = data_start + lo, data_start + hi
    if end > size:
        raise SafetensorsError(
            f"{p}: tensor {name!r}: extent [{start}, {end}) lies outside the file ({size} bytes); "
            "the shard is truncated"
        )
    return TensorInfo(name, str(dtype), tuple(shape), p, start, end)


def read_tensor(
    info: TensorInfo, out: npt.NDArray[np.uint8] | None = None
) -> npt.NDArray[np.generic]:
    """Read one tensor into a numpy array of its storage dtype and shape: a fresh one, or
    ``out`` (uint8, C-contiguous, exactly the tensor's bytes) viewed as that array."""
    dtype = numpy_dtype(info.dtype)
    if out is None:
        buf: npt.NDArray[Any] = np.empty(info.numel, dtype=dtype)
    else:
        if out.dtype != np.uint8 or out.nbytes != info.nbytes or not out.flags.c_contiguous:
            raise ValueError(
                f"tensor {info.name!r}: out must be C-contiguous uint8 of {info.nbytes} bytes"
            )
        buf = out.view(dtype)
    view = buf.view(np.uint8).data
    try:
        fd = os.open(info.path, os.O_RDONLY)
        try:
            got = 0
            while got < info.nbytes:
                k = os.preadv(fd, [view[got:]], info.start + got)
                if k == 0:
                    break
                got += k
        finally:
            os.close(fd)
    except OSError as exc:
        raise SafetensorsError(f"{info.path}: tensor {info.name!r}: read failed: {exc}") from exc
    if got != info.nbytes:
        raise SafetensorsError(
            f"{info.path}: tensor {info.name!r}: short read ({got} of {info.nbytes} bytes)"
        )
    return buf.reshape(info.shape)


# ----------------------------------------------------------------------------- writer


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor to write. ``align`` > 1 asks for its absolute file offset to be a multiple."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    align: int = 1

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def plan_layout(
    specs: Sequence[TensorSpec],
    *,
    header_align: int = 8,
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[tuple[TensorSpec, int]]]:
    """Lay tensors out in the given order, inserting padding tensors where alignment asks.

    Returns the full header bytes (length prefix included) and ``[(spec, data_offset)]`` with
    padding specs interleaved (their bytes are zeros)."""
    names = {s.name for s in specs}
    if len(names) != len(specs):
        raise SafetensorsError("duplicate tensor names in one shard")
    # The header size depends on the offsets and the offsets on the header size: iterate until
    # the padded header length is stable (two rounds in practice).
    data_start_guess = 0
    for _ in range(8):
        items: list[tuple[TensorSpec, int]] = []
        off = 0
        pad_k = 0
        for s in specs:
            if s.align > 1:
                gap = (-(data_start_guess + off)) % s.align
                if gap:
                    pad = TensorSpec(f"{PAD_PREFIX}{pad_k}", "U8", (gap,))
                    pad_k += 1
                    items.append((pad, off))
                    off += gap
            items.append((s, off))
            off += s.nbytes
        doc: dict[str, object] = {}
        if metadata:
            doc["__metadata__"] = dict(metadata)
        for s, o in items:
            doc[s.name] = {
                "dtype": s.dtype,
                "shape": list(s.shape),
                "data_offsets": [o, o + s.nbytes],
            }
        js = json.dumps(doc, separators=(",", ":")).encode()
        need = max((s.align for s in specs), default=1)
        align = max(header_align, need)
        total = 8 + len(js)
        padded = total + ((-total) % align)
        if padded == data_start_guess:
            js = js + b" " * (padded - total)
            return struct.pack("<Q", len(js)) + js, items
        data_start_guess = padded
    raise SafetensorsError("header layout did not converge")  # pragma: no cover


def write_safetensors(
    path: str | os.PathLike[str],
    specs: Sequence[TensorSpec],
    chunks: Iterable[npt.NDArray[np.generic] | bytes],
    *,
    header_align: int = 8,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a shard atomically (``<path>.tmp`` + fsync + rename).

    ``chunks`` yields each tensor's bytes in ``specs`` order (numpy arrays or bytes), so a caller
    can produce one tensor at a time and keep memory bounded."""
    header, items = plan_layout(specs, header_align=header_align, metadata=metadata)
    dst = Path(path)
    tmp = dst.with_name(dst.name + ".tmp")
    it = iter(chunks)
    real = {s.name for s in specs}
    try:
        with open(tmp, "wb") as fh:
            fh.write(header)
            for spec, _off in items:
                if spec.name not in real:
                    fh.write(bytes(spec.nbytes))
                    continue
                try:
                    chunk = next(it)
                except StopIteration:
                    raise SafetensorsError(
                        f"{dst}: no data given for tensor {spec.name!r}"
                    ) from None
                # Write contiguous arrays through the buffer protocol: tobytes() would double
                # the peak memory of a 1 GB embedding.
                b = np.ascontiguousarray(chunk).data if isinstance(chunk, np.ndarray) else chunk
                n = b.nbytes if isinstance(b, memoryview) else len(b)
                if n != spec.nbytes:
                    raise SafetensorsError(
                        f"{dst}: tensor {spec.name!r}: got {n} bytes, expected {spec.nbytes}"
                    )
                fh.write(b)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dst)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SafetensorsError(f"{dst}: write failed: {exc.strerror or exc}") from exc
    except BaseException:
        # Never leave a half-written .tmp beside the shards.
        tmp.unlink(missing_ok=True)
        raise

"""``.coli_kv``: a compressed MLA KV cache on disk, so a conversation survives restarts.

Layout (the colibri C engine's; little-endian)::

    b"COLIKV1\\0"
    int32 x 8: n_layers, kv_lora, qk_rope, index_head_dim (or 0), n_indexed_layers, vocab,
               n_records, model identity (0 = not recorded)
    n_records records, each:
        int32 token id
        per layer 0..n_layers-1: kv_lora f32 latent, then qk_rope f32 rope key
        per indexed layer (ascending): index_head_dim f32 DSA index key

Version 2 (colibri's, for the grouped-query families) has the same header and records with the
two per-layer widths meaning the roped keys and the values of every KV head
(``num_key_value_heads * head_dim`` each) and no indexed layers. A file of one version is
refused, clearly, by a model of the other kind; version 1 files load as they always did.

The eighth header word is reserved (0) in the C engine's files; colibri stores a 31-bit model
identity there (:func:`model_identity`: config, shard names, sizes, headers and tails) so a file
written for other weights of the same shape is refused. A file with 0 there carries no identity
and is checked on its dimensions alone.

Crash safety: records are appended and fsynced *before* ``n_records`` is rewritten (a 4-byte
write inside the first sector), so a crash at any instant leaves the old count over the old
records or the new count over the new ones. Dropping records (a shorter common prefix) first
lowers the count, then appends. A new file is written to a temporary name and renamed. Bytes
beyond ``n_records`` records (an append cut short) are ignored on load and trimmed on the next
sync. A file that fails validation is renamed aside to ``<name>.bad-<timestamp>`` with a
warning, never used and never overwritten.

Shape legend: N records, L layers, C kv_lora, R qk_rope, NI indexed layers, DI index_head_dim,
W floats per record = 1 + L * (C + R) + NI * DI.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import anyio.to_thread
import numpy as np
import numpy.typing as npt
import structlog

from storage import jsontext
from storage.atomic import fsync_dir, set_aside_and_warn
from storage.container import shard_paths
from storage.errors import KVFileError
from storage.manifest import MANIFEST_NAME

__all__ = [
    "KV_FILE",
    "KV_MAGIC",
    "KV_MAGIC_GQA",
    "KVCacheLike",
    "KVHeader",
    "async_sync_kv",
    "header_for",
    "load_kv",
    "model_identity",
    "read_header",
    "read_kv",
    "read_tokens",
    "slot_path",
    "sync_kv",
    "write_kv",
]

KV_FILE = ".coli_kv"
KV_MAGIC = b"COLIKV1\0"
KV_MAGIC_GQA = b"COLIKV2\0"
_MAGIC_OF = {"mla": KV_MAGIC, "gqa": KV_MAGIC_GQA}
_LAYOUT_OF = {m: layout for layout, m in _MAGIC_OF.items()}
_HEADER = struct.Struct("<8s8i")  # magic + 8 int32 = 40 bytes
_COUNT = struct.Struct("<i")
_COUNT_OFFSET = 8 + 6 * 4  # n_records is the seventh int32

_log = structlog.get_logger(__name__)

F32Array = npt.NDArray[np.float32]


class KVCacheLike(Protocol):
    """What persistence needs of a KV cache (``runtime.kv.KVCache`` has it; storage does not
    import runtime)."""

    layout: str  # "mla" or "gqa"
    n_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    indexed_layers: tuple[int, ...]
    length: int

    @property
    def tokens(self) -> npt.NDArray[np.int32]: ...
    def latent(self, layer: int, end: int | None = None) -> F32Array: ...
    def k_rope(self, layer: int, end: int | None = None) -> F32Array: ...
    def index_keys(self, layer: int, end: int | None = None) -> F32Array: ...
    def truncate(self, n: int) -> None: ...
    def reserve(self, n: int) -> None: ...
    def write(self, layer: int, start: int, latent: F32Array, k_rope: F32Array) -> None: ...
    def write_index(self, layer: int, start: int, keys: F32Array) -> None: ...
    def write_tokens(self, start: int, ids: npt.NDArray[np.integer]) -> None: ...
    def commit(self, length: int) -> None: ...


CacheT = TypeVar("CacheT", bound=KVCacheLike)


@dataclass(frozen=True, slots=True)
class KVHeader:
    """The 40-byte header; ``identity`` is the reserved eighth word (0 = none recorded)."""

    n_layers: int
    kv_lora: int
    qk_rope: int
    index_head_dim: int
    n_indexed_layers: int
    vocab: int
    n_records: int
    identity: int = 0
    layout: str = "mla"  # from the magic: "mla" (version 1) or "gqa" (version 2)

    @property
    def record_floats(self) -> int:
        """W: 4-byte words per record (the token id included)."""
        return (
            1
            + self.n_layers * (self.kv_lora + self.qk_rope)
            + self.n_indexed_layers * self.index_head_dim
        )

    @property
    def record_nbytes(self) -> int:
        return 4 * self.record_floats

    def file_nbytes(self, n_records: int | None = None) -> int:
        """Size of a file holding ``n_records`` (default: this header's count)."""
        n = self.n_records if n_records is None else n_records
        return _HEADER.size + n * self.record_nbytes

    def dims(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.n_layers,
            self.kv_lora,
            self.qk_rope,
            self.index_head_dim,
            self.n_indexed_layers,
            self.vocab,
        )

    def pack(self) -> bytes:
        return _HEADER.pack(
            _MAGIC_OF[self.layout],
            self.n_layers,
            self.kv_lora,
            self.qk_rope,
            self.index_head_dim,
            self.n_indexed_layers,
            self.vocab,
            self.n_records,
            self.identity,
        )

    @classmethod
    def unpack(cls, raw: bytes) -> KVHeader:
        """Parse 40 bytes; raises :class:`KVFileError` for a short header or bad magic."""
        if len(raw) < _HEADER.size:
            raise KVFileError(f"header is {len(raw)} bytes, expected {_HEADER.size} (truncated)")
        magic, *words = _HEADER.unpack(raw[: _HEADER.size])
        layout = _LAYOUT_OF.get(magic)
        if layout is None:
            raise KVFileError(
                f"bad magic {magic!r} (expected {KV_MAGIC!r} or {KV_MAGIC_GQA!r}): not a "
                ".coli_kv file"
            )
        n_layers, kv_lora, qk_rope, index_dim, n_indexed, vocab, n_records, identity = words
        h = cls(
            n_layers, kv_lora, qk_rope, index_dim, n_indexed, vocab, n_records, identity, layout
        )
        if min(h.n_layers, h.kv_lora, h.qk_rope, h.vocab) <= 0 or min(words[3:7]) < 0:
            raise KVFileError(f"header has impossible dimensions {words}")
        if (
            h.n_indexed_layers > h.n_layers
            or (h.n_indexed_layers and h.index_head_dim <= 0)
            or (layout == "gqa" and h.n_indexed_layers)
        ):
            raise KVFileError(f"header has impossible DSA dimensions {words}")
        return h


def header_for(cache: KVCacheLike, vocab: int, identity: int = 0, n_records: int = 0) -> KVHeader:
    """The header describing ``cache``'s shape."""
    return KVHeader(
        cache.n_layers,
        cache.kv_lora_rank,
        cache.qk_rope_head_dim,
        cache.index_head_dim if cache.indexed_layers else 0,
        len(cache.indexed_layers),
        vocab,
        n_records,
        identity,
        layout=cache.layout,
    )


def slot_path(directory: str | os.PathLike[str], slot: int) -> Path:
    """``<directory>/.coli_kv.<slot>``."""
    return Path(directory) / f"{KV_FILE}.{slot}"


def model_identity(
    model_dir: str | os.PathLike[str], shards: Iterable[str | os.PathLike[str]] | None = None
) -> int:
    """A 31-bit non-zero fingerprint of a model directory's weights, cheap to compute.

    Hashes config.json (canonical JSON); the sha256 of every shard that the converter recorded
    in ``colibri-manifest.json`` (each covers a whole shard: a model converted again from other
    weights, an attention-only fine-tune included, gets another identity); then per shard its
    name, size, safetensors header and last 64 KiB (all a container without a manifest has),
    without reading hundreds of GB. ``shards``: the shard files when they are not all in
    ``model_dir`` (``--model-dir``: a container's ``shards``), hashed in name order."""
    d = Path(model_dir)
    h = hashlib.sha256()
    try:
        config = jsontext.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise KVFileError(f"{d}/config.json: cannot read it for the model identity: {exc}") from exc
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    try:
        manifest = jsontext.loads((d / MANIFEST_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        manifest = None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise KVFileError(
            f"{d}/{MANIFEST_NAME}: cannot read it for the model identity: {exc}"
        ) from exc
    recorded = manifest.get("shards") if isinstance(manifest, dict) else None
    for s in recorded if isinstance(recorded, list) else []:
        if isinstance(s, dict):
            h.update(f"\0{s.get('file')}\0{s.get('sha256')}\0".encode())
    files = shard_paths(d) if shards is None else sorted(map(Path, shards), key=lambda p: p.name)
    for p in files:
        try:
            with open(p, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                h.update(f"\0{p.name}\0{size}\0".encode())
                head = fh.read(8)
                h.update(head)
                if len(head) == 8:
                    n = int.from_bytes(head, "little")
                    h.update(fh.read(min(n, 16 << 20)))
                fh.seek(max(0, size - (64 << 10)))
                h.update(fh.read())
        except OSError as exc:
            raise KVFileError(f"{p}: cannot read it for the model identity: {exc}") from exc
    ident = int.from_bytes(h.digest()[:4], "little") & 0x7FFFFFFF
    return ident or 1


# ------------------------------------------------------------------------------------ records


def _encode(cache: KVCacheLike, start: int, end: int) -> bytes:
    """Records for cache rows [start, end) as bytes ([N, W] little-endian words)."""
    n = end - start
    c, r, di = cache.kv_lora_rank, cache.qk_rope_head_dim, cache.index_head_dim
    w = 1 + cache.n_layers * (c + r) + len(cache.indexed_layers) * di
    out = np.empty((n, w), dtype="<f4")  # [N, W]
    out[:, 0] = cache.tokens[start:end].astype("<i4").view("<f4")
    col = 1
    for layer in range(cache.n_layers):
        out[:, col : col + c] = cache.latent(layer, end)[start:end]  # [N, C]
        out[:, col + c : col + c + r] = cache.k_rope(layer, end)[start:end]  # [N, R]
        col += c + r
    for layer in cache.indexed_layers:
        out[:, col : col + di] = cache.index_keys(layer, end)[start:end]  # [N, DI]
        col += di
    return out.tobytes()


def _decode_into(cache: KVCacheLike, header: KVHeader, data: npt.NDArray[np.float32]) -> None:
    """Fill an empty ``cache`` from records ``data`` [N, W]."""
    n = data.shape[0]
    c, r, di = header.kv_lora, header.qk_rope, header.index_head_dim
    tokens = np.ascontiguousarray(data[:, 0]).view("<i4").astype(np.int64)  # [N]
    if n and (tokens.min() < 0 or tokens.max() >= header.vocab):
        bad = int(np.flatnonzero((tokens < 0) | (tokens >= header.vocab))[0])
        raise KVFileError(
            f"record {bad} holds token id {int(tokens[bad])} outside the vocabulary "
            f"0..{header.vocab - 1} (damaged)"
        )
    if n and not np.isfinite(data[:, 1:]).all():
        raise KVFileError("records hold NaN or infinite values (damaged)")
    if n and float(np.abs(data[:, 1:]).max()) > KV_VALUE_LIMIT:
        # finite but far past any cached activation: one flipped exponent bit makes a value
        # below 2 into one near 1e35, which the attention then turns into an overflow every
        # time the prefix is reused
        raise KVFileError(
            f"records hold values past {KV_VALUE_LIMIT:.0e}, which no cached activation "
            "reaches (damaged)"
        )
    cache.truncate(0)
    cache.reserve(n)
    col = 1
    for layer in range(header.n_layers):
        cache.write(layer, 0, data[:, col : col + c], data[:, col + c : col + c + r])
        col += c + r
    for layer in cache.indexed_layers:
        cache.write_index(layer, 0, data[:, col : col + di])
        col += di
    cache.write_tokens(0, tokens)
    cache.commit(n)


# ------------------------------------------------------------------------------------ reading

#: The largest magnitude a cached key or latent may have: 2**24, far beyond what a trained
#: model's activations reach (float16's largest is 65504), far below what a damaged exponent
#: makes of one.
KV_VALUE_LIMIT = float(2**24)


def read_header(path: str | os.PathLike[str]) -> KVHeader:
    """The header of ``path`` checked against the file size; raises :class:`KVFileError`."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            raw = fh.read(_HEADER.size)
            size = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        raise KVFileError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    h = KVHeader.unpack(raw)
    if h.n_records < 0 or size < h.file_nbytes():
        raise KVFileError(
            f"{h.n_records} records need {h.file_nbytes()} bytes but the file has {size} "
            "(truncated)"
        )
    return h


def _check(h: KVHeader, expect: KVHeader) -> None:
    if h.layout != expect.layout:
        kinds = {"mla": "a compressed MLA cache", "gqa": "a grouped-query K/V cache"}
        raise KVFileError(
            f"holds {kinds[h.layout]} but this model keeps {kinds[expect.layout]} (another "
            "model family)"
        )
    if h.dims() != expect.dims():
        names = ("n_layers", "kv_lora", "qk_rope", "index_head_dim", "n_indexed_layers", "vocab")
        diffs = ", ".join(
            f"{k} {a} != {b}"
            for k, a, b in zip(names, h.dims(), expect.dims(), strict=True)
            if a != b
        )
        raise KVFileError(f"written for another model shape ({diffs})")
    if h.identity and expect.identity and h.identity != expect.identity:
        raise KVFileError(
            f"written for other weights (model identity {h.identity:#x}, this model "
            f"{expect.identity:#x})"
        )


def read_kv(
    path: str | os.PathLike[str], new_cache: Callable[[], CacheT], vocab: int, identity: int = 0
) -> CacheT:
    """The cache stored in ``path``, validated against an empty cache from ``new_cache`` (its
    dimensions), ``vocab`` and ``identity``. Raises :class:`KVFileError` saying what is wrong."""
    p = Path(path)
    cache = new_cache()
    h = read_header(p)
    _check(h, header_for(cache, vocab, identity))
    try:
        with open(p, "rb") as fh:
            fh.seek(_HEADER.size)
            data = np.fromfile(fh, dtype="<f4", count=h.n_records * h.record_floats)
    except OSError as exc:
        raise KVFileError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    if data.size != h.n_records * h.record_floats:
        raise KVFileError(f"{p}: records end early (truncated)")
    _decode_into(cache, h, data.reshape(h.n_records, h.record_floats).astype(np.float32))
    return cache


def read_tokens(path: str | os.PathLike[str], header: KVHeader) -> npt.NDArray[np.int32]:
    """The token ids of ``path``'s records (``header``: its header, already checked), read
    one word per record without the rows (what a server matches prompts against before it
    loads the file). Raises :class:`KVFileError` when the records end early."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size < header.file_nbytes():
            raise KVFileError(f"{p}: records end early (truncated)")
        out = np.zeros(header.n_records, np.int32)
        if header.n_records == 0:
            return out
        fd = os.open(p, os.O_RDONLY)
        try:
            # one word per record (a record is ~100 KiB at DeepSeek scale): no readahead of
            # the rows between them
            if hasattr(os, "posix_fadvise"):  # (a hint: its failure changes nothing)
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for i in range(header.n_records):
                raw = os.pread(fd, 4, _HEADER.size + i * header.record_nbytes)
                if len(raw) != 4:
                    raise KVFileError(f"{p}: records end early (truncated)")
                out[i] = _COUNT.unpack(raw)[0]
        finally:
            os.close(fd)
        return out
    except OSError as exc:
        raise KVFileError(f"{p}: cannot read: {exc.strerror or exc}") from exc


def load_kv(
    path: str | os.PathLike[str], new_cache: Callable[[], CacheT], vocab: int, identity: int = 0
) -> CacheT | None:
    """Like :func:`read_kv`, but a missing file gives None and a damaged or mismatched one is
    reported (structlog warning), renamed aside and ignored (None)."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        return read_kv(p, new_cache, vocab, identity)
    except KVFileError as exc:
        set_aside_and_warn(_log, p, "KV file ignored; the slot starts empty", str(exc))
        return None


# ------------------------------------------------------------------------------------ writing


def write_kv(
    path: str | os.PathLike[str], cache: KVCacheLike, vocab: int, identity: int = 0
) -> None:
    """Write all of ``cache`` to ``path`` atomically (temporary file, fsync, rename)."""
    p = Path(path)
    header = header_for(cache, vocab, identity, cache.length)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "wb") as fh:
            fh.write(header.pack())
            fh.write(_encode(cache, 0, cache.length))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
        tmp = None
        fsync_dir(p.parent)
    except OSError as exc:
        raise KVFileError(f"cannot write {p}: {exc.strerror or exc}") from exc
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _set_count(fd: int, n: int) -> None:
    os.pwrite(fd, _COUNT.pack(n), _COUNT_OFFSET)
    os.fsync(fd)


def sync_kv(
    path: str | os.PathLike[str],
    cache: KVCacheLike,
    *,
    valid: int,
    vocab: int,
    identity: int = 0,
) -> int:
    """Bring ``path`` up to ``cache`` with as little writing as possible; returns the record
    count now on disk (``cache.length``).

    ``valid``: the caller's guarantee that the file's first ``valid`` records equal cache rows
    [0, valid) (rows a generation kept when it reused a prefix). Records beyond it are dropped
    (count lowered first), then rows [valid, length) appended and fsynced, then the count
    rewritten. A missing file, ``valid == 0`` or a header of another shape -> atomic rewrite."""
    p = Path(path)
    valid = max(0, min(valid, cache.length))
    want = header_for(cache, vocab, identity, cache.length)
    if valid == 0 or not p.exists():
        write_kv(p, cache, vocab, identity)
        return cache.length
    try:
        have = read_header(p)
        _check(have, want)
    except KVFileError:
        write_kv(p, cache, vocab, identity)
        return cache.length
    keep = min(valid, have.n_records)
    try:
        fd = os.open(p, os.O_RDWR)
    except OSError as exc:
        raise KVFileError(f"cannot open {p}: {exc.strerror or exc}") from exc
    try:
        if identity and have.identity != identity:  # adopt a file that had none recorded
            os.pwrite(fd, _COUNT.pack(identity), _COUNT_OFFSET + 4)
        if keep < have.n_records:
            _set_count(fd, keep)
        if cache.length > keep:
            os.pwrite(fd, _encode(cache, keep, cache.length), want.file_nbytes(keep))
            os.fsync(fd)
        if cache.length != keep or keep != have.n_records:
            _set_count(fd, cache.length)
        if os.fstat(fd).st_size != want.file_nbytes():
            os.ftruncate(fd, want.file_nbytes())
    except OSError as exc:
        _trim_to_count(fd, want)
        raise KVFileError(f"cannot update {p}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    return cache.length


def _trim_to_count(fd: int, shape: KVHeader) -> None:
    """After a failed update: cut what an append left past the records the file's count
    holds (best effort). On a full disk those bytes held the space the session's messages
    needed next."""
    try:
        n = KVHeader.unpack(os.pread(fd, _HEADER.size, 0)).n_records
        if os.fstat(fd).st_size > shape.file_nbytes(n):
            os.ftruncate(fd, shape.file_nbytes(n))
    except (OSError, KVFileError):
        pass


async def async_sync_kv(
    path: str | os.PathLike[str],
    cache: KVCacheLike,
    *,
    valid: int,
    vocab: int,
    identity: int = 0,
) -> int:
    """:func:`sync_kv` in a worker thread so the event loop never waits on fsync (anyio threads
    rather than aiofiles: the engine also runs on trio). The cache must not change meanwhile."""

    def run() -> int:
        return sync_kv(path, cache, valid=valid, vocab=vocab, identity=identity)

    return await anyio.to_thread.run_sync(run)

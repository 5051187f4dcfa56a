"""``colibri-manifest.json``: what a conversion produced, written last so its presence means done.

The manifest is optional for reading a container (the public int4 containers have none); when it
is there it lets a reader skip format inference and expert discovery, and lets ``coli convert``
and ``coli doctor`` check that every shard is the one the converter wrote.

Schema (format version 1; every offset is an absolute byte offset in the shard file)::

    {
      "format": "colibri-container",
      "format_version": 1,
      "converter_version": "1",
      "model_type": "glm_moe_dsa",
      "num_hidden_layers": 78, "num_mtp_layers": 1,
      "options": {"experts": "int4-g64", "dense": "int4-g64", "io": "int8", "mtp": "int8",
                  "shard_size": 2147483648},
      "source": {"fingerprint": "<sha256 hex>", "files": [{"name": "...", "size": 123}]},
      "shards": [{"file": "out-00000.safetensors", "kind": "main", "size": 123,
                  "sha256": "<hex>", "tensors": 42}],
      "experts": [{"layer": 3, "expert": 0, "shard": "out-00001.safetensors",
                   "start": 8192, "end": 9000, "qs_start": 12288, "qs_end": 12400}],
      "unknown_tensors": ["..."]
    }

``tensors`` counts real tensors (``__pad__.*`` padding excluded). An expert's ``[start, end)``
covers its three matrices (down, gate, up); ``start`` is 4 KiB aligned and the bytes from ``end``
to the next 4 KiB boundary are padding, as are those after ``qs_end`` (``qs_*`` is null when the
expert format has no scales).
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from storage import jsontext
from storage.atomic import atomic_write_bytes, fsync_dir
from storage.errors import ConfigError

__all__ = [
    "CONVERT_STATE_NAME",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ExpertEntry",
    "Manifest",
    "ShardEntry",
    "ShardKind",
    "SourceFile",
    "SourceIdentity",
    "atomic_write_bytes",
    "crc32_range",
    "fsync_dir",
    "read_manifest",
    "sha256_file",
    "verify_shards",
    "with_checksums",
]

MANIFEST_NAME = "colibri-manifest.json"
CONVERT_STATE_NAME = ".colibri-convert.json"  # storage.convert's progress while it runs
FORMAT_NAME = "colibri-container"
FORMAT_VERSION = 1
ShardKind = Literal["main", "mtp"]


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One input file of the conversion (name relative to the source dir, size in bytes)."""

    name: str
    size: int


@dataclass(frozen=True, slots=True)
class SourceIdentity:
    """Which checkpoint a container came from: file list + a fast content fingerprint, and
    ``samples``: a hash of a few bytes from the middle of every tensor (a fine-tune rewrites
    whole tensors inside files whose names, sizes, headers and ends stay the same). Recorded by
    converters since it was added; a record without it is compared by the fingerprint alone."""

    fingerprint: str
    files: tuple[SourceFile, ...]
    samples: str | None = None

    def same_source(self, other: SourceIdentity) -> bool:
        """Whether ``other`` names the same checkpoint (``samples`` compared where both have
        them)."""
        if self.fingerprint != other.fingerprint:
            return False
        return self.samples is None or other.samples is None or self.samples == other.samples

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "fingerprint": self.fingerprint,
            "files": [{"name": f.name, "size": f.size} for f in self.files],
        }
        if self.samples is not None:
            doc["samples"] = self.samples
        return doc

    @staticmethod
    def from_json(doc: object, where: str) -> SourceIdentity:
        d = _obj(doc, where)
        files = [_obj(x, f"{where}.files[]") for x in _list(d, "files", where)]
        samples = d.get("samples")
        if samples is not None and not isinstance(samples, str):
            raise ConfigError(f"{where}: 'samples' must be a string")
        return SourceIdentity(
            _str(d, "fingerprint", where),
            tuple(SourceFile(_str(f, "name", where), _int(f, "size", where)) for f in files),
            samples,
        )


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One output shard and the checksum it had when the converter finished it."""

    file: str
    kind: ShardKind
    size: int
    sha256: str
    tensors: int

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "kind": self.kind,
            "size": self.size,
            "sha256": self.sha256,
            "tensors": self.tensors,
        }

    @staticmethod
    def from_json(doc: object, where: str) -> ShardEntry:
        d = _obj(doc, where)
        kind = _str(d, "kind", where)
        if kind not in ("main", "mtp"):
            raise ConfigError(f"{where}: shard kind {kind!r} is neither 'main' nor 'mtp'")
        return ShardEntry(
            _str(d, "file", where),
            "main" if kind == "main" else "mtp",
            _int(d, "size", where),
            _str(d, "sha256", where),
            _int(d, "tensors", where),
        )


@dataclass(frozen=True, slots=True)
class ExpertEntry:
    """Where one routed expert lives: its three matrices ``[start, end)`` and scales."""

    layer: int
    expert: int
    shard: str
    start: int
    end: int
    qs_start: int | None = None
    qs_end: int | None = None
    # zlib CRC-32 of the bytes [start, end) and [qs_start, qs_end): what ``--verify-reads``
    # checks every read against (None: a manifest written before they were recorded).
    crc32: int | None = None
    qs_crc32: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layer": self.layer,
            "expert": self.expert,
            "shard": self.shard,
            "start": self.start,
            "end": self.end,
            "qs_start": self.qs_start,
            "qs_end": self.qs_end,
        }
        if self.crc32 is not None:
            out["crc32"] = self.crc32
            out["qs_crc32"] = self.qs_crc32
        return out

    @staticmethod
    def from_json(doc: object, where: str) -> ExpertEntry:
        d = _obj(doc, where)
        qs0, qs1 = d.get("qs_start"), d.get("qs_end")
        if (qs0 is None) != (qs1 is None):
            raise ConfigError(f"{where}: qs_start and qs_end must both be set or both be null")
        return ExpertEntry(
            _int(d, "layer", where),
            _int(d, "expert", where),
            _str(d, "shard", where),
            _int(d, "start", where),
            _int(d, "end", where),
            None if qs0 is None else _int(d, "qs_start", where),
            None if qs1 is None else _int(d, "qs_end", where),
            None if d.get("crc32") is None else _int(d, "crc32", where),
            None if d.get("qs_crc32") is None else _int(d, "qs_crc32", where),
        )


@dataclass(frozen=True, slots=True)
class Manifest:
    """The parsed ``colibri-manifest.json`` (see the module docstring for the schema)."""

    converter_version: str
    model_type: str
    num_hidden_layers: int
    num_mtp_layers: int
    options: Mapping[str, str | int]
    source: SourceIdentity
    shards: tuple[ShardEntry, ...]
    experts: tuple[ExpertEntry, ...]
    unknown_tensors: tuple[str, ...] = ()
    format_version: int = FORMAT_VERSION
    _by_expert: dict[tuple[int, int], ExpertEntry] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.validate()
        for e in self.experts:
            self._by_expert[(e.layer, e.expert)] = e

    def validate(self) -> None:
        """Check internal consistency; raises :class:`ConfigError` naming the problem."""
        where = MANIFEST_NAME
        if self.format_version != FORMAT_VERSION:
            raise ConfigError(
                f"{where}: format_version {self.format_version} is not {FORMAT_VERSION}; "
                "this colibri cannot read it (upgrade colibri or reconvert the model)"
            )
        names: dict[str, ShardEntry] = {}
        for s in self.shards:
            if s.file in names:
                raise ConfigError(f"{where}: shard {s.file!r} is listed twice")
            if "/" in s.file or s.file.startswith("."):
                raise ConfigError(f"{where}: shard name {s.file!r} is not a plain file name")
            if s.size < 8 or s.tensors < 0 or len(s.sha256) != 64:
                raise ConfigError(f"{where}: shard {s.file!r} has a bad size/sha256/tensor count")
            names[s.file] = s
        seen: set[tuple[int, int]] = set()
        for e in self.experts:
            key = (e.layer, e.expert)
            if key in seen:
                raise ConfigError(f"{where}: expert {key} is listed twice")
            seen.add(key)
            shard = names.get(e.shard)
            if shard is None:
                raise ConfigError(f"{where}: expert {key} names unknown shard {e.shard!r}")
            spans = [(e.start, e.end)]
            if e.qs_start is not None and e.qs_end is not None:
                spans.append((e.qs_start, e.qs_end))
            for a, b in spans:
                if not 0 <= a < b <= shard.size:
                    raise ConfigError(
                        f"{where}: expert {key} extent [{a}, {b}) lies outside {e.shard} "
                        f"({shard.size} bytes, as this manifest records it)"
                    )

    def expert(self, layer: int, expert: int) -> ExpertEntry | None:
        """The recorded extent of one expert, or None if the manifest does not list it."""
        return self._by_expert.get((layer, expert))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "converter_version": self.converter_version,
            "model_type": self.model_type,
            "num_hidden_layers": self.num_hidden_layers,
            "num_mtp_layers": self.num_mtp_layers,
            "options": dict(self.options),
            "source": self.source.to_json(),
            "shards": [s.to_json() for s in self.shards],
            "experts": [e.to_json() for e in self.experts],
            "unknown_tensors": list(self.unknown_tensors),
        }

    def dumps(self) -> bytes:
        """Deterministic bytes (sorted keys, no timestamps): reruns produce identical files.

        One shard / expert record per line keeps a 20k-expert manifest small and diffable."""
        doc = self.to_json()
        lines = []
        for k in sorted(doc):
            v = doc[k]
            if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                rows = ",\n  ".join(json.dumps(x, sort_keys=True) for x in v)
                lines.append(f" {json.dumps(k)}: [\n  {rows}\n ]")
            else:
                lines.append(f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)}")
        return ("{\n" + ",\n".join(lines) + "\n}\n").encode()

    @staticmethod
    def from_json(doc: object, where: str = MANIFEST_NAME) -> Manifest:
        d = _obj(doc, where)
        if d.get("format") != FORMAT_NAME:
            raise ConfigError(f"{where}: 'format' is {d.get('format')!r}, not {FORMAT_NAME!r}")
        opts_raw = _obj(d.get("options"), f"{where}.options")
        options: dict[str, str | int] = {}
        for k, v in opts_raw.items():
            if isinstance(v, bool) or not isinstance(v, (str, int)):
                raise ConfigError(f"{where}: option {k!r} has a bad value {v!r}")
            options[str(k)] = v
        unknown = _list(d, "unknown_tensors", where)
        if not all(isinstance(x, str) for x in unknown):
            raise ConfigError(f"{where}: unknown_tensors must be a list of strings")
        return Manifest(
            converter_version=_str(d, "converter_version", where),
            model_type=_str(d, "model_type", where),
            num_hidden_layers=_int(d, "num_hidden_layers", where),
            num_mtp_layers=_int(d, "num_mtp_layers", where),
            options=options,
            source=SourceIdentity.from_json(d.get("source"), f"{where}.source"),
            shards=tuple(
                ShardEntry.from_json(x, f"{where}.shards[{i}]")
                for i, x in enumerate(_list(d, "shards", where))
            ),
            experts=tuple(
                ExpertEntry.from_json(x, f"{where}.experts[{i}]")
                for i, x in enumerate(_list(d, "experts", where))
            ),
            unknown_tensors=tuple(str(x) for x in unknown),
            format_version=_int(d, "format_version", where),
        )

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Manifest:
        """Read and validate a manifest file; any problem raises :class:`ConfigError`."""
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from exc
        try:
            doc = jsontext.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"{p}: not valid JSON ({exc}); delete it and reconvert") from exc
        return Manifest.from_json(doc, str(p))

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``colibri-manifest.json`` atomically (tmp + fsync + rename + dir fsync)."""
        dst = Path(directory) / MANIFEST_NAME
        atomic_write_bytes(dst, self.dumps())
        return dst


def read_manifest(directory: str | os.PathLike[str]) -> Manifest | None:
    """The manifest of a model dir, or None when it has none (e.g. a public C-engine container)."""
    p = Path(directory) / MANIFEST_NAME
    if not p.exists():
        return None
    return Manifest.load(p)


def verify_shards(
    directory: str | os.PathLike[str], manifest: Manifest, *, checksums: bool = False
) -> list[str]:
    """Compare shards on disk with the manifest; returns one line per problem (empty: all good).

    Sizes are always checked; ``checksums=True`` also re-hashes every shard (reads all bytes)."""
    d = Path(directory)
    problems: list[str] = []
    for s in manifest.shards:
        p = d / s.file
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            problems.append(f"{s.file}: missing")
            continue
        if size != s.size:
            problems.append(f"{s.file}: {size} bytes, manifest says {s.size}")
            continue
        if checksums:
            got = sha256_file(p)
            if got != s.sha256:
                problems.append(f"{s.file}: sha256 {got[:16]}..., manifest says {s.sha256[:16]}...")
    return problems


def crc32_range(path: str | os.PathLike[str], start: int, end: int, chunk: int = 8 << 20) -> int:
    """zlib CRC-32 of the bytes ``[start, end)`` of a file, read in bounded chunks."""
    crc = 0
    with open(path, "rb") as fh:
        fh.seek(start)
        left = end - start
        while left > 0:
            b = fh.read(min(chunk, left))
            if not b:
                raise OSError(f"{path}: ends before byte {end}")
            crc = zlib.crc32(b, crc)
            left -= len(b)
    return crc


def with_checksums(e: ExpertEntry, path: str | os.PathLike[str]) -> ExpertEntry:
    """``e`` with the CRC-32s of its blob and scales as they are in the shard at ``path``."""
    qs = None
    if e.qs_start is not None and e.qs_end is not None:
        qs = crc32_range(path, e.qs_start, e.qs_end)
    return replace(e, crc32=crc32_range(path, e.start, e.end), qs_crc32=qs)


def sha256_file(
    path: str | os.PathLike[str], chunk: int = 8 << 20, *, uncached: bool = False
) -> str:
    """Hex sha256 of a whole file, read in bounded chunks. ``uncached``: drop the file's clean
    pages from the page cache first (``posix_fadvise(DONTNEED)``), so what is hashed is read
    from the drive, not what was just written (where the kernel keeps the pages: not on tmpfs)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        if uncached and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        while True:
            b = fh.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


# ----------------------------------------------------------------------------- json helpers


def _obj(doc: object, where: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    return doc


def _list(d: Mapping[str, Any], key: str, where: str) -> Sequence[Any]:
    v = d.get(key)
    if not isinstance(v, list):
        raise ConfigError(f"{where}: {key!r} must be a list")
    return v


def _str(d: Mapping[str, Any], key: str, where: str) -> str:
    v = d.get(key)
    if not isinstance(v, str):
        raise ConfigError(f"{where}: {key!r} must be a string")
    return v


def _int(d: Mapping[str, Any], key: str, where: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"{where}: {key!r} must be a non-negative integer")
    return v


def add_checksums(directory: str | os.PathLike[str]) -> Manifest:
    """Record per-expert CRC-32s in the manifest of a container converted before they existed.

    Every shard is first checked against the manifest's sha256, so the checksums describe the
    bytes the converter wrote, not damage that happened since."""
    d = Path(directory)
    m = read_manifest(d)
    if m is None:
        raise ConfigError(f"{d}: no {MANIFEST_NAME} (only converted containers have one)")
    bad = verify_shards(d, m, checksums=True)
    if bad:
        raise ConfigError(f"{d}: shards differ from the manifest: {'; '.join(bad)}")
    fresh = replace(m, experts=tuple(with_checksums(e, d / e.shard) for e in m.experts))
    fresh.save(d)
    return fresh


if __name__ == "__main__":  # python -m storage.manifest add-checksums DIR
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "add-checksums":
        sys.exit("usage: python -m storage.manifest add-checksums DIR")
    try:
        done = add_checksums(sys.argv[2])
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    print(f"{sys.argv[2]}: CRC-32 recorded for {len(done.experts)} experts")

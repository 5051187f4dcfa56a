"""Copies of a model's shard files: which device a path lives on, and whether a file can stand in
for another (same size, same safetensors header bytes, and not staged from other weights).

A *copy* is one directory holding (some of) the model's shard files; :func:`open_copies`
checks each file against the primary's and keeps only those that match, with one warning per
refused file. :func:`compare_copy_file` is also the rule for a shard found in two
``--model-dir`` directories (:meth:`storage.container.Container.open`).

Size and header bytes cannot tell a model converted again from other weights (an attention-only
fine-tune's shards have the same tensors, so the same sizes and headers) from the one a mirror
was staged from: the mirror's record (``colibri-mirror.json``, written by ``coli mirror stage``)
says what each file was staged as, :func:`stale_copy` compares that with the model now (the
manifest's sha256, else the source file's size and modification time).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from storage import jsontext

__all__ = [
    "MIRROR_FORMAT",
    "MIRROR_RECORD",
    "DeviceId",
    "ModelCopy",
    "compare_copy_file",
    "device_of",
    "header_bytes",
    "mirror_record",
    "open_copies",
    "source_stamp",
    "stale_copy",
]

MIRROR_RECORD = "colibri-mirror.json"
MIRROR_FORMAT = "colibri-mirror"

_MAX_HEADER = 100 * 1024 * 1024

_log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------- device identity
@dataclass(frozen=True, slots=True)
class DeviceId:
    """Which device a path lives on: ``st_dev`` plus the mount's source and mount point from
    ``/proc/self/mountinfo`` (empty strings when unavailable)."""

    st_dev: int
    name: str
    mount: str
    fstype: str

    @property
    def key(self) -> str:
        """A stable text id: ``<source>@<major>:<minor>``."""
        return f"{self.name or '?'}@{os.major(self.st_dev)}:{os.minor(self.st_dev)}"

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return {
            "st_dev": self.st_dev,
            "name": self.name,
            "mount": self.mount,
            "fstype": self.fstype,
            "key": self.key,
        }


def _unescape_mount(text: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as 3-digit octal."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and text[i + 1 : i + 4].isdigit() and i + 4 <= len(text):
            out.append(chr(int(text[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def device_of(path: str | os.PathLike[str], mountinfo: str = "/proc/self/mountinfo") -> DeviceId:
    """The :class:`DeviceId` of ``path`` (``OSError`` if it cannot be stat'ed)."""
    st = os.stat(path)
    real = os.path.realpath(path)
    majmin = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    best: tuple[int, int, str, str, str] | None = None  # (same dev, len, mount, fstype, source)
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split()
                try:
                    sep = parts.index("-")
                except ValueError:
                    continue
                if sep < 5 or len(parts) < sep + 3:
                    continue
                mnt = _unescape_mount(parts[4])
                if not (real == mnt or real.startswith(mnt.rstrip("/") + "/")):
                    continue
                cand = (int(parts[2] == majmin), len(mnt), mnt, parts[sep + 1], parts[sep + 2])
                if best is None or cand[:2] >= best[:2]:
                    best = cand
    except OSError:
        best = None
    if best is None:
        return DeviceId(st.st_dev, "", "", "")
    return DeviceId(st.st_dev, _unescape_mount(best[4]), best[2], best[3])


# --------------------------------------------------------------------------- copy files
def header_bytes(path: str | os.PathLike[str]) -> bytes:
    """The safetensors header of ``path``: the 8-byte length prefix plus the ``N`` JSON bytes.

    Raises ``OSError`` when unreadable and ``ValueError`` when it is not a safetensors file."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors length prefix")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise ValueError(f"header length {n} is implausible")
        body = fh.read(n)
        if len(body) != n:
            raise ValueError(f"header of {n} bytes runs past the end of the file")
    return head + body


def compare_copy_file(primary: Path, copy: Path) -> str | None:
    """None when ``copy`` can stand in for ``primary`` (same size, same header bytes), else
    why not, in words."""
    try:
        want = primary.stat().st_size
        got = copy.stat().st_size
    except OSError as exc:
        return f"cannot stat: {exc.strerror or exc}"
    if got != want:
        return f"size {got} differs from the primary's {want} bytes"
    try:
        a = header_bytes(primary)
        b = header_bytes(copy)
    except (OSError, ValueError) as exc:
        return f"header unreadable: {exc}"
    if a != b:
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        where = f" (first difference at byte {first})" if first is not None else ""
        return f"header bytes differ from the primary's{where}"
    return None


def mirror_record(to: Path) -> dict[str, Any]:
    """The mirror record in ``to`` (``colibri-mirror.json``), or {} when there is none or it
    is not one."""
    try:
        doc = jsontext.loads((to / MIRROR_RECORD).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return doc if isinstance(doc, dict) and doc.get("format") == MIRROR_FORMAT else {}


def source_stamp(src: Path) -> dict[str, int]:
    """What a mirror record keeps of the file a copy was staged from, for :func:`stale_copy`
    on a model without checksums: its size and modification time (ns)."""
    st = src.stat()
    return {"source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns}


def copy_stamp(copy: Path) -> dict[str, int]:
    """What a mirror record keeps of the staged copy itself (inode and change time: anything
    that writes the file, renames another over it or copies one in changes them) for
    :func:`stale_copy` to notice a copy replaced after it was staged."""
    st = copy.stat()
    return {"copy_ino": st.st_ino, "copy_ctime_ns": st.st_ctime_ns}


def changed_copy(copy: Path, entry: object) -> str | None:
    """Why the copy a mirror record ``entry`` describes is no longer the file that was staged
    and checked (another file of the same name, size and header put there), or None."""
    if not isinstance(entry, dict):
        return None
    ino, ctime = entry.get("copy_ino"), entry.get("copy_ctime_ns")
    if not isinstance(ino, int) or not isinstance(ctime, int):
        return None  # a record from before copies were stamped
    try:
        now = copy_stamp(copy)
    except OSError as exc:
        return f"cannot stat: {exc.strerror or exc}"
    if now != {"copy_ino": ino, "copy_ctime_ns": ctime}:
        return (
            "the file changed after it was staged (written, replaced or copied over); run "
            "`coli mirror stage` again to check it (a copy that still matches is kept, not "
            "copied again)"
        )
    return None


def stale_copy(primary: Path, entry: object, expected_sha256: str | None) -> str | None:
    """Why the copy a mirror record ``entry`` describes was staged from other weights than
    ``primary`` holds now, or None when nothing says so (no record entry: a copy made by hand
    is judged by size and header alone).

    With the model's checksum (``colibri-manifest.json``), the recorded sha256 must equal it;
    without, the source file must still have the size and modification time it had when staged
    (a model converted again in place rewrites its files)."""
    if not isinstance(entry, dict):
        return None
    rec = entry.get("sha256")
    if expected_sha256 is not None:
        if isinstance(rec, str) and rec != expected_sha256:
            return (
                f"staged from other weights: colibri-mirror.json records sha256 {rec[:16]}..., "
                f"the model's colibri-manifest.json {expected_sha256[:16]}...; run `coli mirror "
                "stage` again"
            )
        return None
    size, mtime = entry.get("source_size"), entry.get("source_mtime_ns")
    if not isinstance(size, int) or not isinstance(mtime, int):
        return None
    try:
        now = source_stamp(primary)
    except OSError as exc:
        return f"cannot stat the model's file: {exc.strerror or exc}"
    if now != {"source_size": size, "source_mtime_ns": mtime}:
        return (
            "the model's file was rewritten after this copy was staged (the model converted "
            "again?); run `coli mirror stage` again to check and re-copy it"
        )
    return None


@dataclass(frozen=True)
class ModelCopy:
    """One copy of (some of) the model's shard files on one device.

    ``files`` maps each primary shard path this copy can serve to its own file; ``skipped``
    names the files (or the whole directory, under ``"*"``) it cannot serve, and why."""

    index: int
    root: Path
    device: DeviceId | None
    files: Mapping[Path, Path]
    skipped: Mapping[str, str] = field(default_factory=dict)

    @property
    def role(self) -> str:
        """``"primary"`` or ``"mirror"``."""
        return "primary" if self.index == 0 else "mirror"

    def holds(self, primary_paths: Sequence[Path]) -> bool:
        """Whether every one of ``primary_paths`` has a usable copy here."""
        return all(p in self.files for p in primary_paths)


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _safe_device(path: Path) -> DeviceId | None:
    try:
        return device_of(path)
    except OSError:
        return None


def open_copies(
    primary: Path,
    shard_files: Sequence[Path],
    mirrors: Sequence[Path],
    checksums: Mapping[str, str] | None = None,
) -> list[ModelCopy]:
    """The primary (index 0) and one :class:`ModelCopy` per mirror directory, in order (blocking).

    A mirror file is used only when its size and header bytes equal the primary's and its
    mirror record does not say it was staged from other weights (:func:`stale_copy`;
    ``checksums``: the manifest's sha256 by shard file name); a mismatch is logged once (a
    warning naming the file and why) and the file is left unused. A mirror directory that is
    missing, or the primary itself, yields a copy holding no files; one on the primary's own
    drive is used, with a warning (it adds no bandwidth)."""
    sums = checksums or {}
    primary_dev = _safe_device(primary)
    out = [ModelCopy(0, primary, primary_dev, {p: p for p in shard_files})]
    for i, m in enumerate(mirrors, start=1):
        root = Path(m)
        if not root.is_dir():
            what = "does not exist" if not root.exists() else "is not a directory"
            _log.warning("mirror unused", mirror=str(root), reason=f"the mirror {what}")
            out.append(ModelCopy(i, root, None, {}, {"*": f"the mirror {what}"}))
            continue
        try:
            same = os.path.samefile(root, primary)
        except OSError:
            same = False
        if same:
            _log.warning("mirror unused", mirror=str(root), reason="it is the primary directory")
            out.append(ModelCopy(i, root, _safe_device(root), {}, {"*": "the primary itself"}))
            continue
        twin = next((c for c in out[1:] if c.files and _same_dir(c.root, root)), None)
        if twin is not None:  # (--mirror M --mirror /abs/M: it took two shares of one drive)
            dup = f"the same directory as mirror {twin.index} ({twin.root})"
            _log.warning("mirror unused", mirror=str(root), reason=dup)
            out.append(ModelCopy(i, root, _safe_device(root), {}, {"*": dup}))
            continue
        files: dict[Path, Path] = {}
        skipped: dict[str, str] = {}
        recorded = mirror_record(root).get("files")
        entries = recorded if isinstance(recorded, dict) else {}
        for p in shard_files:
            q = root / p.name
            if not q.exists():
                skipped[p.name] = "absent (partial mirror)"
                continue
            try:
                if os.path.samefile(p, q):
                    why: str | None = "the same file as the primary's (a link)"
                else:
                    entry = entries.get(p.name)
                    why = (
                        compare_copy_file(p, q)
                        or stale_copy(p, entry, sums.get(p.name))
                        or changed_copy(q, entry)
                    )
            except OSError as exc:
                why = f"cannot stat: {exc.strerror or exc}"
            if why is not None:
                _log.warning("mirror file refused", file=str(q), reason=why)
                skipped[p.name] = why
                continue
            files[p] = q
        device = _safe_device(root)
        if not files:
            _log.warning(
                "mirror unused", mirror=str(root), reason="it holds none of the model's shards"
            )
        elif device is not None and primary_dev is not None and device.st_dev == primary_dev.st_dev:
            _log.warning(
                "mirror on the model's own drive",
                mirror=str(root),
                device=device.key,
                reason="two copies on one drive add no bandwidth (is the second drive mounted?)",
            )
        out.append(ModelCopy(i, root, device, files, skipped))
    return out

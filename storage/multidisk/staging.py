"""Partial mirrors: put the shard files holding the hottest experts on a second drive.

``coli mirror plan|stage|verify --model DIR [--model-dir DIR ...] --to DIR2 [--budget 50GiB]``.

A partial mirror is a directory holding *whole* shard files of the model (byte-identical
copies): the engine (``--mirror DIR2``, see :mod:`storage.multidisk`) uses a mirror file only when
its size and header bytes equal the primary's, and reads the other experts from the primary.

- :func:`plan_mirror` ranks experts by their routing counts in ``.coli_usage`` (hottest first;
  without a history, in file order) and walks them, adding the shard files each expert needs
  (its blob's shard and its scales' shards) while they fit the budget, until the budget is used.
- :func:`stage_mirror` copies the planned files: each is written to a hidden ``.<name>.part``,
  hashed with sha256 while copying (checked against ``colibri-manifest.json`` when the model has
  one), fsync'ed, re-read and re-hashed, then renamed into place and the directory fsync'ed, so
  a crash never leaves a torn shard under a real name. A rerun skips files that verify, and
  resumes a ``.part`` file after checking its copied prefix against the source. Verified
  checksums are recorded in ``colibri-mirror.json`` in the mirror.
  Files an earlier stage recorded that the plan leaves out (a smaller budget, a moved
  routing history) are removed first, so the mirror stays within the plan's budget.
- :func:`verify_mirror` re-checks every shard file of a mirror: size, header bytes, sha256.

A model whose shards are spread over several directories (``--model-dir``) is read through the
container's shard lookup (:func:`storage.container.find_shards`, ``Container.dirs``): each
source file is taken from whichever directory holds it, and the mirror may be none of them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from storage.container import Container, find_shards
from storage.errors import ColibriError, UsageFileError
from storage.manifest import (
    MANIFEST_NAME,
    Manifest,
    atomic_write_bytes,
    fsync_dir,
    read_manifest,
    sha256_file,
)
from storage.multidisk.identity import (
    MIRROR_FORMAT,
    MIRROR_RECORD,
    compare_copy_file,
    copy_stamp,
    device_of,
    mirror_record,
    source_stamp,
    stale_copy,
)
from storage.units import format_bytes
from storage.usage import parse_usage

__all__ = [
    "MIRROR_RECORD",
    "MirrorPlan",
    "PlannedFile",
    "StageReport",
    "VerifyReport",
    "default_budget",
    "plan_mirror",
    "stage_mirror",
    "verify_mirror",
]

MIRROR_VERSION = 1
CHUNK = 8 << 20

Progress = Callable[[str, int, int], None]
"""``progress(file name, bytes done, file size)`` after each copied chunk."""

_log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class PlannedFile:
    """One shard file of the model that holds routed experts."""

    file: str
    size: int
    experts: int  # routed experts whose blob lives here
    selections: int  # their routing selections in the usage history
    sha256: str | None  # from colibri-manifest.json, when the model has one

    def to_json(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return {
            "file": self.file,
            "size": self.size,
            "experts": self.experts,
            "selections": self.selections,
            "sha256": self.sha256,
        }


@dataclass(frozen=True)
class MirrorPlan:
    """Which shard files go to the mirror (``files``, in the order they were chosen)."""

    model: Path
    to: Path
    budget: int
    files: tuple[PlannedFile, ...]
    left_out: tuple[PlannedFile, ...]
    usage_path: Path | None
    usage_found: bool
    selections_total: int
    selections_covered: int
    experts_total: int
    experts_covered: int
    dirs: tuple[Path, ...] = ()  # every directory searched for shards, ``model`` first
    sources: dict[str, Path] = field(default_factory=dict)  # shard name -> the file to copy

    def source(self, name: str) -> Path:
        """The model's file ``name`` (in whichever of :attr:`dirs` holds it)."""
        return self.sources.get(name, self.model / name)

    @property
    def nbytes(self) -> int:
        """Bytes of the planned files."""
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON (what ``coli mirror plan`` prints)."""
        record = _load_record(self.to)
        cov = self.selections_covered / self.selections_total if self.selections_total else None
        return {
            "model": str(self.model),
            "model_dirs": [str(d) for d in self.dirs if d != self.model],
            "to": str(self.to),
            "budget_bytes": self.budget,
            "planned_bytes": self.nbytes,
            "usage": {
                "path": None if self.usage_path is None else str(self.usage_path),
                "found": self.usage_found,
                "selections": self.selections_total,
            },
            "experts_total": self.experts_total,
            "experts_covered": self.experts_covered,
            "selection_coverage": cov,
            "files": [
                {
                    **f.to_json(),
                    "source": str(self.source(f.file)),
                    "status": _status(
                        self.source(f.file), self.to / f.file, record.get(f.file), f.sha256
                    ),
                }
                for f in self.files
            ],
            "left_out": [f.to_json() for f in self.left_out],
        }


def _status(src: Path, dst: Path, entry: object, expected: str | None) -> str:
    """``missing``, ``present`` (same size and header, and its record, ``entry``, not staged from
    other weights) or ``differs`` (to be replaced)."""
    if not dst.exists():
        return "missing"
    ok = compare_copy_file(src, dst) is None and stale_copy(src, entry, expected) is None
    return "present" if ok else "differs"


def _size_or_zero(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _part(dst: Path) -> Path:
    """The unfinished copy of ``dst`` a stage leaves when interrupted."""
    return dst.with_name(f".{dst.name}.part")


def _existing_parent(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def default_budget(to: Path, already_there: int = 0) -> int:
    """95% of the free space on the drive holding ``to`` plus what is already staged there
    (``already_there``: the bytes of the model's files and unfinished copies in ``to``, which a
    stage keeps, resumes or replaces)."""
    st = os.statvfs(_existing_parent(to))
    return int(0.95 * st.f_bavail * st.f_frsize) + already_there


def _load_counts(
    usage_path: Path | None, n_layers: int, n_experts: int, engine_id: str
) -> npt.NDArray[np.int64] | None:
    if usage_path is None or not usage_path.is_file():
        _log.warning(
            "no routing history for the mirror plan; ranking experts in file order (run the "
            "model a while first, or pass --state-dir, for a mirror of the hottest experts)",
            path=None if usage_path is None else str(usage_path),
        )
        return None
    try:
        text = usage_path.read_text(encoding="ascii")
        return parse_usage(text, n_layers, n_experts, engine_id).counts
    except (OSError, UnicodeDecodeError, UsageFileError) as exc:
        _log.warning(
            "usage history unusable for the mirror plan; ranking experts in file order",
            path=str(usage_path),
            error=str(exc),
        )
        return None


def plan_mirror(
    model: str | os.PathLike[str],
    to: str | os.PathLike[str],
    *,
    budget: int | None = None,
    usage_path: str | os.PathLike[str] | None = None,
    engine_id: str = "colibri-py-1",
    model_dirs: Sequence[str | os.PathLike[str]] = (),
) -> MirrorPlan:
    """Plan a (partial) mirror of ``model`` in ``to`` within ``budget`` bytes.

    ``usage_path`` is the ``.coli_usage`` to rank experts by (hottest first); without it, or when
    it does not parse, experts are ranked in file order. ``budget`` None means the free space
    on ``to``'s drive (see :func:`default_budget`). ``model_dirs``: more directories holding
    some of the model's shards (``--model-dir``); each file is copied from the one holding it."""
    c = Container.open(model, shard_dirs=model_dirs)
    src, dst = Path(model), Path(to)
    _check_target(dst, src, tuple(c.dirs))
    paths = {s.path.name: s.path for s in c.shards}
    manifest = read_manifest(src)
    sums = {s.file: s.sha256 for s in manifest.shards} if manifest is not None else {}
    n_e = c.arch.n_routed_experts
    upath = Path(usage_path) if usage_path is not None else None
    counts = _load_counts(upath, c.arch.total_layers, n_e, engine_id)

    def count(layer: int, expert: int) -> int:
        if counts is None or layer >= counts.shape[0]:
            return 0
        return int(counts[layer, expert])

    extents = c.expert_extents()
    per_file: dict[str, list[int]] = {}  # file -> [experts, selections]
    needs: list[tuple[int, int, int, list[str]]] = []  # (-count, layer, expert, files)
    for x in extents:
        n = count(x.layer, x.expert)
        acc = per_file.setdefault(x.path.name, [0, 0])
        acc[0] += 1
        acc[1] += n
        scale_files = {s.path.name for s in x.scales.values() if s is not None} - {x.path.name}
        files = [x.path.name, *sorted(scale_files)]
        needs.append((-n, x.layer, x.expert, files))
    needs.sort()
    sizes = {s.path.name: s.file_size for s in c.shards}

    def entry(name: str) -> PlannedFile:
        e, sel = per_file.get(name, [0, 0])
        return PlannedFile(name, sizes[name], e, sel, sums.get(name))

    if budget is None:
        # Every byte the model's files (whole, damaged or unfinished) take in the mirror is
        # the plan's to use: a stage keeps what verifies, replaces what does not and resumes
        # or restarts a .part. Counting only verified files shrank the budget by a damaged
        # copy's size, and the plan then dropped (and the stage removed) a good file to fit.
        there = sum(_size_or_zero(dst / n) + _size_or_zero(_part(dst / n)) for n in per_file)
        budget = default_budget(dst, there)
    chosen: list[str] = []
    used = 0
    covered_sel = covered_exp = 0
    for neg, _layer, _expert, files in needs:
        extra = [f for f in dict.fromkeys(files) if f not in chosen]
        cost = sum(sizes[f] for f in extra)
        if used + cost <= budget:
            chosen.extend(extra)
            used += cost
            covered_exp += 1
            covered_sel += -neg
    left = [n for n in per_file if n not in chosen]
    total_sel = int(counts.sum()) if counts is not None else 0
    return MirrorPlan(
        model=src,
        to=dst,
        budget=int(budget),
        files=tuple(entry(n) for n in chosen),
        left_out=tuple(entry(n) for n in left),
        usage_path=upath,
        usage_found=counts is not None,
        selections_total=total_sel,
        selections_covered=covered_sel,
        experts_total=len(extents),
        experts_covered=covered_exp,
        dirs=tuple(c.dirs),
        sources=paths,
    )


def _check_target(to: Path, model: Path, dirs: Sequence[Path]) -> None:
    """A mirror directory must be a directory (or not exist yet), not one of the model's own
    directories, and not another model's mirror: plan, stage and verify all refuse those. One
    on the model's own drive (an unmounted second SSD is a plain directory) is warned about."""
    if to.exists() and not to.is_dir():
        raise ColibriError(f"{to} is not a directory; --to takes the mirror's directory")
    for d in dict.fromkeys((model, *dirs)):
        try:
            same = os.path.samefile(to, d)
        except OSError:
            continue
        if same:
            what = "the model directory itself" if d == model else "one of the model's dirs"
            raise ColibriError(f"{to} is {what} ({d}); pick a directory on another drive")
    if to.is_dir() and not mirror_record(to):
        held = [n for n in (MANIFEST_NAME, "config.json") if (to / n).exists()]
        if held:
            raise ColibriError(
                f"{to} holds {held[0]}: it is a model's directory, not a mirror; staging would "
                "replace its files (pick an empty directory or an existing mirror of this model)"
            )
    other = mirror_record(to).get("model")
    if isinstance(other, str) and Path(other) != model.resolve():
        raise ColibriError(
            f"{to} is a mirror of another model ({other}); pick another directory (or remove "
            "that mirror first)"
        )
    try:
        there, here = device_of(_existing_parent(to)), device_of(model)
    except OSError:
        return
    if there.st_dev == here.st_dev:
        _log.warning(
            "the mirror is on the model's own drive: two copies on one drive add no bandwidth "
            "(is the second drive mounted?)",
            to=str(to),
            device=there.key,
            mount=there.mount,
        )


# --------------------------------------------------------------------------- record
def _load_record(to: Path) -> dict[str, Any]:
    files = mirror_record(to).get("files")
    return dict(files) if isinstance(files, dict) else {}


def _save_record(to: Path, model: Path, files: dict[str, Any], dirs: Sequence[Path] = ()) -> None:
    doc = {
        "format": MIRROR_FORMAT,
        "version": MIRROR_VERSION,
        "model": str(model.resolve()),
        "model_dirs": [str(d.resolve()) for d in dirs if d != model],
        "files": dict(sorted(files.items())),
    }
    atomic_write_bytes(to / MIRROR_RECORD, (json.dumps(doc, indent=1) + "\n").encode())


def _record_entry(f: PlannedFile, sha256: str | None, src: Path, dst: Path) -> dict[str, Any]:
    """A staged file's line in the mirror record: its size and checksum, the source's stamp
    (:func:`stale_copy`) and the copy's own (:func:`changed_copy`)."""
    return {"size": f.size, "sha256": sha256, **source_stamp(src), **copy_stamp(dst)}


def _expected_sha(name: str, manifest: Manifest | None) -> str | None:
    """The checksum a copy of ``name`` must have: the manifest's, else None (hash the source)."""
    if manifest is not None:
        for s in manifest.shards:
            if s.file == name:
                return s.sha256
    return None


# --------------------------------------------------------------------------- stage
@dataclass
class StageReport:
    """What :func:`stage_mirror` did."""

    to: Path
    copied: list[str] = field(default_factory=list)
    verified: list[str] = field(default_factory=list)  # already there and verified: skipped
    resumed: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # there but wrong: copied again
    removed: list[str] = field(default_factory=list)  # staged before, outside this plan
    bytes_copied: int = 0
    bytes_removed: int = 0

    def to_json(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return {
            "to": str(self.to),
            "copied": self.copied,
            "verified": self.verified,
            "resumed": self.resumed,
            "replaced": self.replaced,
            "removed": self.removed,
            "bytes_copied": self.bytes_copied,
            "bytes_removed": self.bytes_removed,
        }


def _same_prefix(src: Path, part: Path, n: int, chunk: int, h: Any) -> bool:
    """Whether the first ``n`` bytes of ``part`` equal ``src``'s (``h`` hashes the source)."""
    with open(src, "rb") as a, open(part, "rb") as b:
        done = 0
        while done < n:
            k = min(chunk, n - done)
            x, y = a.read(k), b.read(k)
            if len(x) != k or x != y:
                return False
            h.update(x)
            done += k
    return True


def _copy(
    src: Path,
    dst: Path,
    expected: str | None,
    chunk: int,
    progress: Progress | None,
    model: Path | None = None,
) -> tuple[str, bool]:
    """Copy ``src`` to ``dst`` through ``.<name>.part``; returns (sha256, resumed). ``model``:
    the model directory to name in a hint (default: ``src``'s directory)."""
    part = _part(dst)
    size = src.stat().st_size
    for attempt in range(2):
        h = hashlib.sha256()
        pos = 0
        if attempt == 0 and part.exists():
            have = part.stat().st_size
            have = min(have - have % chunk, size - size % chunk)
            if have > 0 and _same_prefix(src, part, have, chunk, h):
                pos = have
            else:
                h = hashlib.sha256()
        resumed = pos > 0
        with open(src, "rb") as fi, open(part, "r+b" if resumed else "wb") as fo:
            fo.truncate(pos)
            fi.seek(pos)
            fo.seek(pos)
            while True:
                b = fi.read(chunk)
                if not b:
                    break
                h.update(b)
                fo.write(b)
                pos += len(b)
                if progress is not None:
                    progress(dst.name, pos, size)
            fo.flush()
            os.fsync(fo.fileno())
        digest = h.hexdigest()
        if expected is not None and digest != expected:
            part.unlink(missing_ok=True)
            if resumed:  # the kept prefix may be what is wrong: start over once
                continue
            raise ColibriError(
                f"{src}: sha256 {digest[:16]}... does not match colibri-manifest.json "
                f"({expected[:16]}...); the model itself is damaged: run `coli doctor --model "
                f"{model or src.parent}`"
            )
        # What landed on disk must be what was read (and the header what the engine checks):
        # read back from the drive, not from the pages the copy just wrote.
        if sha256_file(part, uncached=True) != digest or compare_copy_file(src, part) is not None:
            part.unlink(missing_ok=True)
            if attempt == 0:
                continue
            raise ColibriError(f"{dst}: the copy does not read back as written; check the drive")
        os.replace(part, dst)
        fsync_dir(dst.parent)
        return digest, resumed
    raise ColibriError(f"{dst}: could not stage a verified copy")  # pragma: no cover


def _verify_file(
    src: Path, dst: Path, expected: str | None, *, checksums: bool = True
) -> tuple[str | None, str | None]:
    """(problem or None, sha256 of ``dst`` or None when not hashed)."""
    why = compare_copy_file(src, dst)
    if why is not None:
        return why, None
    if not checksums:
        return None, None
    got = sha256_file(dst, uncached=True)
    want = expected if expected is not None else sha256_file(src)
    if got != want:
        return f"sha256 {got[:16]}... differs from the expected {want[:16]}...", got
    return None, got


def _drop_unplanned(plan: MirrorPlan, record: dict[str, Any], report: StageReport) -> None:
    """Remove the files an earlier stage copied (they are in the mirror's record) that this
    plan leaves out, with their unfinished ``.part`` copies, before anything is copied: a
    mirror re-staged with a smaller budget (or after the routing history moved) then holds
    this plan's files only, within its budget, and the space they took is free for the new
    ones. Files the record does not list are not colibri's to remove and stay."""
    planned = {f.file for f in plan.files}
    to = plan.to
    for name in sorted(set(record) - planned):
        if Path(name).name != name:  # a record edited by hand: never leave the mirror
            record.pop(name)
            continue
        path = to / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = -1
        if size >= 0:
            path.unlink()
            report.removed.append(name)
            report.bytes_removed += size
        (to / f".{name}.part").unlink(missing_ok=True)
        record.pop(name)
    if report.removed:
        fsync_dir(to)
        _save_record(to, plan.model, record, plan.dirs)
        _log.info("mirror files outside the plan removed", files=report.removed, to=str(to))


def stage_mirror(
    plan: MirrorPlan, *, chunk_bytes: int = CHUNK, progress: Progress | None = None
) -> StageReport:
    """Copy ``plan.files`` into ``plan.to`` (atomic per file, resumable, checksummed)."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be > 0")
    to = plan.to
    _check_target(to, plan.model, plan.dirs)
    to.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(plan.model)
    record = _load_record(to)
    report = StageReport(to)
    _drop_unplanned(plan, record, report)
    # An unfinished copy's bytes are there already (resumed, or overwritten in place).
    need = sum(
        max(0, f.size - _size_or_zero(_part(to / f.file)))
        for f in plan.files
        if not (to / f.file).exists()
    )
    free = shutil.disk_usage(to).free
    if need > free:
        raise ColibriError(
            f"{to}: the plan needs {format_bytes(need)} more but the drive has "
            f"{format_bytes(free)} free; lower --budget"
        )
    for f in plan.files:
        src, dst = plan.source(f.file), to / f.file
        expected = _expected_sha(f.file, manifest)
        if dst.exists():
            problem, got = _verify_file(src, dst, expected)
            if problem is None:
                report.verified.append(f.file)
                record[f.file] = _record_entry(f, got, src, dst)
                continue
            if f.file not in record:
                raise ColibriError(
                    f"{dst} is not a copy of {src} ({problem}) and colibri did not stage it "
                    "(colibri-mirror.json does not list it): it is left alone; move it away "
                    "or pick another --to directory"
                )
            _log.warning("mirror file replaced", file=str(dst), reason=problem)
            report.replaced.append(f.file)
            dst.unlink()
        try:
            digest, resumed = _copy(src, dst, expected, chunk_bytes, progress, plan.model)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise ColibriError(
                f"{to}: the drive filled up while copying {f.file} ("
                f"{format_bytes(_size_or_zero(_part(dst)))} of {format_bytes(f.size)} copied, "
                f"kept as {_part(dst).name}: a rerun resumes it); free space there or lower "
                "--budget"
            ) from exc
        report.copied.append(f.file)
        if resumed:
            report.resumed.append(f.file)
        report.bytes_copied += f.size
        record[f.file] = _record_entry(f, digest, src, dst)
        _save_record(to, plan.model, record, plan.dirs)
    _save_record(to, plan.model, record, plan.dirs)
    return report


# --------------------------------------------------------------------------- verify
@dataclass
class VerifyReport:
    """What :func:`verify_mirror` found (``ok`` when every shard file checks out)."""

    model: Path
    to: Path
    files: list[dict[str, Any]] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)  # unfinished .part files (stage resumes)

    @property
    def ok(self) -> bool:
        """True when no file has a problem."""
        return all(f["problem"] is None for f in self.files)

    def to_json(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return {
            "model": str(self.model),
            "to": str(self.to),
            "ok": self.ok,
            "files": self.files,
            "partial": self.partial,
        }


def verify_mirror(
    model: str | os.PathLike[str],
    to: str | os.PathLike[str],
    *,
    checksums: bool = True,
    model_dirs: Sequence[str | os.PathLike[str]] = (),
) -> VerifyReport:
    """Re-check every ``*.safetensors`` in the mirror ``to`` against the model: size and header
    bytes, and (``checksums``) sha256 against the model's manifest, else the model's own file.
    ``model_dirs``: more directories holding some of the model's shards (``--model-dir``)."""
    src_dir, to_dir = Path(model), Path(to)
    if not to_dir.is_dir():
        raise ColibriError(f"{to_dir}: no such mirror directory")
    _check_target(to_dir, src_dir, tuple(Path(d) for d in model_dirs))
    found, problems = find_shards([src_dir, *model_dirs])
    if problems:
        raise problems[0]
    sources = {p.name: p for p in found}
    manifest = read_manifest(src_dir)
    report = VerifyReport(src_dir, to_dir)
    names: Sequence[Path] = sorted(
        p
        for p in to_dir.iterdir()
        if p.name.endswith(".safetensors") and not p.name.startswith(".")
    )
    for dst in names:
        src = sources.get(dst.name, src_dir / dst.name)
        row: dict[str, Any] = {"file": dst.name, "size": dst.stat().st_size, "sha256": None}
        if dst.name not in sources or not src.is_file():
            row["problem"] = "not a shard of the model"
            report.files.append(row)
            continue
        # Without a manifest the model's own file is the reference (re-hashed: a record in the
        # mirror could be stale if the model changed under it).
        expected = _expected_sha(dst.name, manifest)
        problem, got = _verify_file(src, dst, expected, checksums=checksums)
        row["source"] = str(src)
        row["problem"] = problem
        row["sha256"] = got
        report.files.append(row)
    report.partial = sorted(
        p.name for p in to_dir.iterdir() if p.name.startswith(".") and p.name.endswith(".part")
    )
    return report

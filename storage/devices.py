"""Several SSDs: read replicas of a model, device identity, bandwidth weights, placement, failover.

A model directory (the *primary*) may have read replicas (``--mirror DIR``, repeatable): full or
partial copies on other drives. A replica file is used only when its size and its safetensors
header bytes (the first ``8 + N`` bytes) equal the primary's; anything else is skipped with one
warning naming the file and why. A partial replica simply holds fewer shard files.

Which copy serves an expert (:meth:`Placement.choose`) is decided by weighted rendezvous hashing
of ``(layer, expert)``: each replica holding the expert's shard scores
``weight / -ln(hash(layer, expert, replica))`` and the best score wins. The share of experts a
replica serves is exactly proportional to its weight, the mapping is deterministic (same weights,
same choices, in every process), a prefetch and a demand read of one expert go to the same
device, and a weight change moves only the experts that must move. Weights are declared
(``--disk-weights 2,1``, primary first) or probed at open with a few expert-sized O_DIRECT reads
per device (cached per device in ``.coli_devices.json`` in the state dir).

At run time each replica's read throughput (bytes over read time, per window of 16 reads) is
tracked as an exponentially weighted moving average; weights are re-bucketed only when an
estimate moves more than 20% from the weights in use (hysteresis), so a throttled or busy drive
gets less and the mapping stays fixed between adaptations. A read error or short read on a
replica is retried on the primary (then any other replica holding the file), counted, reported
once per device, and the replica is demoted (weight 0) until :meth:`Placement.enable`; a
:class:`~storage.errors.ReadError` reaches the model only when every copy failed. Placement
only decides speed: the bytes are the same everywhere.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt
import structlog

from storage.aligned import ALIGN, aligned_empty, round_up
from storage.container import Container, ExpertExtent
from storage.errors import ColibriError, ReadError
from storage.manifest import atomic_write_bytes
from storage.reader import Reader, ReadRequest, direct_io_problem, required_size

__all__ = [
    "ADAPT_THRESHOLD",
    "EWMA_ALPHA",
    "PROBE_CACHE_FILE",
    "DeviceId",
    "Placement",
    "Replica",
    "adapt_weights",
    "compare_replica_file",
    "device_of",
    "ewma",
    "header_bytes",
    "open_placement",
    "open_replicas",
    "parse_weights",
    "probe_read_bandwidth",
    "probe_weights",
    "rendezvous_order",
    "stripe_pieces",
]

U8Array = npt.NDArray[np.uint8]
Key = tuple[int, int]
WeightSource = Literal["declared", "probed", "single"]

PROBE_CACHE_FILE = ".coli_devices.json"
PROBE_CACHE_VERSION = 1
PROBE_READS = 4
EWMA_ALPHA = 0.2
ADAPT_THRESHOLD = 0.2  # re-bucket only when an estimate moves > 20% from the weight in use
ADAPT_FLOOR = 0.05  # an adapted replica keeps >= 5% of the adapted weight (it keeps measuring)
WINDOW_READS = 16  # reads per throughput sample: bytes / seconds over the window
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


# --------------------------------------------------------------------------- replica files
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


def compare_replica_file(primary: Path, replica: Path) -> str | None:
    """None when ``replica`` can stand in for ``primary`` (same size, same header bytes), else
    why not, in words."""
    try:
        want = primary.stat().st_size
        got = replica.stat().st_size
    except OSError as exc:
        return f"cannot stat: {exc.strerror or exc}"
    if got != want:
        return f"size {got} differs from the primary's {want} bytes"
    try:
        a = header_bytes(primary)
        b = header_bytes(replica)
    except (OSError, ValueError) as exc:
        return f"header unreadable: {exc}"
    if a != b:
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        where = f" (first difference at byte {first})" if first is not None else ""
        return f"header bytes differ from the primary's{where}"
    return None


@dataclass(frozen=True)
class Replica:
    """One copy of (some of) the model's shard files on one device.

    ``files`` maps each primary shard path this replica can serve to its own file; ``skipped``
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


def _safe_device(path: Path) -> DeviceId | None:
    try:
        return device_of(path)
    except OSError:
        return None


def open_replicas(
    primary: Path, shard_files: Sequence[Path], mirrors: Sequence[Path]
) -> list[Replica]:
    """The primary (index 0) and one :class:`Replica` per mirror directory, in order (blocking).

    A mirror file is used only when its size and header bytes equal the primary's; a mismatch is
    logged once (a warning naming the file and why) and the file is left unused. A mirror
    directory that is missing, or the primary itself, yields a replica holding no files."""
    out = [Replica(0, primary, _safe_device(primary), {p: p for p in shard_files})]
    for i, m in enumerate(mirrors, start=1):
        root = Path(m)
        if not root.is_dir():
            what = "does not exist" if not root.exists() else "is not a directory"
            _log.warning("mirror unused", mirror=str(root), reason=f"the mirror {what}")
            out.append(Replica(i, root, None, {}, {"*": f"the mirror {what}"}))
            continue
        try:
            same = os.path.samefile(root, primary)
        except OSError:
            same = False
        if same:
            _log.warning("mirror unused", mirror=str(root), reason="it is the primary directory")
            out.append(Replica(i, root, _safe_device(root), {}, {"*": "the primary itself"}))
            continue
        files: dict[Path, Path] = {}
        skipped: dict[str, str] = {}
        for p in shard_files:
            q = root / p.name
            if not q.exists():
                skipped[p.name] = "absent (partial mirror)"
                continue
            try:
                if os.path.samefile(p, q):
                    why: str | None = "the same file as the primary's (a link)"
                else:
                    why = compare_replica_file(p, q)
            except OSError as exc:
                why = f"cannot stat: {exc.strerror or exc}"
            if why is not None:
                _log.warning("mirror file refused", file=str(q), reason=why)
                skipped[p.name] = why
                continue
            files[p] = q
        if not files:
            _log.warning(
                "mirror unused", mirror=str(root), reason="it holds none of the model's shards"
            )
        out.append(Replica(i, root, _safe_device(root), files, skipped))
    return out


# --------------------------------------------------------------------------- weights
def parse_weights(text: str | Sequence[float]) -> tuple[float, ...]:
    """``"2,1"`` (or ``"2:1"``, or a sequence) -> ``(2.0, 1.0)``; order: primary, mirrors...

    Weights are relative read shares; 0 means "only when no other copy holds the file"."""
    if isinstance(text, str):
        parts = [p for p in text.replace(":", ",").split(",") if p.strip()]
        try:
            vals = tuple(float(p) for p in parts)
        except ValueError:
            raise ColibriError(
                f"cannot read disk weights {text!r}; write e.g. 2,1 (primary first, then each "
                "--mirror in order)"
            ) from None
    else:
        vals = tuple(float(v) for v in text)
    if not vals:
        raise ColibriError("disk weights are empty; write e.g. 2,1")
    if any(not math.isfinite(v) or v < 0 for v in vals):
        raise ColibriError(f"disk weights must be finite and >= 0, got {vals}")
    if not any(v > 0 for v in vals):
        raise ColibriError("at least one disk weight must be > 0")
    return vals


def _unit(layer: int, expert: int, replica: int) -> float:
    """A uniform number in (0, 1) fixed by (layer, expert, replica): the same in every process."""
    d = hashlib.blake2b(struct.pack("<qqq", layer, expert, replica), digest_size=8).digest()
    return (int.from_bytes(d, "little") + 0.5) / 2.0**64


def rendezvous_order(
    layer: int, expert: int, weights: Sequence[float], candidates: Sequence[int]
) -> list[int]:
    """``candidates`` with weight > 0, best first by weighted rendezvous hashing.

    Replica ``i`` comes first for a share ``w_i / sum(w)`` of all keys (score
    ``w / -ln(u)`` with ``u`` uniform per key and replica). Zero-weight candidates are left out."""
    scored = [
        (weights[i] / -math.log(_unit(layer, expert, i)), -i, i)
        for i in candidates
        if weights[i] > 0
    ]
    scored.sort(reverse=True)
    return [i for _, _, i in scored]


def ewma(prev: float | None, sample: float, alpha: float = EWMA_ALPHA) -> float:
    """Exponentially weighted moving average step (the first sample starts it)."""
    return sample if prev is None else (1.0 - alpha) * prev + alpha * sample


def adapt_weights(
    weights: Sequence[float],
    estimates: Sequence[float | None],
    *,
    threshold: float = ADAPT_THRESHOLD,
    floor: float = ADAPT_FLOOR,
) -> tuple[float, ...] | None:
    """New weights when observed throughput says so, else None (keep the mapping).

    Among replicas with a weight > 0 and an estimate (bytes/s), the new weights are proportional
    to the estimates and keep their current sum (replicas without an estimate keep their weight);
    each keeps at least ``floor`` of that sum so it goes on being measured. None when fewer than
    two replicas qualify or no target moved more than ``threshold`` (relative) from its weight:
    the hysteresis that keeps the mapping fixed under measurement noise."""
    idx = [
        i
        for i, (w, e) in enumerate(zip(weights, estimates, strict=True))
        if w > 0 and e is not None and e > 0
    ]
    if len(idx) < 2:
        return None
    total_w = sum(weights[i] for i in idx)
    total_e = sum(float(estimates[i] or 0.0) for i in idx)
    target = {i: max(float(estimates[i] or 0.0) / total_e, floor) for i in idx}
    norm = sum(target.values())
    target = {i: t / norm * total_w for i, t in target.items()}
    if all(abs(target[i] - weights[i]) <= threshold * weights[i] for i in idx):
        return None
    out = list(weights)
    for i in idx:
        out[i] = target[i]
    return tuple(out)


# --------------------------------------------------------------------------- probing
def _probe_file(files: Sequence[Path]) -> Path | None:
    best: tuple[int, Path] | None = None
    for p in files:
        try:
            size = p.stat().st_size
        except OSError:
            continue
        if best is None or size > best[0]:
            best = (size, p)
    return None if best is None else best[1]


def probe_read_bandwidth(
    path: Path, block: int, reads: int = PROBE_READS, *, direct: bool = True
) -> float:
    """Bytes/s of ``reads`` reads of ``block`` bytes spread evenly over ``path`` (blocking).

    O_DIRECT when ``direct`` and the filesystem allows it (the page cache would measure RAM),
    buffered otherwise. Raises ``OSError`` when the file cannot be read."""
    size = path.stat().st_size
    block = max(ALIGN, min(round_up(block), size - size % ALIGN or ALIGN))
    flags = os.O_RDONLY | os.O_CLOEXEC
    fd = -1
    if direct:
        try:
            fd = os.open(path, flags | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    if fd < 0:
        fd = os.open(path, flags)
    buf = aligned_empty(block)
    span = max(size - block, 0)
    offsets = [(span * k // max(reads - 1, 1)) // ALIGN * ALIGN for k in range(reads)]
    total = 0
    try:
        t0 = time.perf_counter()
        for off in offsets:
            n = os.preadv(fd, [buf.data], off)
            if n <= 0:
                break
            total += n
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    if total <= 0:
        raise OSError(errno.EIO, f"nothing could be read from {path}")
    return total / max(dt, 1e-9)


def _load_probe_cache(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("version") != PROBE_CACHE_VERSION:
        return {}
    devices = doc.get("devices")
    return dict(devices) if isinstance(devices, dict) else {}


def probe_weights(
    replicas: Sequence[Replica],
    block: int,
    *,
    cache_path: Path | None,
    direct: bool = True,
) -> tuple[float, ...]:
    """Per-replica read bandwidth in GB/s, probed once per device and cached (blocking).

    The cache (``.coli_devices.json``) keys each device by :attr:`DeviceId.key` with its mount
    point and keeps the ``st_dev`` and block size it was measured with: a device whose id or the
    block changed is probed again. Replicas holding no file weigh 0."""
    cache = _load_probe_cache(cache_path) if cache_path is not None else {}
    changed = False
    out: list[float] = []
    for r in replicas:
        target = _probe_file(list(r.files.values()))
        if target is None or r.device is None:
            out.append(0.0)
            continue
        key = f"{r.device.key}|{r.device.mount}"
        hit = cache.get(key)
        if (
            isinstance(hit, dict)
            and hit.get("st_dev") == r.device.st_dev
            and hit.get("block") == block
            and isinstance(hit.get("bytes_per_s"), (int, float))
            and hit["bytes_per_s"] > 0
        ):
            out.append(float(hit["bytes_per_s"]) / 1e9)
            continue
        try:
            bps = probe_read_bandwidth(target, block, direct=direct)
        except OSError as exc:
            _log.warning("disk probe failed", file=str(target), error=str(exc))
            out.append(0.0)
            continue
        cache[key] = {
            "st_dev": r.device.st_dev,
            "name": r.device.name,
            "mount": r.device.mount,
            "block": block,
            "bytes_per_s": bps,
            "probed_at": time.time(),
        }
        changed = True
        _log.info("disk probed", device=r.device.key, file=str(target), gb_per_s=bps / 1e9)
        out.append(bps / 1e9)
    if changed and cache_path is not None:
        doc = {"version": PROBE_CACHE_VERSION, "devices": cache}
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(
                cache_path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
            )
        except OSError as exc:
            _log.info("disk probe cache not saved", path=str(cache_path), error=str(exc))
    if not any(w > 0 for w in out):  # nothing measurable: fall back to the primary alone
        out = [1.0] + [0.0] * (len(out) - 1)
    return tuple(out)


# --------------------------------------------------------------------------- striping
def stripe_pieces(
    req: ReadRequest, buf: U8Array, shares: Sequence[float]
) -> list[tuple[int, ReadRequest, U8Array]]:
    """Split one read into consecutive pieces sized by ``shares``, cut on 4 KiB file offsets.

    Returns ``(share index, piece, piece buffer)``; each piece buffer is the slice of ``buf``
    where that piece's aligned read lands, so after every piece is read ``buf[head:head +
    length]`` (``head = offset % 4096``) holds the whole extent, exactly as one read would have
    left it. Empty pieces are dropped."""
    base = req.offset - req.offset % ALIGN
    end = req.offset + req.length
    total = float(sum(shares))
    cuts = [req.offset]
    acc = 0.0
    for s in shares[:-1]:
        acc += s
        b = req.offset + int(req.length * acc / total)
        cuts.append(max(b - b % ALIGN, cuts[-1]))
    cuts.append(end)
    out: list[tuple[int, ReadRequest, U8Array]] = []
    for j, (lo, hi) in enumerate(pairwise(cuts)):
        lo = max(lo, req.offset)
        if hi <= lo:
            continue
        piece = ReadRequest(req.path, lo, hi - lo)
        at = (lo - lo % ALIGN) - base
        out.append((j, piece, buf[at : at + required_size(piece)]))
    return out


# --------------------------------------------------------------------------- placement
@dataclass
class _Counters:
    reads: int = 0
    bytes: int = 0
    seconds: float = 0.0
    errors: int = 0
    failovers: int = 0  # reads that failed here and were retried on another copy
    served_failovers: int = 0  # reads this replica served after another copy failed
    samples: int = 0  # closed windows
    estimate: float | None = None  # EWMA of the windows' bytes/s
    win_reads: int = 0
    win_bytes: int = 0
    win_seconds: float = 0.0


@dataclass
class _Piece:
    index: int  # request index
    req: ReadRequest  # in primary paths
    buf: U8Array
    order: list[int]
    view: U8Array | None = None
    error: ReadError | None = None


class Placement:
    """Which copy serves each read, and what happened (see the module docstring).

    Used on the event loop by the expert store: :meth:`read_many` replaces
    ``reader.read_many`` for one expert's requests (written against the primary's paths)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        weights: Sequence[float] | None = None,
        *,
        source: WeightSource = "declared",
        adapt: bool = True,
        stripe_min_bytes: int = 0,
        alpha: float = EWMA_ALPHA,
        threshold: float = ADAPT_THRESHOLD,
        window_reads: int = WINDOW_READS,
    ) -> None:
        if not replicas or replicas[0].index != 0:
            raise ValueError("replicas must start with the primary (index 0)")
        w = tuple(weights) if weights is not None else (1.0,) * len(replicas)
        if len(w) != len(replicas):
            raise ColibriError(
                f"{len(w)} disk weights for {len(replicas)} copies (the primary and "
                f"{len(replicas) - 1} mirror(s)); give one weight per copy, primary first"
            )
        self.replicas = tuple(replicas)
        self.source = source
        self.adapt = adapt
        self.stripe_min_bytes = max(0, int(stripe_min_bytes))
        self.alpha = alpha
        self.threshold = threshold
        self.window_reads = max(1, window_reads)
        self.adaptations = 0
        self.striped_reads = 0
        self._base = parse_weights(w)
        self._weights = list(self._base)
        self._demoted: dict[int, str] = {}
        self._counters = [_Counters() for _ in self.replicas]
        self._warned: set[str] = set()
        self._holders: dict[tuple[Path, ...], tuple[int, ...]] = {}
        self._orders: dict[tuple[int, int, tuple[Path, ...]], tuple[int, ...]] = {}

    # ------------------------------------------------------------------ choices
    @property
    def weights(self) -> tuple[float, ...]:
        """Weights in use (demoted replicas count 0)."""
        return tuple(0.0 if i in self._demoted else w for i, w in enumerate(self._weights))

    def _holders_of(self, files: tuple[Path, ...]) -> tuple[int, ...]:
        got = self._holders.get(files)
        if got is None:
            got = tuple(r.index for r in self.replicas if r.holds(files))
            self._holders[files] = got
        return got

    def order(self, layer: int, expert: int, files: Sequence[Path]) -> tuple[int, ...]:
        """Replicas to try for an expert whose bytes are in ``files`` (primary paths): the
        chosen one first, then the primary, then the other holders by score, demoted last."""
        key = (layer, expert, tuple(dict.fromkeys(files)))
        got = self._orders.get(key)
        if got is not None:
            return got
        holders = self._holders_of(key[2])
        w = self.weights
        ranked = rendezvous_order(layer, expert, w, holders)
        live = [i for i in holders if i not in self._demoted]
        first = ranked[:1] or live[:1] or list(holders[:1])
        rest = [0] if 0 in holders else []
        rest += ranked[1:] + live + list(holders)
        out = tuple(dict.fromkeys(first + rest))
        demoted = tuple(i for i in out if i in self._demoted and i not in first)
        out = tuple(i for i in out if i not in demoted) + demoted
        self._orders[key] = out
        return out

    def choose(self, layer: int, expert: int, extent: ExpertExtent) -> Path:
        """The file to read ``extent`` (an expert blob and its scales) from."""
        files = [extent.path] + [s.path for s in extent.scales.values() if s is not None]
        idx = self.order(layer, expert, files)[0]
        return self.replicas[idx].files[extent.path]

    def _invalidate(self) -> None:
        self._orders.clear()

    # ------------------------------------------------------------------ reads
    async def read_many(
        self,
        reader: Reader,
        key: Key,
        reqs: Sequence[ReadRequest],
        bufs: Sequence[U8Array],
    ) -> list[U8Array]:
        """Read one expert's requests (primary paths) from the copies :meth:`order` names.

        Views come back in request order, exactly as ``reader.read_many`` would return them.
        Raises :class:`ReadError` (after every read has finished) only when every copy holding
        some request failed."""
        if len(reqs) != len(bufs):
            raise ValueError(f"{len(reqs)} requests but {len(bufs)} buffers")
        if len(self.replicas) == 1:  # no mirror: the reader as is, plus the counters
            return await self._read_single(reader, reqs, bufs)
        order = list(self.order(key[0], key[1], [r.path for r in reqs]))
        pieces: list[_Piece] = []
        striped: set[int] = set()
        w = self.weights
        live = [i for i in order if w[i] > 0]
        for n, (r, b) in enumerate(zip(reqs, bufs, strict=True)):
            if self.stripe_min_bytes and r.length >= self.stripe_min_bytes and len(live) > 1:
                striped.add(n)
                for j, piece, pbuf in stripe_pieces(r, b, [w[i] for i in live]):
                    first = live[j]
                    pieces.append(
                        _Piece(n, piece, pbuf, [first] + [i for i in order if i != first])
                    )
            else:
                pieces.append(_Piece(n, r, b, order))
        if striped:
            self.striped_reads += len(striped)
        if len(pieces) == 1:
            await self._read_piece(reader, pieces[0])
        else:
            async with anyio.create_task_group() as tg:
                for p in pieces:
                    tg.start_soon(self._read_piece, reader, p)
        failed = [p.error for p in pieces if p.error is not None]
        if failed:
            first_err = failed[0]
            if len(failed) == 1:
                raise first_err
            raise ReadError(f"{len(failed)} reads failed; first: {first_err}") from first_err
        views: list[U8Array] = []
        for n, (r, b) in enumerate(zip(reqs, bufs, strict=True)):
            if n in striped:
                head = r.offset % ALIGN
                views.append(b[head : head + r.length])
            else:
                v = next(p.view for p in pieces if p.index == n)
                assert v is not None  # every piece either has a view or an error
                views.append(v)
        return views

    async def _read_single(
        self, reader: Reader, reqs: Sequence[ReadRequest], bufs: Sequence[U8Array]
    ) -> list[U8Array]:
        c = self._counters[0]
        t0 = time.perf_counter()
        try:
            views = await reader.read_many(reqs, bufs)
        except ReadError:
            c.errors += 1
            raise
        c.reads += len(reqs)
        c.bytes += sum(r.length for r in reqs)
        c.seconds += time.perf_counter() - t0
        return views

    async def _read_piece(self, reader: Reader, p: _Piece) -> None:
        errors: list[ReadError] = []
        for k, idx in enumerate(p.order):
            rep = self.replicas[idx]
            req = ReadRequest(rep.files[p.req.path], p.req.offset, p.req.length)
            t0 = time.perf_counter()
            try:
                p.view = await reader.read_into(req, p.buf)
            except ReadError as exc:
                errors.append(exc)
                self._failed(idx, exc, retry=k + 1 < len(p.order))
                continue
            self._observe(idx, req.length, time.perf_counter() - t0)
            if errors:
                self._counters[idx].served_failovers += 1
            return
        if len(errors) == 1:
            p.error = errors[0]
            return
        err = ReadError(
            f"every copy failed ({len(errors)} tried); first: {errors[0]}; last: {errors[-1]}"
        )
        err.__cause__ = errors[0]
        p.error = err

    # ------------------------------------------------------------------ telemetry, adaptation
    def _observe(self, idx: int, nbytes: int, seconds: float) -> None:
        c = self._counters[idx]
        c.reads += 1
        c.bytes += nbytes
        c.seconds += seconds
        # One sample per window of reads: total bytes / total read time. Averaging per-read
        # rates would let a few fast (cached, burst) reads hide a slow device.
        c.win_reads += 1
        c.win_bytes += nbytes
        c.win_seconds += seconds
        if c.win_reads < self.window_reads or c.win_seconds <= 0:
            return
        c.estimate = ewma(c.estimate, c.win_bytes / c.win_seconds, self.alpha)
        c.samples += 1
        c.win_reads, c.win_bytes, c.win_seconds = 0, 0, 0.0
        if self.adapt:
            self.maybe_adapt()

    def estimates(self) -> list[float | None]:
        """Per-replica throughput estimates (bytes/s) once a window was measured, else None."""
        return [c.estimate if c.samples else None for c in self._counters]

    def maybe_adapt(self) -> bool:
        """Re-bucket when an estimate moved past the hysteresis; True when weights changed."""
        new = adapt_weights(self.weights, self.estimates(), threshold=self.threshold)
        if new is None:
            return False
        old = self.weights
        for i, w in enumerate(new):
            if i not in self._demoted:
                self._weights[i] = w
        self.adaptations += 1
        self._invalidate()
        _log.info(
            "disk weights adapted",
            old=[round(w, 4) for w in old],
            new=[round(w, 4) for w in self.weights],
            bytes_per_s=[None if e is None else round(e) for e in self.estimates()],
        )
        return True

    def _failed(self, idx: int, exc: ReadError, *, retry: bool) -> None:
        c = self._counters[idx]
        c.errors += 1
        if not retry:
            return
        c.failovers += 1
        rep = self.replicas[idx]
        dev = rep.device.key if rep.device is not None else str(rep.root)
        if dev not in self._warned:
            self._warned.add(dev)
            _log.warning(
                "read failed on a copy; retrying on another and demoting it",
                replica=rep.index,
                role=rep.role,
                root=str(rep.root),
                device=dev,
                error=str(exc),
            )
        if idx not in self._demoted:
            self._demoted[idx] = str(exc)
            self._invalidate()

    def demote(self, index: int, reason: str = "demoted by request") -> None:
        """Stop choosing replica ``index`` (it stays a last-resort fallback)."""
        self._demoted[index] = reason
        self._invalidate()

    def enable(self, index: int) -> None:
        """Re-enable a demoted replica with its declared/probed weight and a fresh estimate."""
        if self._demoted.pop(index, None) is not None:
            self._weights[index] = self._base[index]
            c = self._counters[index]
            c.estimate, c.samples, c.win_reads, c.win_bytes, c.win_seconds = None, 0, 0, 0, 0.0
            self._invalidate()

    @property
    def demoted(self) -> Mapping[int, str]:
        """Demoted replica index -> the error that demoted it."""
        return dict(self._demoted)

    def stats(self) -> list[dict[str, Any]]:
        """One dict per copy: where it is, its weight, and what it served."""
        out: list[dict[str, Any]] = []
        w = self.weights
        for r, c in zip(self.replicas, self._counters, strict=True):
            out.append(
                {
                    "index": r.index,
                    "role": r.role,
                    "root": str(r.root),
                    "device": r.device.as_dict() if r.device is not None else None,
                    "files": len(r.files),
                    "skipped": dict(r.skipped),
                    "weight": w[r.index],
                    "base_weight": self._base[r.index],
                    "weight_source": self.source,
                    "reads": c.reads,
                    "bytes": c.bytes,
                    "seconds": c.seconds,
                    "throughput_bytes_per_s": c.estimate,
                    "errors": c.errors,
                    "failovers": c.failovers,
                    "served_failovers": c.served_failovers,
                    "demoted": r.index in self._demoted,
                    "demoted_reason": self._demoted.get(r.index),
                }
            )
        return out

    def summary(self) -> dict[str, Any]:
        """Placement-wide counters."""
        return {
            "copies": len(self.replicas),
            "weight_source": self.source,
            "adapt": self.adapt,
            "adaptations": self.adaptations,
            "stripe_min_bytes": self.stripe_min_bytes,
            "striped_reads": self.striped_reads,
            "failovers": sum(c.failovers for c in self._counters),
            "demoted": sorted(self._demoted),
        }


async def open_placement(
    container: Container,
    mirrors: Sequence[Path],
    *,
    weights: Sequence[float] | None = None,
    adapt: bool = True,
    stripe_min_bytes: int = 0,
    state_dir: Path | None = None,
    direct: bool = True,
) -> Placement:
    """The :class:`Placement` for ``container`` and its ``mirrors`` (off the event loop).

    ``weights`` (primary first) are used as declared; otherwise each device is probed with a few
    expert-sized reads (cached in ``state_dir``). ``direct``: the reader uses O_DIRECT, so a
    mirror whose filesystem refuses it is left unused (with a warning)."""
    shard_files = [s.path for s in container.shards]
    replicas = await anyio.to_thread.run_sync(
        open_replicas, container.path, shard_files, list(mirrors)
    )
    if direct:
        checked: list[Replica] = [replicas[0]]
        for r in replicas[1:]:
            sample = next(iter(r.files.values()), None)
            refused = (
                None
                if sample is None
                else await anyio.to_thread.run_sync(direct_io_problem, sample)
            )
            if refused is not None:
                _log.warning(
                    "mirror unused",
                    mirror=str(r.root),
                    reason=f"{refused}; the reader uses O_DIRECT (try --reader buffered)",
                )
                r = Replica(r.index, r.root, r.device, {}, {"*": refused})
            checked.append(r)
        replicas = checked
    if len(replicas) == 1:
        return Placement(replicas, (1.0,), source="single", adapt=False)
    if weights is not None:
        return Placement(
            replicas, weights, source="declared", adapt=adapt, stripe_min_bytes=stripe_min_bytes
        )
    block = round_up(max(container.expert_nbytes, ALIGN))
    cache = state_dir / PROBE_CACHE_FILE if state_dir is not None else None
    probed = await anyio.to_thread.run_sync(
        lambda: probe_weights(replicas, block, cache_path=cache, direct=direct)
    )
    _log.info("disk weights probed", gb_per_s=[round(w, 3) for w in probed])
    return Placement(
        replicas, probed, source="probed", adapt=adapt, stripe_min_bytes=stripe_min_bytes
    )

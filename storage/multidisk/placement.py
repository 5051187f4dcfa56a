"""Which copy serves each expert read: weighted rendezvous placement, run-time adaptation of the
weights (EWMA with hysteresis), striping, failover with demotion, and per-copy telemetry.

See :mod:`storage.multidisk` for the whole story; this module is pure policy plus the async read
loop, and runs without any real device (tests drive it with real files on one disk).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

import anyio
import numpy as np
import numpy.typing as npt
import structlog

from storage.aligned import ALIGN
from storage.container import ExpertExtent
from storage.errors import ColibriError, ReadError
from storage.integrity import Check, verify_views
from storage.multidisk.identity import ModelCopy
from storage.reader import Reader, ReadRequest, required_size

__all__ = [
    "ADAPT_FLOOR",
    "ADAPT_THRESHOLD",
    "EWMA_ALPHA",
    "WINDOW_READS",
    "WINDOW_SECONDS",
    "CopyStats",
    "Placement",
    "WeightSource",
    "adapt_weights",
    "ewma",
    "parse_weights",
    "rendezvous_order",
    "stripe_pieces",
]

U8Array = npt.NDArray[np.uint8]
Key = tuple[int, int]
WeightSource = Literal["declared", "probed", "single"]

EWMA_ALPHA = 0.2
ADAPT_THRESHOLD = 0.2  # re-bucket only when an estimate moves > 20% from the weight in use
ADAPT_FLOOR = 0.05  # an adapted copy keeps >= 5% of the adapted weight (it keeps measuring)
WINDOW_READS = 16  # reads per throughput sample: bytes / busy seconds over the window
WINDOW_SECONDS = 0.5  # ... or fewer reads (>= WINDOW_MIN_READS) once this much busy time passed
WINDOW_MIN_READS = 4

_log = structlog.get_logger(__name__)


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


def _unit(layer: int, expert: int, copy: int, salt: int = 0) -> float:
    """A uniform number in (0, 1) fixed by (layer, expert, copy): the same in every process.
    ``salt`` > 0 draws an independent family (cluster workers vs a worker's own disks)."""
    key = (layer, expert, copy) if salt == 0 else (layer, expert, copy, salt)
    d = hashlib.blake2b(struct.pack(f"<{len(key)}q", *key), digest_size=8).digest()
    return (int.from_bytes(d, "little") + 0.5) / 2.0**64


def rendezvous_order(
    layer: int, expert: int, weights: Sequence[float], candidates: Sequence[int], salt: int = 0
) -> list[int]:
    """``candidates`` with weight > 0, best first by weighted rendezvous hashing.

    ModelCopy ``i`` comes first for a share ``w_i / sum(w)`` of all keys (score
    ``w / -ln(u)`` with ``u`` uniform per key and copy). Zero-weight candidates are left out."""
    scored = [
        (weights[i] / -math.log(_unit(layer, expert, i, salt)), -i, i)
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

    Among copies with a weight > 0 and an estimate (bytes/s), the new weights are proportional
    to the estimates and keep their current sum (copies without an estimate keep their weight);
    each keeps at least ``floor`` of that sum so it goes on being measured. None when fewer than
    two copies qualify or no target moved more than ``threshold`` (relative) from its weight:
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
@dataclass(frozen=True, slots=True)
class CopyStats:
    """One copy of the model as placement sees it (``stats()["experts"]["devices"][i]``)."""

    index: int  # 0: the primary, then each mirror in order
    role: str
    root: str
    device: dict[str, Any] | None
    files: int  # shard files this copy serves
    skipped: dict[str, str]  # refused file -> why
    weight: float  # read share in use (0: demoted or not chosen)
    base_weight: float  # declared or probed
    weight_source: str
    reads: int
    bytes: int
    seconds: float
    busy_seconds: float  # wall seconds with at least one read in flight
    throughput_bytes_per_s: float | None  # EWMA estimate (None before one window)
    errors: int
    failovers: int  # reads that failed here and were retried on another copy
    served_failovers: int  # reads this copy served after another copy failed
    demoted: bool
    demoted_reason: str | None


@dataclass
class _Counters:
    reads: int = 0
    bytes: int = 0
    seconds: float = 0.0
    errors: int = 0
    failovers: int = 0  # reads that failed here and were retried on another copy
    served_failovers: int = 0  # reads this copy served after another copy failed
    samples: int = 0  # closed windows
    estimate: float | None = None  # EWMA of the windows' bytes/s
    win_reads: int = 0
    win_bytes: int = 0
    win_busy0: float = 0.0  # busy seconds when the window opened
    inflight: int = 0  # reads on this copy now
    busy_since: float = 0.0  # when inflight last went 0 -> 1
    busy: float = 0.0  # seconds with at least one read in flight (closed intervals)

    def busy_at(self, now: float) -> float:
        """Seconds this copy had at least one read in flight, up to ``now``."""
        return self.busy + (now - self.busy_since if self.inflight else 0.0)


@dataclass
class _Piece:
    index: int  # request index
    req: ReadRequest  # in primary paths
    buf: U8Array
    order: list[int]
    view: U8Array | None = None
    error: ReadError | None = None
    check: Check | None = None  # verifies the bytes a copy returned (--verify-reads)


class Placement:
    """Which copy serves each read, and what happened (see the module docstring).

    Used on the event loop by the expert store: :meth:`read_many` replaces
    ``reader.read_many`` for one expert's requests (written against the primary's paths)."""

    def __init__(
        self,
        copies: Sequence[ModelCopy],
        weights: Sequence[float] | None = None,
        *,
        source: WeightSource = "declared",
        adapt: bool = True,
        stripe_min_bytes: int = 0,
        alpha: float = EWMA_ALPHA,
        threshold: float = ADAPT_THRESHOLD,
        window_reads: int = WINDOW_READS,
        window_seconds: float = WINDOW_SECONDS,
    ) -> None:
        if not copies or copies[0].index != 0:
            raise ValueError("copies must start with the primary (index 0)")
        w = tuple(weights) if weights is not None else (1.0,) * len(copies)
        if len(w) != len(copies):
            raise ColibriError(
                f"{len(w)} disk weights for {len(copies)} copies (the primary and "
                f"{len(copies) - 1} mirror(s)); give one weight per copy, primary first"
            )
        self.copies = tuple(copies)
        self.source = source
        self.adapt = adapt
        self.stripe_min_bytes = max(0, int(stripe_min_bytes))
        self.alpha = alpha
        self.threshold = threshold
        self.window_reads = max(1, window_reads)
        self.window_seconds = window_seconds
        self.adaptations = 0
        self.striped_reads = 0
        self._base = parse_weights(w)
        self._weights = list(self._base)
        self._demoted: dict[int, str] = {}
        self._counters = [_Counters() for _ in self.copies]
        self._warned: set[str] = set()
        self._holders: dict[tuple[Path, ...], tuple[int, ...]] = {}
        self._orders: dict[tuple[int, int, tuple[Path, ...]], tuple[int, ...]] = {}

    # ------------------------------------------------------------------ choices
    @property
    def weights(self) -> tuple[float, ...]:
        """Weights in use (demoted copies count 0)."""
        return tuple(0.0 if i in self._demoted else w for i, w in enumerate(self._weights))

    def _holders_of(self, files: tuple[Path, ...]) -> tuple[int, ...]:
        got = self._holders.get(files)
        if got is None:
            got = tuple(r.index for r in self.copies if r.holds(files))
            self._holders[files] = got
        return got

    def order(self, layer: int, expert: int, files: Sequence[Path]) -> tuple[int, ...]:
        """Copies to try for an expert whose bytes are in ``files`` (primary paths): the
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
        return self.copies[idx].files[extent.path]

    def _invalidate(self) -> None:
        self._orders.clear()

    # ------------------------------------------------------------------ reads
    async def read_many(
        self,
        reader: Reader,
        key: Key,
        reqs: Sequence[ReadRequest],
        bufs: Sequence[U8Array],
        checks: Sequence[Check | None] | None = None,
    ) -> list[U8Array]:
        """Read one expert's requests (primary paths) from the copies :meth:`order` names.

        Views come back in request order, exactly as ``reader.read_many`` would return them.
        Raises :class:`ReadError` (after every read has finished) only when every copy holding
        some request failed. ``checks`` (one per request, or None) verify the bytes: a copy
        whose bytes fail is treated like a copy whose read failed (demoted, the next one
        tried); a striped request can only be checked once assembled (no retry then)."""
        if len(reqs) != len(bufs):
            raise ValueError(f"{len(reqs)} requests but {len(bufs)} buffers")
        checks = list(checks) if checks is not None else [None] * len(reqs)
        if len(self.copies) == 1:  # no mirror: the reader as is, plus the counters
            got = await self._read_single(reader, reqs, bufs)
            try:
                await verify_views(got, checks)
            except ReadError:  # bytes that fail their check are this copy's error too
                self._counters[0].errors += 1
                raise
            return got
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
                pieces.append(_Piece(n, r, b, order, check=checks[n]))
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
        await verify_views([v if n in striped else None for n, v in enumerate(views)], checks)
        return views

    async def _read_single(
        self, reader: Reader, reqs: Sequence[ReadRequest], bufs: Sequence[U8Array]
    ) -> list[U8Array]:
        c = self._counters[0]
        t0 = time.perf_counter()
        if not c.inflight:
            c.busy_since = t0
        c.inflight += 1
        try:
            views = await reader.read_many(reqs, bufs)
        except ReadError:
            c.errors += 1
            raise
        finally:
            t1 = time.perf_counter()
            c.inflight -= 1
            if not c.inflight:
                c.busy += t1 - c.busy_since
        self._observe(0, sum(r.length for r in reqs), t1 - t0, t1, reads=len(reqs))
        return views

    async def _read_piece(self, reader: Reader, p: _Piece) -> None:
        errors: list[ReadError] = []
        for k, idx in enumerate(p.order):
            rep = self.copies[idx]
            req = ReadRequest(rep.files[p.req.path], p.req.offset, p.req.length)
            c = self._counters[idx]
            t0 = time.perf_counter()
            if not c.inflight:
                c.busy_since = t0
            c.inflight += 1
            try:
                p.view = await reader.read_into(req, p.buf)
            except ReadError as exc:
                errors.append(exc)
                self._failed(idx, exc, retry=k + 1 < len(p.order))
                continue
            finally:
                t1 = time.perf_counter()
                c.inflight -= 1
                if not c.inflight:
                    c.busy += t1 - c.busy_since
            # the copy served these bytes, whatever their check finds (as with one copy)
            self._observe(idx, req.length, t1 - t0, t1)
            if p.check is not None:
                problem = await anyio.to_thread.run_sync(p.check, p.view)
                if problem is not None:
                    bad = ReadError(f"{req.path}: {problem}")
                    errors.append(bad)
                    self._failed(idx, bad, retry=k + 1 < len(p.order))
                    p.view = None
                    continue
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
    def _observe(
        self, idx: int, nbytes: int, seconds: float, now: float, *, reads: int = 1
    ) -> None:
        c = self._counters[idx]
        c.reads += reads
        c.bytes += nbytes
        c.seconds += seconds
        # One sample per window of reads: bytes over the copy's *busy* time in the window (the
        # wall time it had at least one read in flight). Summing per-read latencies instead
        # would divide the throughput by the queue depth, so a copy given more concurrent reads
        # would look slower; averaging per-read rates would let a few fast (cached, burst)
        # reads hide a slow device.
        c.win_reads += reads
        c.win_bytes += nbytes
        # A window closes after `window_reads` reads, or sooner on a slow copy: after
        # `window_seconds` of busy time (with a few reads), so adaptation reacts in bounded time
        # whatever the read size and drive speed.
        busy = c.busy_at(now) - c.win_busy0
        enough = c.win_reads >= self.window_reads or (
            busy >= self.window_seconds and c.win_reads >= min(WINDOW_MIN_READS, self.window_reads)
        )
        if not enough or busy <= 0:
            return
        c.estimate = ewma(c.estimate, c.win_bytes / busy, self.alpha)
        c.samples += 1
        c.win_reads, c.win_bytes, c.win_busy0 = 0, 0, c.busy_at(now)
        if self.adapt and len(self.copies) > 1:
            self.maybe_adapt()

    def estimates(self) -> list[float | None]:
        """Per-copy throughput estimates (bytes/s) once a window was measured, else None."""
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

    def _device_label(self, idx: int) -> str:
        rep = self.copies[idx]
        return rep.device.key if rep.device is not None else str(rep.root)

    def _failed(self, idx: int, exc: ReadError, *, retry: bool) -> None:
        c = self._counters[idx]
        c.errors += 1
        if not retry:
            return
        c.failovers += 1
        rep = self.copies[idx]
        dev = self._device_label(idx)
        if dev not in self._warned:
            self._warned.add(dev)
            _log.warning(
                "read failed on a copy; retrying on another and demoting it",
                copy=rep.index,
                role=rep.role,
                root=str(rep.root),
                device=dev,
                error=str(exc),
            )
        if idx not in self._demoted:
            self._demoted[idx] = str(exc)
            self._invalidate()

    def demote(self, index: int, reason: str = "demoted by request") -> None:
        """Stop choosing copy ``index`` (it stays a last-resort fallback)."""
        self._demoted[index] = reason
        self._invalidate()

    def enable(self, index: int) -> bool:
        """Re-enable a demoted copy with its declared/probed weight and a fresh estimate.

        True when it was demoted; False (nothing changes) when it was not."""
        if self._demoted.pop(index, None) is None:
            return False
        self._weights[index] = self._base[index]
        c = self._counters[index]
        c.estimate, c.samples, c.win_reads, c.win_bytes = None, 0, 0, 0
        c.win_busy0 = c.busy_at(time.perf_counter())
        self._warned.discard(self._device_label(index))  # a new failure is reported again
        self._invalidate()
        _log.info("copy re-enabled", copy=index, root=str(self.copies[index].root))
        return True

    def index_of(self, which: int | str | os.PathLike[str]) -> int:
        """The index of a copy given as its index (0: primary) or its root directory."""
        if isinstance(which, int):
            if 0 <= which < len(self.copies) and not isinstance(which, bool):
                return which
            raise ColibriError(
                f"no copy {which}: there are {len(self.copies)} (0 is the primary, then each "
                "--mirror in order)"
            )
        want = Path(which)
        for r in self.copies:
            try:
                if r.root == want or os.path.samefile(r.root, want):
                    return r.index
            except OSError:
                continue
        roots = ", ".join(str(r.root) for r in self.copies)
        raise ColibriError(f"{want} is none of the model's copies ({roots})")

    @property
    def demoted(self) -> Mapping[int, str]:
        """Demoted copy index -> the error that demoted it."""
        return dict(self._demoted)

    def copy_stats(self) -> list[CopyStats]:
        """One :class:`CopyStats` per copy: where it is, its weight, and what it served."""
        out: list[CopyStats] = []
        w = self.weights
        now = time.perf_counter()
        for r, c in zip(self.copies, self._counters, strict=True):
            out.append(
                CopyStats(
                    index=r.index,
                    role=r.role,
                    root=str(r.root),
                    device=r.device.as_dict() if r.device is not None else None,
                    files=len(r.files),
                    skipped=dict(r.skipped),
                    weight=w[r.index],
                    base_weight=self._base[r.index],
                    weight_source=self.source,
                    reads=c.reads,
                    bytes=c.bytes,
                    seconds=c.seconds,
                    busy_seconds=c.busy_at(now),
                    throughput_bytes_per_s=c.estimate,
                    errors=c.errors,
                    failovers=c.failovers,
                    served_failovers=c.served_failovers,
                    demoted=r.index in self._demoted,
                    demoted_reason=self._demoted.get(r.index),
                )
            )
        return out

    def stats(self) -> list[dict[str, Any]]:
        """:meth:`copy_stats` as plain dicts (JSON)."""
        return [dataclasses.asdict(c) for c in self.copy_stats()]

    def summary(self) -> dict[str, Any]:
        """Placement-wide counters."""
        return {
            "copies": len(self.copies),
            "weight_source": self.source,
            "adapt": self.adapt,
            "adaptations": self.adaptations,
            "stripe_min_bytes": self.stripe_min_bytes,
            "striped_reads": self.striped_reads,
            "failovers": sum(c.failovers for c in self._counters),
            "demoted": sorted(self._demoted),
        }

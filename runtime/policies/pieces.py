"""Demand reads in order: when each demand read may go to the device, and, when they are
sent in pieces, which bytes of an expert go first.

Pure and synchronous, like :mod:`runtime.policies.tiers`: no buffers, no I/O, no event loop.
:class:`runtime.experts.ExpertStore` runs it; ``tests/test_runtime/test_piece_window.py``
drives it directly.

Why: a device shares its bandwidth over every request on it, so two expert reads sent together
land together, and the step's last two experts are both computed after the disk went quiet
(the step's *tail*). :class:`PieceWindow` sends demand reads first come first served, within a
byte window, and holds the last read of a burst until the ones before it finished: it lands
alone, one read time after the one before it, whose computation overlaps it.

Reads may also go in pieces (:func:`piece_ranges`: the gate and up projections first, what an
expert's computation needs first), so that a smaller window orders even the middle of a step.
Measured on a virtio disk, less in flight read slower than that gained, so the store sends whole
experts unless told otherwise (``ExpertStore(read_piece=...)``).

The last read of a burst, alone on the device, may go in two stages (:func:`early_ranges`):
the gate and up projections, then the rest, each stage as a couple of requests sent together
(the disk measured reads two requests faster than one). The store hands the first stage to a
step that can begin the expert's computation with it (its activation) while the down
projection is read, instead of computing the whole expert after the disk went quiet.

Only the order and timing of reads change, never a byte read: an expert is handed over whole
once all of it landed, exactly as a whole read would have left it (an early hand-over is of
its gate and up bytes only, and says so).

Shape legend: byte ranges ``(a, b)`` are offsets in an expert's read buffer, whose byte 0 is
the file offset of the blob rounded down to ``align``; the blob is ``[head, need)``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

__all__ = ["DEMAND_PIECE", "PieceTicket", "PieceWindow", "early_ranges", "piece_ranges"]

# The piece size to try for demand reads sent in pieces (the block layer splits requests into
# a few MiB anyway).
DEMAND_PIECE = 4 << 20


def _split(a: int, b: int, piece: int, align: int) -> list[tuple[int, int]]:
    """``[a, b)`` in pieces of at most ``piece`` bytes whose inner cuts are multiples of
    ``align`` (``a`` itself may not be)."""
    out: list[tuple[int, int]] = []
    cut = a // align * align + piece
    while a < b:
        end = min(b, cut)
        out.append((a, end))
        a, cut = end, end + piece
    return out


def piece_ranges(
    head: int,
    need: int,
    first: Iterable[tuple[int, int]] = (),
    *,
    piece: int = DEMAND_PIECE,
    align: int = 4096,
) -> list[tuple[int, int]]:
    """The byte ranges one expert's blob ``[head, need)`` is read in, in the order they go to
    the device: those covering ``first`` (ranges relative to the blob start: the projections
    the computation needs first) before the rest, each at most ``piece`` bytes. Together they
    cover ``[head, need)`` exactly once; every cut between two ranges is a multiple of
    ``align`` (an O_DIRECT read starts on one). A blob of at most one piece is one range."""
    if not 0 <= head < need or piece < align or piece % align:
        raise ValueError(f"bad piece plan: blob [{head}, {need}), piece {piece}, align {align}")
    spans = [(head + a, head + b) for a, b in first if b > a]
    if not spans or need - head <= piece:
        return _split(head, need, piece, align)
    lo = max(head, min(a for a, _ in spans) // align * align)
    hi = min(need, -(-max(b for _, b in spans) // align) * align)
    ranges = _split(lo, hi, piece, align)
    ranges += _split(head, lo, piece, align)
    ranges += _split(hi, need, piece, align)
    return ranges


def early_ranges(
    head: int,
    need: int,
    first: Iterable[tuple[int, int]],
    *,
    parts: int = 2,
    align: int = 4096,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """One expert's blob ``[head, need)`` read in two stages: the ranges covering ``first``
    (relative to the blob start: the gate and up projections), then the rest; each stage in
    at most ``parts`` near-equal ranges, sent together (a device reads two requests faster
    than one). Together they cover ``[head, need)`` exactly once and every inner cut is a
    multiple of ``align``. The second stage is empty when ``first`` covers the whole blob;
    both are empty when nothing is worth a second stage (no ``first``, or a blob of at most
    two ``align`` blocks): read it whole."""
    if not 0 <= head < need or parts < 1 or align < 1:
        raise ValueError(f"bad early plan: blob [{head}, {need}), {parts} parts, align {align}")
    spans = [(head + a, head + b) for a, b in first if b > a]
    if not spans or need - head <= 2 * align:
        return [], []
    lo = max(head, min(a for a, _ in spans) // align * align)
    hi = min(need, -(-max(b for _, b in spans) // align) * align)

    def cut(a: int, b: int) -> list[tuple[int, int]]:
        if a >= b:
            return []
        blocks = -(-(b - a // align * align) // align)  # align blocks the range touches
        piece = -(-blocks // parts) * align
        return _split(a, b, piece, align)

    return cut(lo, hi), cut(head, lo) + cut(hi, need)


class PieceTicket:
    """One piece's place in a :class:`PieceWindow`: queued, then granted (on the device),
    then finished or dropped. ``opens``: the first piece of its read."""

    __slots__ = ("grant", "nbytes", "opens", "state")

    def __init__(self, nbytes: int, grant: Callable[[], None], opens: bool) -> None:
        self.nbytes = nbytes
        self.grant = grant
        self.opens = opens
        self.state = "queued"


class PieceWindow:
    """Demand read pieces, first come first served, with at most ``window`` bytes granted
    (on the device) at once; a piece larger than the window is granted when nothing else is.

    A device shares its bandwidth over every request on it, so reads that are on it together
    land together. A read's first piece therefore joins pieces of earlier reads only while
    ``backlog()`` says more reads wait behind it; the last read of a burst starts once the
    ones before it finished, so it lands alone, after them (their computations overlap its
    read), at the cost of one hand-over.

    :meth:`add` queues a piece and calls its ``grant`` callback as soon as it may go (maybe
    before returning); :meth:`finish` (a granted piece completed, or failed) makes room for
    the next ones; :meth:`drop` takes back a piece whose reader gave up (queued: it never
    goes; granted: as :meth:`finish`); :meth:`pump` looks again after ``backlog()`` changed."""

    def __init__(self, window: int, backlog: Callable[[], bool] = lambda: True) -> None:
        if window < 1:
            raise ValueError(f"the piece window must be at least one byte, got {window}")
        self.window = window
        self.backlog = backlog
        self.inflight_bytes = 0
        self.granted = 0  # pieces on the device now
        self._queue: deque[PieceTicket] = deque()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def add(self, nbytes: int, grant: Callable[[], None], *, opens: bool = True) -> PieceTicket:
        """Queue a piece (``opens``: the first piece of a read; the others follow it)."""
        t = PieceTicket(nbytes, grant, opens)
        self._queue.append(t)
        self.pump()
        return t

    def finish(self, t: PieceTicket) -> None:
        if t.state != "granted":
            raise ValueError(f"finish() of a piece that is {t.state}")
        t.state = "done"
        self.inflight_bytes -= t.nbytes
        self.granted -= 1
        self.pump()

    def drop(self, t: PieceTicket) -> None:
        if t.state == "granted":
            self.finish(t)
        elif t.state == "queued":
            self._queue.remove(t)
            t.state = "dropped"
            self.pump()  # (the head may have changed)

    def pump(self) -> None:
        """Grant queued pieces, in order, while the rules allow."""
        q = self._queue
        while q and (not self.granted or self._joins(q[0])):
            t = q.popleft()
            t.state = "granted"
            self.inflight_bytes += t.nbytes
            self.granted += 1
            t.grant()

    def _joins(self, t: PieceTicket) -> bool:
        """Whether ``t`` may go while other pieces are on the device."""
        if self.inflight_bytes + t.nbytes > self.window:
            return False
        return not t.opens or self.backlog()

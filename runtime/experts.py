"""The tiered expert store: pinned RAM set -> per-layer LRU -> storage.

Routed experts are read by the storage reader (io_uring / threads / buffered) on the event loop,
straight into preallocated aligned slots (no allocation or copy per read). The model runs in a
worker thread and consumes a layer's experts in *arrival order*: resident ones first, misses as
they land. Arrival order only changes *when* an expert is computed, never the result: the MoE
block combines expert outputs in a fixed order, so output is bit-identical for every budget,
policy, prefetch setting and reader backend.

Decisions (which tier, which slot, which read next, which lookahead to drop) are made by the
pure :class:`runtime.policies.tiers.TierPolicy`; :class:`ExpertStore` runs them: it owns the
slots and the reads, and follows what the policy says.

Thread model: methods prefixed ``_loop_`` and coroutines run on the event loop; the
:class:`StreamingExperts` facade is called from the compute thread (an anyio worker the
scheduler runs its calls on) and reaches the loop through ``anyio.from_thread`` with the loop's
token (taken at :meth:`ExpertStore.start`) plus a thread-safe queue for arrivals.

Shape legend: L layer, E experts per layer, K top-k, slot = one expert's aligned blob + scales
buffers.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np
import numpy.typing as npt
import structlog

from runtime.linear import Linear
from runtime.policies.pieces import PieceTicket, PieceWindow, early_ranges, piece_ranges
from runtime.policies.tiers import (
    LOOKAHEAD_PIECE,
    Placement,
    PrefetchMode,
    StepHandle,
    TierPolicy,
    TierStats,
)
from runtime.weights import ExpertWeights, Guess, Lookahead
from storage.aligned import HUGE_PAGE, aligned_empty, huge_backed_bytes, hugepage_support
from storage.container import Container, ExpertExtent
from storage.errors import ColibriError, ReadError
from storage.integrity import Check, ExpertChecksums, crc32_of, crc_check, verify_views
from storage.reader import Reader, ReadRequest, aligned_extent, required_size

_log = structlog.get_logger(__name__)
_CLOSING = "an expert was not read: the engine is closing"

__all__ = [
    "ExpertStore",
    "StoreLayout",
    "StreamingExperts",
    "TierStats",
    "TraceEvent",
    "layer_slot_sizes",
    "plan_layout",
]

Key = tuple[int, int]
R = TypeVar("R")
ALIGN = 4096
# How long a streaming step on the pool waits for its first demand read to reach the device
# before its resident experts start computing (the event loop needs a core to send it).
ISSUE_WAIT_S = 0.003


class TraceEvent(NamedTuple):
    """One interval of the streaming timeline (:attr:`ExpertStore.trace`), ``time.perf_counter``
    seconds: ``kind`` "read" (a demand read of expert ``expert``'s blob and scales, from its
    turn at the device to its completion), "piece" (one piece of a lookahead read, or of a
    demand read sent in several), "compute" (expert ``expert`` computed on the compute side) or
    "step" (a MoE layer's step on the compute thread, from asking for its experts to handing the
    last back; ``expert`` is how many it asked for)."""

    kind: str
    layer: int
    expert: int
    t0: float
    t1: float


@dataclass(frozen=True)
class StoreLayout:
    """How the expert share of the RAM budget is split (see :func:`plan_layout`).

    ``slot_bytes``: a transient slot, which may carry any layer's expert (the largest one's
    size); ``layer_slots``: (layer, blob bytes, scales bytes) of the pinned and cache slots of
    each expert layer, sized for that layer's largest expert (empty: every slot is a
    transient-sized one). The MTP layer's experts are int8 in the public container, about
    twice a main int4 one: sizing every slot for them would halve what the cache holds."""

    pinned: tuple[Key, ...]
    lru_slots_per_layer: int
    n_layers: int
    transient_slots: int
    slot_bytes: int
    layer_slots: tuple[tuple[int, int, int], ...] = ()

    def layer_slot_bytes(self, layer: int) -> int:
        """Bytes of one pinned or cache slot of ``layer``."""
        for at, blob, scales in self.layer_slots:
            if at == layer:
                return _slot_nbytes(blob, scales)
        return self.slot_bytes

    @property
    def nbytes(self) -> int:
        per_layer = (
            sum(_slot_nbytes(blob, scales) for _, blob, scales in self.layer_slots)
            if self.layer_slots
            else self.n_layers * self.slot_bytes
        )
        pinned = sum(self.layer_slot_bytes(layer) for layer, _ in self.pinned)
        transient = self.transient_slots * self.slot_bytes
        return transient + pinned + self.lru_slots_per_layer * per_layer


def _slot_nbytes(blob: int, scales: int) -> int:
    """Bytes of a slot with these buffers (the scales buffer is at least a page: _Slot)."""
    return blob + max(scales, ALIGN)


def _scale_requests(x: ExpertExtent) -> list[ReadRequest]:
    """Scale tensors of one expert as few reads as possible (adjacent ranges merged)."""
    infos = sorted((s for s in x.scales.values() if s is not None), key=lambda s: s.start)
    reqs: list[ReadRequest] = []
    for s in infos:
        if reqs and reqs[-1].path == s.path and reqs[-1].offset + reqs[-1].length == s.start:
            last = reqs[-1]
            reqs[-1] = ReadRequest(last.path, last.offset, last.length + s.nbytes)
        else:
            reqs.append(ReadRequest(s.path, s.start, s.nbytes))
    return reqs


def _blob_ranges(
    blob_req: ReadRequest, x: ExpertExtent
) -> tuple[int, int, int, list[tuple[int, int]]]:
    """For a blob read in parts: its aligned start, where the blob begins and ends in the
    aligned buffer (``head``, ``need``) and the byte ranges of its gate and up projections
    (from the aligned start; those go first)."""
    aligned, head, _ = aligned_extent(blob_req)
    first = [(o, o + n) for p, (o, n, _, _) in x.parts.items() if p in ("gate_proj", "up_proj")]
    return aligned, head, head + blob_req.length, first


def _range_reads(
    blob_req: ReadRequest, aligned: int, ranges: Sequence[tuple[int, int]], blob_buf: Any
) -> tuple[list[ReadRequest], list[Any]]:
    """One request per ``(a, b)`` range of the blob (offsets from its ``aligned`` start) and
    the views of ``blob_buf`` they read into."""
    reqs, bufs = [], []
    for a, b in ranges:
        r = ReadRequest(blob_req.path, aligned + a, b - a)
        lo = a // ALIGN * ALIGN
        reqs.append(r)
        bufs.append(blob_buf[lo : lo + required_size(r)])
    return reqs, bufs


def layer_slot_sizes(c: Container) -> dict[int, tuple[int, int]]:
    """Per expert layer: (blob buffer bytes, scales buffer bytes) that hold any of its experts'
    aligned read supersets."""
    out: dict[int, tuple[int, int]] = {}
    for layer in c.expert_layers():
        blob = scales = 0
        for e in range(c.arch.n_routed_experts):
            x = c.expert(layer, e)
            blob = max(blob, required_size(ReadRequest(x.path, x.start, x.end - x.start)))
            scales = max(scales, sum(required_size(r) for r in _scale_requests(x)))
        out[layer] = (blob, scales)
    return out


def slot_sizes(c: Container) -> tuple[int, int]:
    """(blob buffer bytes, scales buffer bytes) that hold any expert's aligned read superset:
    a transient slot's."""
    return _largest(layer_slot_sizes(c))


def _largest(sizes: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """The (blob, scales) buffer sizes that hold every layer's experts."""
    return max((b for b, _ in sizes.values()), default=0), max(
        (s for _, s in sizes.values()), default=0
    )


def plan_layout(
    c: Container,
    expert_budget: int | None,
    *,
    top_k: int,
    pinned: Sequence[Key] = (),
) -> StoreLayout:
    """Split ``expert_budget`` bytes into pinned experts, LRU slots per layer and transient slots.

    ``None`` means everything resident (every expert gets a cache slot). Transient slots (``2K``)
    carry misses the cache cannot hold and lookahead reads; they are the floor of any budget.
    Transient slots hold the largest expert of any layer; a layer's pinned and cache slots
    hold its own largest (:class:`StoreLayout`). ``pinned`` is taken in order while it fits.
    """
    sizes = layer_slot_sizes(c)
    slot = _slot_nbytes(*_largest(sizes))
    per = {layer: _slot_nbytes(b, s) for layer, (b, s) in sizes.items()}
    layer_slots = tuple((layer, b, s) for layer, (b, s) in sorted(sizes.items()))
    layers = c.expert_layers()
    n_e = c.arch.n_routed_experts
    transient = 2 * top_k
    if expert_budget is None:
        return StoreLayout((), n_e, len(layers), transient, slot, layer_slots)
    avail = expert_budget - transient * slot
    if avail < 0:
        raise ColibriError(
            f"the RAM budget leaves {expert_budget / 2**20:.1f} MiB for experts but streaming "
            f"needs at least {transient * slot / 2**20:.1f} MiB ({transient} transient slots of "
            f"{slot / 2**20:.1f} MiB); raise --ram (--worker-ram for an expert worker's share)"
        )
    pin: list[Key] = []
    for key in pinned:
        cost = per.get(key[0], slot)
        if cost > avail:
            break
        pin.append(key)
        avail -= cost
    # a layer never needs more cache slots than it has experts left unpinned (the count is
    # the same for every layer: the one with the fewest pinned bounds it; a live re-pin that
    # moves a pin to another layer leaves that layer an expert short, which then streams
    # through the transient slots: speed, never meaning)
    pinned_in = Counter(layer for layer, _ in pin)
    need = max((n_e - pinned_in[layer] for layer in layers), default=n_e)
    row = sum(per.get(layer, slot) for layer in layers)  # one cache slot in every layer
    per_layer = min(need, avail // max(row, 1))
    return StoreLayout(tuple(pin), int(per_layer), len(layers), transient, slot, layer_slots)


class _Slot:
    """One preallocated home for an expert: aligned blob buffer + scales buffer."""

    __slots__ = ("blob", "key", "scales", "spans", "weights")

    def __init__(self, blob_bytes: int, scales_bytes: int, huge: bool = False) -> None:
        self.blob = aligned_empty(blob_bytes, ALIGN, huge=huge)
        self.scales = aligned_empty(max(scales_bytes, ALIGN), ALIGN)
        self.key: Key | None = None
        self.weights: ExpertWeights | None = None
        # where the read put the expert: (blob offset, length), then (offset, length) in
        # ``scales`` per scales request (what :func:`_copy_slot` copies)
        self.spans: tuple[tuple[int, int], ...] = ()

    @property
    def nbytes(self) -> int:
        return int(self.blob.nbytes + self.scales.nbytes)


@dataclass(eq=False)
class _Step(StepHandle):
    """One layer's request from the compute thread, with the queue its arrivals come through
    and the experts a lookahead read was already bringing when it began."""

    out: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    # set once the step's first demand read goes to the device (or when it needs none)
    issued: threading.Event = field(default_factory=threading.Event)
    via_lookahead: set[int] = field(default_factory=set)
    # experts handed over in a transient slot: the compute side gives those back one by one
    # (the others live in pinned or cache slots: no hop to the loop is needed for them)
    held: set[int] = field(default_factory=set)
    # the consumer takes :class:`_Early` items (an expert whose gate and up projections landed)
    early: bool = False
    last_read: int | None = None  # the expert of the step's last demand read (sent last)

    def stalled(self, stats: TierStats, expert: int, seconds: float) -> None:
        """The compute thread waited ``seconds`` until ``expert`` arrived."""
        stats.compute_stall_s += seconds
        if expert in self.via_lookahead:
            stats.read_wait_lookahead_s += seconds
        else:
            stats.read_wait_demand_s += seconds


class _Pieces:
    """How a lookahead read goes to the device (:meth:`ExpertStore._read_into`): before each
    piece, the gate (no demand read in flight or waiting) and the policy's word: go on, read
    all the rest at once (a step now waits for it: a demand read from here on), or stop (its
    layer's step began without it). The caller passed the gate for the first piece."""

    def __init__(self, store: ExpertStore, key: Key) -> None:
        self.store = store
        self.key = key
        self.demand = False  # a step joined it: the rest was read as a demand read
        self._first = True
        self._gated = True  # holding a gate ticket (lookahead, or demand once joined)

    async def before(self) -> Literal["piece", "rest", "stop"]:
        st, pol = self.store, self.store.policy
        if self._first:  # the caller holds the ticket
            self._first = False
            ready = pol.lookahead_ready(self.key)
            if ready is not False:
                st._ungate(demand=False)
                self._gated = False
        else:  # the next ticket, unless the policy decided meanwhile (no ticket then)
            ready = await st._lookahead_gate(self.key)
            self._gated = ready is False
        if ready is False:
            pol.piece_started(self.key, st._clock())
            return "piece"
        if ready is None:
            return "stop"
        await st._gate(demand=True)
        self.demand = self._gated = True
        return "rest"

    def after(self, nbytes: int) -> None:
        """The piece (``nbytes``) finished (or failed)."""
        if self.demand:
            return  # the demand ticket is given back by close()
        st = self.store
        st.policy.piece_done(self.key, st._clock(), nbytes)
        st._ungate(demand=False)
        self._gated = False

    def close(self) -> None:
        if self._gated:
            self.store._ungate(demand=self.demand)
            self._gated = False


@dataclass(frozen=True, slots=True)
class _Done:
    """A worker finished computing with ``expert`` (its buffer may be recycled)."""

    expert: int
    future: Future[Any]


@dataclass(frozen=True, slots=True)
class _Early:
    """``expert``'s gate and up projections (and all its scales) landed in ``weights``; its
    down projection is still being read. The same expert arrives whole later (or its error),
    in the same buffer: only its gate and up may be computed with until then. After an error
    the step fails and what was computed early is dropped with it (the slot goes back at
    once, so it may read bytes a later read wrote: never a result that is used)."""

    expert: int
    weights: ExpertWeights


@dataclass(frozen=True, slots=True)
class _Guessed:
    """A step's prediction (:data:`runtime.weights.Guess`) was made on a worker."""

    future: Future[Lookahead | None]


class ExpertStore:
    """Owns the slots and the reads and runs the :class:`TierPolicy`. Lives on the event loop."""

    def __init__(
        self,
        container: Container,
        reader: Reader,
        layout: StoreLayout,
        *,
        prefetch: PrefetchMode | bool = "auto",
        prefill_admit: bool = False,
        read_depth: int = 2,
        read_piece: int | None = None,
        read_window: int | None = None,
        early_reads: bool = True,
        placement: Any = None,
        checksums: ExpertChecksums | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.c = container
        # --verify-reads: every read checked against the manifest's CRC-32s (None: unchecked)
        self.checksums = checksums
        self.reader = reader
        # storage.multidisk.Placement: which copy (primary or a mirror) serves each expert, with
        # failover; None reads everything from the primary.
        self.placement = placement
        self.layout = layout
        self.policy = TierPolicy(
            container.expert_layers(),
            lru_slots=layout.lru_slots_per_layer,
            transient_slots=layout.transient_slots,
            read_depth=read_depth,
            prefetch=prefetch,
        )
        self.policy.prefill = prefill_admit
        self.stats: TierStats = self.policy.stats
        self._clock = clock
        self._blob_bytes, self._scales_bytes = slot_sizes(container)  # a transient slot's
        # a layer's pinned and cache slots: its own largest expert (the layout's sizes)
        self._layer_sizes = {layer: (b, sc) for layer, b, sc in layout.layer_slots}
        # Demand reads go through a window, first come first served (runtime.policies.pieces):
        # up to ``read_depth`` whole experts on the device, except that the last read of a
        # burst goes once the one before it landed, so that the two do not land together.
        # ``read_piece`` sends every expert in pieces of that many bytes instead (gate and up
        # first), with about one expert plus one piece on the device: the experts land one
        # after another, but on the virtio disk measured (docs/benchmarks.md) less in flight
        # read slower than the overlap gained, so whole reads are the default.
        expert = self._blob_bytes + self._scales_bytes
        if read_window is None:  # (the scales go with an expert's first piece)
            if read_piece is None:
                read_window = read_depth * expert
            else:
                read_window = max(1, read_depth - 1) * expert + read_piece + self._scales_bytes
        self._piece = read_piece
        self._window = PieceWindow(read_window, self._reads_behind)
        self._unsent = 0  # pieces the window granted whose tasks have not sent them yet
        # ``early_reads``: a whole demand read that goes to the device alone (the last of its
        # burst, the window holding nothing else) is read in two stages, the gate and up
        # projections first, each stage as two requests; a step that takes early arrivals
        # (StreamingExperts.map_arrivals with ``early``) computes the first half of that
        # expert while its down projection is still being read.
        self.early_reads = early_reads
        # Expert blobs of 2 MiB and more go on transparent huge pages where the kernel allows
        # it (fewer page-table walks per O_DIRECT read); hugepage_report() says what it got.
        self.hugepages = hugepage_support()
        self._huge_report: tuple[float, dict[str, Any]] | None = None
        # buffers: which slot holds which key (the policy decides; these follow)
        self._pinned: dict[Key, _Slot] = {}
        self._cached: dict[Key, _Slot] = {}
        self._free_cache: dict[int, list[_Slot]] = {}
        self._transient_free: list[_Slot] = []
        self._prefetched: dict[Key, _Slot] = {}  # lookahead results parked in transient slots
        self._held: dict[Key, _Slot] = {}  # transient slots handed to the compute thread
        self._slot_freed = anyio.Event()
        self._io_changed = anyio.Event()
        self._tg: Any = None
        self.token: Any = None  # the event loop's (set by start)
        # an error a call the compute side posted to the loop met there (raised by its next
        # step: StreamingExperts._post)
        self.posted_error: Exception | None = None
        # set when the task group running the reads is cancelled (whatever holds the engine
        # was cancelled): no read starts or lands any more, steps fail instead of waiting
        self._closing = False
        self._close_error: ColibriError | None = None  # what steps get once closing
        self.nbytes = 0
        self.fixed_buffers = False
        # A timeline for tools (tools/bench/stream_timeline.py): None (off, the default) or a
        # list that reads, expert computations and steps are appended to as TraceEvents.
        self.trace: list[TraceEvent] | None = None

    def _reads_behind(self) -> bool:
        """Whether a demand read may share the device with the ones before it
        (:class:`PieceWindow`'s backlog): while more demand reads wait at the gate, or always
        when mirrors serve reads (two reads may then be on two devices, which do not share
        their bandwidth)."""
        if self.placement is not None and len(self.placement.copies) > 1:
            return True
        return self.policy.demand_queued > 0

    def _alone(self) -> bool:
        """Whether the demand read just granted is the only one on the device, with none
        waiting behind it (in the window or at the gate): the last of its burst."""
        w = self._window
        return w.granted == 1 and not w.queued and not self._reads_behind()

    @property
    def prefill(self) -> bool:
        """While True (prefill chunks), the LRU admits only into free slots."""
        return self.policy.prefill

    @prefill.setter
    def prefill(self, on: bool) -> None:
        self.policy.prefill = on

    @property
    def _inflight(self) -> set[Key]:
        return self.policy.inflight

    @property
    def _lru(self) -> dict[int, Any]:
        return self.policy.lru

    # ------------------------------------------------------------------ set-up
    def hugepage_report(self, max_age_s: float = 5.0) -> dict[str, Any]:
        """The kernel's THP setting, whether the slots asked for huge pages (and why not), and
        how many bytes of the expert blobs the kernel backs with them now (``/proc/self/smaps``,
        read at most every ``max_age_s``)."""
        now = self._clock()
        if self._huge_report is not None and now - self._huge_report[0] < max_age_s:
            return self._huge_report[1]
        slots = self._all_slots()
        blobs = [x.blob for x in slots]
        report: dict[str, Any] = {
            **self.hugepages.as_dict(),
            "slot_blob_bytes": sum(int(b.nbytes) for b in blobs),
            "huge_backed_bytes": huge_backed_bytes(blobs),
        }
        if self._blob_bytes < HUGE_PAGE:
            report["reason"] = report["reason"] or "expert blobs are under 2 MiB"
        self._huge_report = (now, report)
        return report

    def _all_slots(self) -> list[_Slot]:
        out = list(self._transient_free) + list(self._pinned.values())
        out += list(self._cached.values()) + list(self._prefetched.values())
        out += list(self._held.values()) + [x for f in self._free_cache.values() for x in f]
        return out

    async def start(self, tg: Any, progress: Callable[[int, int], None] | None = None) -> None:
        """Allocate every slot up front and read the pinned set (``progress(done, total)``
        after each pinned expert)."""
        self._tg = tg
        # the event loop, for the compute thread's calls into it (named, not taken from the
        # thread: they work from any thread, not only one anyio started)
        self.token = anyio.lowlevel.current_token()
        tg.start_soon(self._watch_close)
        if not self.hugepages.advise and self._blob_bytes >= HUGE_PAGE:
            _log.info("expert slots on ordinary pages", reason=self.hugepages.reason)
        self._transient_free = [self._new_slot() for _ in range(self.layout.transient_slots)]
        for layer in self.policy.lru:
            self._free_cache[layer] = [
                self._new_slot(layer) for _ in range(self.layout.lru_slots_per_layer)
            ]
        pinned_slots = [self._new_slot(layer) for layer, _ in self.layout.pinned]
        slots = (
            self._transient_free
            + [x for free in self._free_cache.values() for x in free]
            + pinned_slots
        )
        # Registered (fixed) buffers save the kernel a page-table walk per read where allowed.
        self.fixed_buffers = bool(
            self.reader.register_buffers([b for x in slots for b in (x.blob, x.scales)])
        )
        for i, (key, slot) in enumerate(zip(self.layout.pinned, pinned_slots, strict=True)):
            await self._read_into(key, slot)
            self._pinned[key] = slot
            if progress is not None:
                progress(i + 1, len(pinned_slots))
            self.policy.pin(key)

    async def repin(self, counts: npt.NDArray[np.int64]) -> int:
        """Live re-pin between turns: swap cold pinned experts for hot ones (hysteresis, at
        most a few swaps). Only speed changes. Returns the number of swaps made."""
        from runtime.policies import repin_swaps

        if not self._pinned:
            return 0
        pol = self.policy
        score = {
            (layer, e): float(counts[layer, e])
            for layer in pol.lru
            for e in range(counts.shape[1])
            if counts[layer, e] > 0 or (layer, e) in pol.pinned
        }
        # a pin's slot is sized for its layer: swaps stay among layers of one slot size
        classes: dict[tuple[int, int], set[int]] = {}
        for layer in pol.lru:
            classes.setdefault(self._sizes(layer), set()).add(layer)
        swaps: list[tuple[Key, Key]] = []
        for layers in classes.values():  # at most 4 swaps in all, as with one class
            swaps += repin_swaps(
                [k for k in self._pinned if k[0] in layers],
                {k: v for k, v in score.items() if k[0] in layers},
                max_swaps=4 - len(swaps),
            )
        done = 0
        for old, new in swaps:
            if new in pol.inflight or new in pol.pinned:
                continue
            if pol.uncache(new):  # it was in the LRU: its slot goes back to the free list
                self._free_cache[new[0]].append(self._cached.pop(new))
            slot = self._pinned.pop(old)
            pol.unpin(old)
            try:
                with anyio.CancelScope(shield=True):
                    await self._read_into(new, slot)
            except ColibriError:
                continue  # the slot is dropped from the pinned set; reads fall back to the LRU
            self._pinned[new] = slot
            pol.pin(new)
            done += 1
        self.stats.repins += done
        return done

    def _sizes(self, layer: int | None) -> tuple[int, int]:
        """(blob, scales) bytes of a slot of ``layer`` (None: a transient slot)."""
        if layer is None:
            return self._blob_bytes, self._scales_bytes
        return self._layer_sizes.get(layer, (self._blob_bytes, self._scales_bytes))

    def _new_slot(self, layer: int | None = None) -> _Slot:
        """A slot for ``layer``'s experts (pinned or cache), or a transient one (None)."""
        s = _Slot(*self._sizes(layer), huge=self.hugepages.advise)
        self.nbytes += s.nbytes
        return s

    def _fits(self, slot: _Slot, layer: int | None) -> bool:
        """Whether ``slot`` holds any expert of ``layer`` (None: of every layer)."""
        blob, scales = self._sizes(layer)
        return slot.blob.nbytes >= blob and slot.scales.nbytes >= max(scales, ALIGN)

    def tiers(self) -> dict[Key, str]:
        """Where each resident expert lives now: ``pinned`` or ``lru`` (absent = storage)."""
        return self.policy.tiers()

    # ------------------------------------------------------------------ reads
    async def _read_into(
        self,
        key: Key,
        slot: _Slot,
        pieces: _Pieces | None = None,
        issued: threading.Event | None = None,
        early: _Step | None = None,
    ) -> bool:
        """Read ``key`` into ``slot`` (blob and scales, checked under ``--verify-reads``).

        Without ``pieces`` (a demand read): through the piece window (:meth:`_read_ordered`);
        ``issued`` is set when its first piece goes to the device; ``early``: the step
        waiting for it, when that step takes early arrivals.
        ``pieces`` (a lookahead read): the blob goes to the device piece by piece
        (``LOOKAHEAD_PIECE`` bytes), each piece first asking ``pieces.before`` whether to read
        it, to read all the rest at once (a step now waits for it) or to stop. Returns False
        when it stopped (the slot holds nothing usable)."""
        x = self.c.expert(*key)
        blob_req = ReadRequest(x.path, x.start, x.end - x.start)
        sreqs = _scale_requests(x)
        bufs = [slot.blob]
        off = 0
        for r in sreqs:
            need = required_size(r)
            bufs.append(slot.scales[off : off + need])
            off += need
        checks = self._checks(key, x, sreqs)
        t0 = self._clock()
        n_reqs = len(sreqs)  # (a lookahead read counts its blob pieces as they are read)
        try:
            if pieces is None:
                views, n_reqs = await self._read_ordered(
                    key, x, blob_req, sreqs, bufs, checks, issued, early
                )
            else:
                blob = await self._read_pieces(key, blob_req, slot.blob, pieces)
                if blob is None:
                    return False
                rest = await self._read_reqs(key, sreqs, bufs[1:], checks and checks[1:])
                views = [blob, *rest]
                try:
                    await verify_views(views[:1], (checks or [None])[:1])
                except ReadError:  # a damaged copy: the whole read again (mirrors fail over)
                    views = await self._read_reqs(key, [blob_req, *sreqs], bufs, checks)
            if self.checksums is not None and len(sreqs) > 1:  # scales in several pieces
                self._check_scales(key, x, views[1:])
        except ColibriError as exc:
            if self._closing:  # the reader closed under it: the engine's doing, not the disk's
                raise self._closed_error() from exc
            self.stats.read_errors += 1
            raise
        finally:
            t1 = self._clock()
            self.stats.read_wait_s += t1 - t0
            if self.trace is not None and pieces is None:
                self.trace.append(TraceEvent("read", key[0], key[1], t0, t1))
        if self._unsent:
            # this read's landing let another go: its task sends it to the device before this
            # one builds the expert's weights (~0.3 ms of Python: the disk would wait for it)
            await anyio.lowlevel.cancel_shielded_checkpoint()
        whole = pieces is None
        self.stats.reads += n_reqs
        self.stats.experts_read += 1
        self.stats.bytes_read += whole * blob_req.length + sum(r.length for r in sreqs)
        blob_u8 = np.frombuffer(views[0], dtype=np.uint8)
        svs = [np.frombuffer(v, dtype=np.uint8) for v in views[1:]]
        slot.weights = _weights_from(x, blob_u8, sreqs, svs)
        slot.spans = (_span(blob_u8, slot.blob), *(_span(v, slot.scales) for v in svs))
        slot.key = key
        return True

    async def _read_ordered(
        self,
        key: Key,
        x: ExpertExtent,
        blob_req: ReadRequest,
        sreqs: list[ReadRequest],
        bufs: Sequence[npt.NDArray[np.uint8]],
        checks: Sequence[Check | None] | None,
        issued: threading.Event | None,
        early: _Step | None = None,
    ) -> tuple[list[Any], int]:
        """A demand read through the piece window (:mod:`runtime.policies.pieces`), sent
        when the window lets it: one read of blob and scales, checked as it is read, or, with
        ``read_piece``, the blob in pieces (gate and up projections first, the scales with the
        first piece) all queued now, in this order, and checked once all landed. Returns the
        views (blob, then scales) and how many requests it took. A failed piece raises after
        the others finished (the kernel writes into the buffer until then).

        A whole read that goes to the device alone, for a step that takes early arrivals,
        goes in two stages (:meth:`_read_early`)."""
        blob_buf, scale_bufs = bufs[0], bufs[1:]
        if self._piece is None:
            reqs = [blob_req, *sreqs]
            out: list[Any] = [None]
            granted = anyio.Event()
            ticket = self._window.add(sum(r.length for r in reqs), self._grant(granted))
            staged: Callable[[], Awaitable[tuple[list[Any], int]]] | None = None
            if early is not None and self.early_reads and checks is None:
                # (unchecked reads only: a copy found damaged after its first stage was
                # computed with would be read again under a computation already begun)
                staged = functools.partial(self._read_early, key, x, blob_req, sreqs, bufs, early)
            await self._send_piece(
                key, reqs, list(bufs), granted, ticket, out, 0, issued, checks, staged=staged
            )
            got = out[0]
            if isinstance(got, ColibriError):
                raise got
            return got if isinstance(got, tuple) else (got, len(reqs))
        aligned, head, need, first = _blob_ranges(blob_req, x)
        jobs = [
            _range_reads(blob_req, aligned, [r], blob_buf)
            for r in piece_ranges(head, need, first, piece=self._piece, align=ALIGN)
        ]
        jobs[0][0].extend(sreqs)
        jobs[0][1].extend(scale_bufs)
        out = [None] * len(jobs)
        events = [anyio.Event() for _ in jobs]
        tickets = [
            self._window.add(sum(r.length for r in reqs), self._grant(ev), opens=i == 0)
            for i, ((reqs, _), ev) in enumerate(zip(jobs, events, strict=True))
        ]
        async with anyio.create_task_group() as tg:
            for i, (reqs, pbufs) in enumerate(jobs):
                go = issued if i == 0 else None
                tg.start_soon(
                    self._send_piece, key, reqs, pbufs, events[i], tickets[i], out, i, go, None,
                    len(jobs) > 1,
                )  # fmt: skip
        for got in out:
            if isinstance(got, ColibriError):
                raise got
        views: list[Any] = [blob_buf[head:need], *out[0][1:]]
        if checks is not None:
            try:
                await verify_views(views, checks)
            except ReadError:  # a damaged copy: the whole read again (mirrors fail over)
                views = await self._read_reqs(key, [blob_req, *sreqs], bufs, checks)
        return views, len(jobs) + len(sreqs)

    def _grant(self, granted: anyio.Event) -> Callable[[], None]:
        """A window ticket's grant: ``granted`` set, and the piece counted as granted and not
        yet sent (:attr:`_unsent`) until its task takes it to the device."""

        def grant() -> None:
            self._unsent += 1
            granted.set()

        return grant

    async def _send_piece(
        self,
        key: Key,
        reqs: list[ReadRequest],
        bufs: list[npt.NDArray[np.uint8]],
        granted: anyio.Event,
        ticket: PieceTicket,
        out: list[Any],
        i: int,
        issued: threading.Event | None,
        checks: Sequence[Check | None] | None,
        traced: bool = False,
        staged: Callable[[], Awaitable[tuple[list[Any], int]]] | None = None,
    ) -> None:
        """One read (or piece) of :meth:`_read_ordered`: wait for the window, read (and run
        ``checks``); ``out[i]`` is its views or its error. ``traced``: a "piece" on the
        timeline (a whole read is the "read" :meth:`_read_into` records). ``staged``: a whole
        read that, when it goes to the device alone (:meth:`_alone`), ``staged()`` reads
        instead (``out[i]`` is then its views and request count)."""
        try:
            await granted.wait()
        except BaseException:
            if ticket.state == "granted":  # (granted, then cancelled before it went)
                self._unsent -= 1
            self._window.drop(ticket)
            raise
        self._unsent -= 1
        if issued is not None:
            issued.set()  # (the reader submits the read before its first await)
        t0 = self._clock()
        try:
            with anyio.CancelScope(shield=True):  # the kernel writes into the buffer
                if staged is not None and self._alone():
                    out[i] = await staged()
                else:
                    out[i] = await self._read_reqs(key, reqs, bufs, checks)
        except ColibriError as exc:
            out[i] = exc
        finally:
            self._window.finish(ticket)
            if traced and self.trace is not None:
                self.trace.append(TraceEvent("piece", key[0], key[1], t0, self._clock()))

    async def _read_early(
        self,
        key: Key,
        x: ExpertExtent,
        blob_req: ReadRequest,
        sreqs: list[ReadRequest],
        bufs: Sequence[npt.NDArray[np.uint8]],
        step: _Step,
    ) -> tuple[list[Any], int]:
        """A whole demand read in two stages (:func:`~runtime.policies.pieces.early_ranges`):
        the gate and up projections with every scale, handed to ``step`` as an
        :class:`_Early` arrival as soon as they landed, then the rest; each stage's requests
        go together. Only for unchecked reads. Returns the views (blob, then scales) and how
        many requests it took."""
        aligned, head, need, first = _blob_ranges(blob_req, x)
        one, two = early_ranges(head, need, first, align=ALIGN)
        if not one:
            return await self._read_reqs(key, [blob_req, *sreqs], bufs, None), 1 + len(sreqs)
        blob_buf, scale_bufs = bufs[0], bufs[1:]
        reqs1, bufs1 = _range_reads(blob_req, aligned, one, blob_buf)
        got = await self._read_reqs(key, [*reqs1, *sreqs], [*bufs1, *scale_bufs], None)
        scales = got[len(reqs1) :]
        blob = blob_buf[head:need]
        svs = [np.frombuffer(v, dtype=np.uint8) for v in scales]
        self.stats.early_arrivals += 1
        step.out.put(_Early(key[1], _weights_from(x, np.frombuffer(blob, np.uint8), sreqs, svs)))
        reqs2, bufs2 = _range_reads(blob_req, aligned, two, blob_buf)
        await self._read_reqs(key, reqs2, bufs2, None)
        return [blob, *scales], len(reqs1) + len(reqs2) + len(sreqs)

    async def _read_reqs(
        self,
        key: Key,
        reqs: Sequence[ReadRequest],
        bufs: Sequence[npt.NDArray[np.uint8]],
        checks: Sequence[Check | None] | None,
    ) -> list[Any]:
        """Read ``reqs`` of ``key`` into ``bufs`` (through the copy placement, if any) and run
        their checks; views in request order."""
        if not reqs:
            return []
        if self.placement is not None:  # the copy is chosen there; failover happens there
            views: list[Any] = await self.placement.read_many(self.reader, key, reqs, bufs, checks)
            return views
        views = list(await self.reader.read_many(reqs, bufs))
        if checks is not None:
            await verify_views(views, checks)
        return views

    async def _read_pieces(
        self, key: Key, req: ReadRequest, buf: npt.NDArray[np.uint8], pieces: _Pieces
    ) -> Any:
        """``req`` (a blob) in aligned pieces into ``buf`` as ``pieces`` decides; its view, or
        None when told to stop."""
        aligned, head, _ = aligned_extent(req)
        need = head + req.length
        o = 0
        while o < need:
            # (the gate may pass without waiting: a read cancelled at shutdown stops here)
            await anyio.lowlevel.checkpoint_if_cancelled()
            what = await pieces.before()
            if what == "stop":
                return None
            end = need if what == "rest" else min(need, o + LOOKAHEAD_PIECE)
            piece = ReadRequest(req.path, aligned + o, end - o)
            t0 = self._clock()
            try:
                with anyio.CancelScope(shield=True):  # the kernel writes into buf
                    await self._read_reqs(key, [piece], [buf[o : o + required_size(piece)]], None)
            finally:
                pieces.after(piece.length)
                if self.trace is not None:
                    self.trace.append(TraceEvent("piece", key[0], key[1], t0, self._clock()))
            self.stats.reads += 1
            self.stats.bytes_read += end - max(o, head)
            o = end
        return buf[head : head + req.length]

    def _checks(
        self, key: Key, x: ExpertExtent, sreqs: Sequence[ReadRequest]
    ) -> list[Check | None] | None:
        """One check per request of this expert's read (blob, then scales), or None."""
        if self.checksums is None:
            return None
        want = self.checksums.get(*key)
        if want is None:
            raise ReadError(f"layer {key[0]} expert {key[1]}: no checksum in the manifest")
        where = f"layer {key[0]} expert {key[1]} in {x.path.name} [{x.start}, {x.end})"
        checks: list[Check | None] = [crc_check(want[0], where)]
        if want[1] is not None and len(sreqs) == 1:
            checks.append(crc_check(want[1], f"the scales of {where}"))
        return checks + [None] * (1 + len(sreqs) - len(checks))

    def _check_scales(self, key: Key, x: ExpertExtent, views: Sequence[Any]) -> None:
        want = self.checksums.get(*key) if self.checksums is not None else None
        if want is None or want[1] is None:
            return
        if crc32_of(views) != want[1]:
            raise ReadError(
                f"the scales of layer {key[0]} expert {key[1]} in {x.path.name}: checksum "
                "mismatch: this copy on disk is damaged; run `coli doctor --verify` (a mirror's "
                "copy: `coli mirror verify`)"
            )

    # ------------------------------------------------------------------ slots and the gate
    async def _take_slot(self, key: Key, *, demand: bool) -> tuple[_Slot, Placement] | None:
        """The slot the policy places ``key``'s read in; a demand read waits for a transient
        slot when none is free, a lookahead read gets None instead."""
        while True:
            where = self.policy.place(key, demand=demand)
            if where is not None:
                break
            if not demand:
                return None
            await self._slot_freed.wait()
        if not where.cached:
            return self._transient_free.pop(), where
        if where.evicted is not None:
            slot = self._cached.pop(where.evicted)
        else:
            slot = self._free_cache[key[0]].pop()
        self._cached[key] = slot
        return slot, where

    def _return_transient(self, slot: _Slot) -> None:
        """Put a transient slot back on the free list (the policy has counted it back)."""
        slot.key = None
        slot.weights = None
        self._transient_free.append(slot)
        self._slot_freed.set()
        self._slot_freed = anyio.Event()

    async def _gate(self, demand: bool) -> None:
        """Wait until the policy lets this read (or lookahead piece) start
        (:meth:`TierPolicy.try_issue`)."""
        pol = self.policy
        if pol.try_issue(demand=demand, now=self._clock()):
            return
        if demand:
            pol.queue_demand(+1, self._clock())
            self._window.pump()  # a read held back as the last of its burst need not be
        try:
            while not pol.try_issue(demand=demand, now=self._clock()):
                await self._io_changed.wait()
        finally:
            if demand:
                pol.queue_demand(-1, self._clock())

    async def _lookahead_gate(self, key: Key) -> bool | None:
        """Wait for a lookahead piece's ticket (:meth:`TierPolicy.try_issue`), or for the
        policy's word on ``key`` while it waits (:meth:`TierPolicy.lookahead_ready`): False
        with the ticket held; True (a step now waits for it) or None (its layer's step began
        without it) with no ticket. A step that joins a lookahead read waiting here (the
        step's own demand reads hold the device) so takes its rest at once as a demand read,
        instead of after them all (:meth:`_loop_begin` wakes the waiters)."""
        pol = self.policy
        while True:
            ready = pol.lookahead_ready(key)
            if ready is not False:
                return ready
            if pol.try_issue(demand=False, now=self._clock()):
                return False
            await self._io_changed.wait()

    def _wake_gate(self) -> None:
        """Wake every read waiting at the gate to ask the policy again."""
        self._io_changed.set()
        self._io_changed = anyio.Event()

    def _ungate(self, demand: bool) -> None:
        self.policy.io_done(demand=demand, now=self._clock())
        self._wake_gate()

    # ------------------------------------------------------------------ one read
    def begin_close(self, error: ColibriError) -> None:
        """The engine closes (before its reader does): reads that fail from now on fail with
        ``error`` (not a disk error: none is counted), and so does every step waiting for a
        read, and every step after."""
        self._close_error = error
        self._closing = True
        self._fail_waiting()

    def _closed_error(self) -> ColibriError:
        return self._close_error if self._close_error is not None else ColibriError(_CLOSING)

    def _fail_waiting(self) -> None:
        steps = {id(s): s for s in self.policy.waiters.values() if isinstance(s, _Step)}
        for step in steps.values():
            step.out.put(self._closed_error())

    async def _watch_close(self) -> None:
        """Runs in the reads' task group until it is cancelled (the engine closing, or a
        cancellation of whatever holds it); then every step waiting for a read gets an error,
        so that its compute thread stops: a read task cancelled before it started never runs
        a line, and could not say so itself."""
        try:
            await anyio.sleep_forever()
        finally:
            self._closing = True
            self._fail_waiting()

    def _unblock(self, key: Key) -> None:
        """A read task of ``key`` ends without landing it (cancelled: the task group that runs
        the reads is the engine's, and a cancellation of whatever holds the engine reaches
        it): the step waiting for ``key`` gets an error, so its compute thread stops instead
        of waiting forever for an arrival (and the engine, for that thread, to close)."""
        step = self.policy.waiters.get(key)
        if isinstance(step, _Step):
            step.out.put(self._closed_error())

    async def _demand(self, key: Key) -> None:
        """A demand read: a slot (waiting for one if need be), the gate, the whole expert;
        cancelled before it lands, the waiting step hears of it (:meth:`_unblock`)."""
        try:
            await self._demand_read(key)
        except BaseException:
            self._unblock(key)
            raise

    async def _demand_read(self, key: Key) -> None:
        got = await self._take_slot(key, demand=True)
        assert got is not None
        await self._gate(demand=True)
        step = self.policy.waiters.get(key)
        issued = step.issued if isinstance(step, _Step) else None
        err: ColibriError | None = None
        try:
            with anyio.CancelScope(shield=True):  # never abandon a buffer the kernel writes into
                early = None
                if isinstance(step, _Step) and step.early and step.last_read == key[1]:
                    early = step  # (the step's last read: it may come in two stages)
                await self._read_into(key, got[0], issued=issued, early=early)
        except ColibriError as exc:
            err = exc
        finally:
            self._ungate(demand=True)
        self._landed(key, *got, err, demand=True)

    async def _lookahead(self, key: Key) -> None:
        """A lookahead read: piece by piece on an idle device (:class:`_Pieces`); it becomes a
        demand read when a step starts waiting for it, and stops when its layer's step began
        without routing to it. Cancelled before it lands, a step waiting for it hears of it."""
        try:
            await self._lookahead_read(key)
        except BaseException:
            self._unblock(key)
            raise

    async def _lookahead_read(self, key: Key) -> None:
        pol = self.policy
        ready = await self._lookahead_gate(key)
        if ready is not False:  # (no ticket held)
            if ready is None:  # its layer's step came and went without it: skip the read
                pol.drop(key)
            else:  # a step already waits for it: an ordinary demand read
                await self._demand(key)
            return
        got = await self._take_slot(key, demand=False)
        if got is None:  # no spare room for a lookahead read: skip it
            pol.drop(key)
            self._ungate(demand=False)
            return
        slot, where = got
        pieces = _Pieces(self, key)
        err: ColibriError | None = None
        try:
            done = await self._read_into(key, slot, pieces)
        except ColibriError as exc:
            err, done = exc, True
        except BaseException:  # cancelled between pieces (closing): give the slot back
            self._stopped(key, slot, where)
            raise
        finally:
            pieces.close()
        if not done:
            self._stopped(key, slot, where)
            return
        self._landed(key, slot, where, err, demand=pieces.demand)

    def _stopped(self, key: Key, slot: _Slot, where: Placement) -> None:
        """A lookahead read stopped part-way: its slot goes back."""
        self.policy.drop(key, where)
        if where.cached:
            self._free_cache[key[0]].append(self._cached.pop(key))
            slot.key, slot.weights = None, None
        else:
            self._return_transient(slot)

    def _landed(
        self, key: Key, slot: _Slot, where: Placement, err: ColibriError | None, *, demand: bool
    ) -> None:
        """A read finished: the policy says what happens to it (deliver, park, release, ...)."""
        pol = self.policy
        if err is not None and where.cached:
            self._free_cache[key[0]].append(self._cached.pop(key))
        step = pol.waiters.get(key)
        outcome = pol.landed(key, where, ok=err is None, demand=demand)
        if outcome == "park":
            self._prefetched[key] = slot  # for the demand step of that layer
        elif outcome == "release":
            self._return_transient(slot)
        elif outcome == "error":
            assert isinstance(step, _Step) and err is not None
            if not where.cached:
                self._return_transient(slot)
            step.out.put(err)
        elif outcome == "deliver":
            assert isinstance(step, _Step) and slot.weights is not None
            joined = pol.adoptable(key)  # a lookahead read the step joined: the cache takes it
            if not where.cached:
                cached = self._adopt(key, slot) if joined else None
                if cached is None:
                    self._held[key] = slot
                    step.held.add(key[1])  # before the put: the compute thread reads it after
                else:
                    slot = cached
            assert slot.weights is not None
            step.out.put((key[1], slot.weights))

    # ------------------------------------------------------------------ loop-side step API
    def _loop_begin(
        self, step: _Step, experts: Sequence[int], lookahead: Lookahead | None = None
    ) -> list[tuple[int, ExpertWeights]]:
        """Resident experts now; misses are read and arrive through ``step.out``. Then the
        ``lookahead`` prediction queues its reads, behind this step's demand reads. Raises
        when the reads' task group is gone (:meth:`_watch_close`)."""
        if self._closing:
            raise self._closed_error()
        layer = step.layer
        ready: list[tuple[int, ExpertWeights]] = []
        demand = 0
        for e, tier in self.policy.begin(step, experts, now=self._clock()):
            key = (layer, e)
            if tier == "read":
                self._tg.start_soon(self._demand, key)
                step.last_read = e
                demand += 1
                continue
            if tier == "inflight":
                step.via_lookahead.add(e)
                continue
            if tier == "pinned":
                slot = self._pinned[key]
            elif tier == "lru":
                slot = self._cached[key]
            else:  # "parked": a lookahead result in a transient slot, now the step's
                slot = self._prefetched.pop(key)
                cached = self._adopt(key, slot)
                if cached is None:
                    self._held[key] = slot
                    step.held.add(e)
                else:
                    slot = cached
            assert slot.weights is not None
            ready.append((e, slot.weights))
        if not demand:
            step.issued.set()
        if lookahead is not None:
            self._loop_prefetch(lookahead.layer, lookahead.experts, lookahead.cpu_s)
        # lookahead reads waiting for a piece's turn ask again: one this step joined goes on
        # as a demand read, one for this layer it did not route to stops
        self._wake_gate()
        return ready

    def _adopt(self, key: Key, slot: _Slot) -> _Slot | None:
        """A step takes ``key``'s lookahead result from transient ``slot``: if the layer's LRU
        takes it (:meth:`TierPolicy.adopt`), returns the cache slot that now holds it (None
        leaves it transient). The slot becomes the cache's and the victim's (or a free cache
        slot's) buffer becomes transient; where that buffer is too small for a transient slot
        (its layer's experts are smaller than another layer's), the expert is copied into it
        instead and ``slot`` goes back to the transient slots."""
        where = self.policy.adopt(key)
        if where is None:
            return None
        spare = (
            self._cached.pop(where.evicted)
            if where.evicted is not None
            else self._free_cache[key[0]].pop()
        )
        if not self._fits(spare, None):
            _copy_slot(self.c.expert(*key), slot, spare)
            slot, spare = spare, slot
        self._cached[key] = slot
        self._return_transient(spare)
        return slot

    def _loop_done_with(self, layer: int, e: int) -> None:
        slot = self._held.pop((layer, e), None)
        if slot is not None:
            self.policy.release_transient()
            self._return_transient(slot)

    def _loop_end(self, step: _Step) -> None:
        for key in self.policy.end(step):
            self._return_transient(self._prefetched.pop(key))
        # An expert handed out but never given back (the consumer stopped while computing it,
        # e.g. its computation raised): its transient slot comes back with the step's end.
        for key in [k for k in self._held if k[0] == step.layer]:
            self._loop_done_with(*key)

    def _loop_prefetch(self, layer: int, experts: Sequence[int], cpu_s: float = 0.0) -> None:
        self.policy.charge(layer, cpu_s)
        for key in self.policy.lookahead(layer, experts):
            self._tg.start_soon(self._lookahead, key)


def _weights_from(
    x: ExpertExtent,
    blob: npt.NDArray[np.uint8],
    sreqs: Sequence[ReadRequest],
    scale_views: Sequence[npt.NDArray[np.uint8]],
) -> ExpertWeights:
    scales: dict[str, npt.NDArray[np.float32] | None] = {}
    for proj, info in x.scales.items():
        scales[proj] = None
        if info is None:
            continue
        for r, v in zip(sreqs, scale_views, strict=True):
            if r.path == info.path and r.offset <= info.start and info.end <= r.offset + r.length:
                lo = info.start - r.offset
                scales[proj] = v[lo : lo + info.nbytes].view(np.float32)
                break
    q = x.qtensors(blob, scales)
    return ExpertWeights(Linear(q["gate_proj"]), Linear(q["up_proj"]), Linear(q["down_proj"]))


def _span(view: npt.NDArray[np.uint8], base: npt.NDArray[np.uint8]) -> tuple[int, int]:
    """(offset, length) of ``view`` inside ``base``, the buffer it was read into."""
    off = int(view.ctypes.data) - int(base.ctypes.data)
    assert 0 <= off and off + view.nbytes <= base.nbytes, "a read landed outside its slot"
    return off, int(view.nbytes)


def _copy_slot(x: ExpertExtent, src: _Slot, dst: _Slot) -> None:
    """Copy expert ``x`` from ``src`` into ``dst``, each range where its read put it in
    ``src`` (:attr:`_Slot.spans`), and point ``dst``'s weights at the copy."""
    assert src.weights is not None and src.spans
    (b_off, b_len), *scale_spans = src.spans
    dst.blob[b_off : b_off + b_len] = src.blob[b_off : b_off + b_len]
    views = []
    for off, n in scale_spans:
        dst.scales[off : off + n] = src.scales[off : off + n]
        views.append(dst.scales[off : off + n])
    dst.weights = _weights_from(x, dst.blob[b_off : b_off + b_len], _scale_requests(x), views)
    dst.spans = src.spans
    dst.key = src.key


def _arriving(item: tuple[int, ExpertWeights] | _Early) -> int:
    """The expert an arrival (whole, or its early stage) is of."""
    return item.expert if isinstance(item, _Early) else item[0]


def _traced_call(fn: Callable[[], R], trace: list[TraceEvent] | None, layer: int, expert: int) -> R:
    """``fn()``, on the timeline as ``expert``'s computation when tracing."""
    if trace is None:
        return fn()
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        trace.append(TraceEvent("compute", layer, expert, t0, time.perf_counter()))


def _traced(
    fn: Callable[[int, ExpertWeights], R], trace: list[TraceEvent], layer: int
) -> Callable[[int, ExpertWeights], R]:
    """``fn`` that also appends a "compute" :class:`TraceEvent` for each call."""

    def run(e: int, w: ExpertWeights) -> R:
        t0 = time.perf_counter()
        try:
            return fn(e, w)
        finally:
            trace.append(TraceEvent("compute", layer, e, t0, time.perf_counter()))

    return run


class StreamingExperts:
    """``ExpertSource`` for the compute thread, backed by an :class:`ExpertStore` on the loop.

    Use only from a thread started by ``anyio.to_thread.run_sync`` (the engine does)."""

    def __init__(self, store: ExpertStore) -> None:
        self.store = store
        self._hop_s: dict[int, float] = {}  # layer -> seconds of its last prefetch hop

    def wants_lookahead(self, layer: int) -> bool:
        """Whether a prediction for ``layer`` would be read now (``--prefetch`` and, under
        auto, that layer's ledger). Read from the compute thread without a hop to the loop:
        it is a hint, and a stale answer only costs one skipped or one extra prediction."""
        pol = self.store.policy
        return layer in pol.lru and pol.reads_ahead(layer)

    def arrivals(
        self, layer: int, experts: Sequence[int], lookahead: Lookahead | None = None
    ) -> Iterator[tuple[int, ExpertWeights]]:
        """Yield ``(expert, weights)`` for every id: resident first, then misses as they land.
        ``lookahead`` (a prediction for a later layer) queues its reads behind this step's.

        Resume the generator only after computing with the yielded expert: its transient
        buffer is recycled then."""
        st = self.store
        trace = st.trace
        step = _Step(layer)
        t_step = time.perf_counter()
        ready = self._begin(step, experts, lookahead)
        try:
            for e, w in ready:
                t1 = time.perf_counter()
                yield e, w
                if trace is not None:
                    trace.append(TraceEvent("compute", layer, e, t1, time.perf_counter()))
                self._done_with(step, e)
            for _ in range(len(experts) - len(ready)):
                t0 = time.perf_counter()
                item = step.out.get()
                if isinstance(item, BaseException):
                    raise item
                t1 = time.perf_counter()
                step.stalled(st.stats, item[0], t1 - t0)
                yield item
                if trace is not None:
                    trace.append(TraceEvent("compute", layer, item[0], t1, time.perf_counter()))
                self._done_with(step, item[0])
        finally:
            self._end_step(step)
            if trace is not None:
                trace.append(TraceEvent("step", layer, len(experts), t_step, time.perf_counter()))

    def map_arrivals(
        self,
        layer: int,
        experts: Sequence[int],
        fn: Callable[[int, ExpertWeights], R],
        pool: Executor,
        guess: Guess | None = None,
        early: Callable[[int, ExpertWeights], Callable[[], R] | None] | None = None,
        *,
        started: Callable[[], None] | None = None,
    ) -> dict[int, R]:
        """``{e: fn(e, weights)}`` with each expert computed on ``pool`` as soon as it arrives.

        ``guess`` (the next layer's prediction) is made on ``pool`` once the step began (its
        demand reads are queued), and the compute thread hands its prediction to the loop when
        it comes, while it waits for arrivals anyway: the prediction's router is not on the
        path between the layer's routing and its first read. A guess that is not made before
        the step's last expert is computed is dropped (the next step has begun by then: too
        late to read ahead). ``started`` (the caller's own work for ``pool``, such as the
        shared expert) is called after the guess went to ``pool``, under the same wait for the
        step's first read.

        The compute thread only dispatches: it waits on one queue for the next arrival or the
        next finished computation, and gives an expert's transient buffer back once its
        computation finished (so reads go on landing while workers compute); once every
        expert arrived, the buffers still held go back with the step's end, in its one hop to
        the loop. The step's last arrival, when no other expert is still computing, is
        computed on the compute thread itself, so its matmuls can split over the pool: that
        computation is the step's tail, the time the disk idles before the next layer can
        route. With ``early``, that last expert may come in two stages (the store reads a read
        that goes to the device alone gate and up first: :meth:`ExpertStore._read_early`):
        ``early`` computes with its gate and up projections while its down projection is
        still being read, and what it returns finishes the expert once it landed. On an
        error every started computation is awaited before any buffer is recycled."""
        st = self.store
        trace = st.trace
        step = _Step(layer, early=early is not None)
        t_step = time.perf_counter()
        ready = self._begin(step, experts)
        results: dict[int, R] = {}
        pending = 0
        to_arrive = len(experts) - len(ready)
        if trace is not None:  # every expert's computation on the timeline
            fn = _traced(fn, trace, layer)

        def submit(e: int, w: ExpertWeights) -> None:
            fut = pool.submit(fn, e, w)
            fut.add_done_callback(lambda f: step.out.put(_Done(e, f)))

        guessing: Future[Lookahead | None] | None = None
        finish: tuple[int, Callable[[], R]] | None = None  # the last expert, begun early
        try:
            if to_arrive and (ready or guess is not None or started is not None):
                # Work for the pool now would take both cores from the event loop, which has
                # yet to send the step's first read to the device (up to ~2 ms late, measured
                # with tools/bench/stream_timeline.py): let it go first, within a bound.
                step.issued.wait(ISSUE_WAIT_S)
            if guess is not None:
                guessing = pool.submit(guess)
                guessing.add_done_callback(lambda f: step.out.put(_Guessed(f)))
            if started is not None:  # (the caller's own pool work: after the first read too)
                started()
            for e, w in ready:
                submit(e, w)
                pending += 1
            t0 = time.perf_counter()
            while to_arrive or pending:
                item = step.out.get()
                if isinstance(item, _Guessed):  # (handed over while waiting: t0 stands)
                    guessing = None
                    made = item.future.result()
                    if made is not None:  # (made off the compute thread's path: no charge)
                        anyio.from_thread.run_sync(
                            st._loop_prefetch, made.layer, list(made.experts), token=st.token
                        )
                    continue
                if not pending and isinstance(item, (tuple, _Early)):  # nothing computing
                    step.stalled(st.stats, _arriving(item), time.perf_counter() - t0)
                if isinstance(item, _Early):  # (not the whole expert: to_arrive stands)
                    if early is not None and to_arrive == 1 and not pending:
                        first = functools.partial(early, item.expert, item.weights)
                        rest = _traced_call(first, trace, layer, item.expert)
                        finish = None if rest is None else (item.expert, rest)
                    t0 = time.perf_counter()
                    continue
                if isinstance(item, _Done):
                    pending -= 1
                    if to_arrive:  # (after the last arrival the step's end gives it back)
                        self._done_with(step, item.expert)
                    results[item.expert] = item.future.result()
                elif isinstance(item, BaseException):
                    raise item
                else:
                    to_arrive -= 1
                    if to_arrive or pending:
                        submit(*item)
                        pending += 1
                    else:
                        # The step's last arrival with every other expert done: nothing else
                        # can run meanwhile, so compute it here, where ``fn`` may split its
                        # matmuls over the pool (a worker cannot), instead of on one worker.
                        if finish is not None and finish[0] == item[0]:  # begun early
                            results[item[0]] = _traced_call(finish[1], trace, layer, item[0])
                        else:
                            results[item[0]] = fn(*item)  # (its slot: back with the step's end)
                t0 = time.perf_counter()
        finally:
            if guessing is not None:
                guessing.cancel()  # too late (a running one finishes unheard)
            while pending:  # an error: no buffer may be recycled under a running computation
                item = step.out.get()
                if isinstance(item, _Done):
                    pending -= 1
                    self._done_with(step, item.expert)
                elif isinstance(item, tuple):
                    self._done_with(step, item[0])
            self._end_step(step)
            if trace is not None:
                trace.append(TraceEvent("step", layer, len(experts), t_step, time.perf_counter()))
        return results

    def _done_with(self, step: _Step, expert: int) -> None:
        """The compute side finished with ``expert``: a transient slot goes back to the store
        (posted to the loop, not waited for); an expert in a pinned or cache slot needs
        nothing."""
        if expert in step.held:
            step.held.discard(expert)
            self._post(self.store._loop_done_with, step.layer, expert)

    def _end_step(self, step: _Step) -> None:
        """End ``step`` on the loop (posted, not waited for: :meth:`_post`). The loop then
        gives back every transient slot the step still holds, arrivals it queued before the
        end and nobody took included (late ones release their own: the step is marked
        aborted), so nothing is left for the compute thread to hand back."""
        self._post(self.store._loop_end, step)

    def _post(self, fn: Callable[..., object], *args: Any) -> None:
        """``fn(*args)`` on the store's event loop, soon, without waiting for it: the compute
        thread goes on with the next layer instead of waiting for the loop to wake up, take
        the GIL and answer (0.17-0.2 ms a step's end on the 2-vCPU guest, right where the
        disk idles between two layers). The loop runs what is posted in order, so a step's
        end runs before the next step's begin (a :func:`anyio.from_thread.run_sync` call,
        posted after it). An error ``fn`` raises is kept and raised by the next step's begin
        (:meth:`_begin`); once the loop is gone there is nobody to give slots back to,
        and the post is dropped."""
        st = self.store

        def run() -> None:
            try:
                fn(*args)
            except Exception as exc:
                if st.posted_error is None:
                    st.posted_error = exc

        token = st.token
        try:
            token.backend_class.run_sync_soon(run, (), token.native_token)
        except anyio.RunFinishedError:
            pass

    def _begin(
        self, step: _Step, experts: Sequence[int], lookahead: Lookahead | None = None
    ) -> list[tuple[int, ExpertWeights]]:
        """Begin ``step`` on the loop (one hop, waited for): its resident experts. The calls
        posted before it have run by then; an error one of them met is raised here, once,
        after this step's end was posted in turn."""
        st = self.store
        ready = anyio.from_thread.run_sync(
            st._loop_begin, step, list(experts), lookahead, token=st.token
        )
        err, st.posted_error = st.posted_error, None
        if err is not None:
            self._end_step(step)
            raise err
        return ready

    def prefetch(self, layer: int, experts: Sequence[int], cpu_s: float = 0.0) -> None:
        """Lookahead hint: queue reads for ``layer`` (lower priority, may be skipped). The hop
        to the event loop is compute time too: it is charged with the prediction's ``cpu_s``
        to the layer's next prediction."""
        t0 = time.perf_counter()
        charge = cpu_s + self._hop_s.pop(layer, 0.0)
        anyio.from_thread.run_sync(
            self.store._loop_prefetch, layer, list(experts), charge, token=self.store.token
        )
        self._hop_s[layer] = time.perf_counter() - t0

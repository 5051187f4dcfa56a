"""The tiered expert store: pinned RAM set -> per-layer LRU -> storage.

# L layer, E experts per layer, K top-k, slot = one expert's aligned blob + scales buffers

Routed experts are read by the storage reader (io_uring / threads / buffered) on the event loop,
straight into preallocated aligned slots (no allocation or copy per read). The model runs in a
worker thread and consumes a layer's experts in *arrival order*: resident ones first, misses as
they land. Arrival order only changes *when* an expert is computed, never the result: the MoE
block combines expert outputs in a fixed order, so output is bit-identical for every budget,
policy, prefetch setting and reader backend.

Thread model: methods prefixed ``_loop_`` and coroutines run on the event loop; the
:class:`StreamingExperts` facade is called from the compute thread (one started by
``anyio.to_thread.run_sync``) and reaches the loop through ``anyio.from_thread`` plus a
thread-safe queue for arrivals.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import numpy as np
import numpy.typing as npt

from runtime.linear import Linear
from runtime.policies.lru import LayerLru
from runtime.weights import ExpertWeights
from storage.aligned import aligned_empty
from storage.container import Container, ExpertExtent
from storage.errors import ColibriError, ReadError
from storage.integrity import Check, ExpertChecksums, crc32_of, crc_check, verify_views
from storage.reader import ReadRequest, required_size

__all__ = ["ExpertStore", "StoreLayout", "StreamingExperts", "TierStats", "plan_layout"]

Key = tuple[int, int]
R = TypeVar("R")
ALIGN = 4096


@dataclass
class TierStats:
    """Counters since open (the engine adds them to ``stats()``)."""

    hits_pinned: int = 0
    hits_lru: int = 0
    misses: int = 0
    reads: int = 0  # read requests (an expert's blob and its scales are separate requests)
    experts_read: int = 0
    bytes_read: int = 0
    read_wait_s: float = 0.0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    evictions: int = 0
    bypass: int = 0  # misses served through a transient slot
    read_errors: int = 0
    repins: int = 0
    compute_stall_s: float = 0.0  # time the compute thread waited for an expert to land
    lookahead_predicted_hits: int = 0  # routed experts the lookahead had predicted
    lookahead_routed: int = 0  # routed experts of layers that had a prediction

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = dict(self.__dict__)
        looked = self.hits_pinned + self.hits_lru + self.misses
        d["hit_rate"] = (self.hits_pinned + self.hits_lru) / looked if looked else 0.0
        d["lookahead_recall"] = (
            self.lookahead_predicted_hits / self.lookahead_routed if self.lookahead_routed else 0.0
        )
        return d


@dataclass(frozen=True)
class StoreLayout:
    """How the expert share of the RAM budget is split (see :func:`plan_layout`)."""

    pinned: tuple[Key, ...]
    lru_slots_per_layer: int
    n_layers: int
    transient_slots: int
    slot_bytes: int

    @property
    def nbytes(self) -> int:
        slots = len(self.pinned) + self.transient_slots + self.lru_slots_per_layer * self.n_layers
        return slots * self.slot_bytes


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


def slot_sizes(c: Container) -> tuple[int, int]:
    """(blob buffer bytes, scales buffer bytes) that hold any expert's aligned read superset."""
    blob = scales = 0
    for layer in c.expert_layers():
        for e in range(c.arch.n_routed_experts):
            x = c.expert(layer, e)
            blob = max(blob, required_size(ReadRequest(x.path, x.start, x.end - x.start)))
            scales = max(scales, sum(required_size(r) for r in _scale_requests(x)))
    return blob, scales


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
    """
    blob, scales = slot_sizes(c)
    slot = blob + max(scales, ALIGN)
    layers = c.expert_layers()
    n_e = c.arch.n_routed_experts
    transient = 2 * top_k
    if expert_budget is None:
        return StoreLayout((), n_e, len(layers), transient, slot)
    avail = expert_budget - transient * slot
    if avail < 0:
        raise ColibriError(
            f"the RAM budget leaves {expert_budget / 2**20:.1f} MiB for experts but streaming "
            f"needs at least {transient * slot / 2**20:.1f} MiB ({transient} transient slots of "
            f"{slot / 2**20:.1f} MiB); raise --ram"
        )
    pin = list(pinned)[: avail // slot]
    avail -= len(pin) * slot
    per_layer = min(n_e, avail // (slot * max(len(layers), 1)))
    return StoreLayout(tuple(pin), int(per_layer), len(layers), transient, slot)


class _Slot:
    """One preallocated home for an expert: aligned blob buffer + scales buffer."""

    __slots__ = ("blob", "key", "scales", "weights")

    def __init__(self, blob_bytes: int, scales_bytes: int) -> None:
        self.blob = aligned_empty(blob_bytes, ALIGN)
        self.scales = aligned_empty(max(scales_bytes, ALIGN), ALIGN)
        self.key: Key | None = None
        self.weights: ExpertWeights | None = None

    @property
    def nbytes(self) -> int:
        return int(self.blob.nbytes + self.scales.nbytes)


@dataclass
class _Step:
    """One layer's request from the compute thread."""

    layer: int
    out: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    aborted: bool = False


@dataclass(frozen=True, slots=True)
class _Done:
    """A worker finished computing with ``expert`` (its buffer may be recycled)."""

    expert: int
    future: Future[Any]


class ExpertStore:
    """Owns the slots, the tiers and the reads. Lives on the event loop."""

    def __init__(
        self,
        container: Container,
        reader: Any,
        layout: StoreLayout,
        *,
        prefetch: bool = True,
        prefill_admit: bool = False,
        read_depth: int = 2,
        placement: Any = None,
        checksums: ExpertChecksums | None = None,
    ) -> None:
        self.c = container
        # --verify-reads: every read checked against the manifest's CRC-32s (None: unchecked)
        self.checksums = checksums
        self.reader = reader
        # storage.devices.Placement: which copy (primary or a mirror) serves each expert, with
        # failover; None reads everything from the primary.
        self.placement = placement
        self.layout = layout
        self.prefetch_enabled = prefetch
        self.stats = TierStats()
        self._blob_bytes, self._scales_bytes = slot_sizes(container)
        self._pinned: dict[Key, _Slot] = {}
        self._lru = {
            layer: LayerLru(layout.lru_slots_per_layer) for layer in container.expert_layers()
        }
        self._cached: dict[Key, _Slot] = {}
        self._free_cache: dict[int, list[_Slot]] = {}
        self._transient_free: list[_Slot] = []
        self._slot_freed = anyio.Event()
        self._inflight: set[Key] = set()
        self._prefetched: dict[Key, _Slot] = {}  # lookahead results parked in transient slots
        self._waiters: dict[Key, _Step] = {}
        self._held: dict[Key, _Slot] = {}  # transient slots handed to the compute thread
        self._lookahead_cached: set[Key] = set()  # lookahead reads that landed in a cache slot
        self._predicted: dict[int, set[int]] = {}  # layer -> lookahead prediction (for recall)
        self._tg: Any = None
        self.prefill = prefill_admit
        self.read_depth = read_depth
        self._io_inflight = 0
        self._demand_queued = 0
        self._io_changed = anyio.Event()
        self._layer_gen: dict[int, int] = {}
        self.nbytes = 0
        self.fixed_buffers = False

    # ------------------------------------------------------------------ set-up
    async def start(self, tg: Any) -> None:
        """Allocate every slot up front and read the pinned set."""
        self._tg = tg
        self._transient_free = [self._new_slot() for _ in range(self.layout.transient_slots)]
        for layer in self._lru:
            self._free_cache[layer] = [
                self._new_slot() for _ in range(self.layout.lru_slots_per_layer)
            ]
        pinned_slots = [self._new_slot() for _ in self.layout.pinned]
        slots = (
            self._transient_free
            + [x for free in self._free_cache.values() for x in free]
            + pinned_slots
        )
        # Registered (fixed) buffers save the kernel a page-table walk per read where allowed.
        self.fixed_buffers = bool(
            self.reader.register_buffers([b for x in slots for b in (x.blob, x.scales)])
        )
        for key, slot in zip(self.layout.pinned, pinned_slots, strict=True):
            await self._read_into(key, slot)
            self._pinned[key] = slot

    async def repin(self, counts: npt.NDArray[np.int64]) -> int:
        """Live re-pin between turns: swap cold pinned experts for hot ones (hysteresis, at
        most a few swaps). Only speed changes. Returns the number of swaps made."""
        from runtime.policies import repin_swaps

        if not self._pinned:
            return 0
        score = {
            (layer, e): float(counts[layer, e])
            for layer in self._lru
            for e in range(counts.shape[1])
            if counts[layer, e] > 0 or (layer, e) in self._pinned
        }
        done = 0
        for old, new in repin_swaps(list(self._pinned), score):
            if new in self._inflight or new in self._pinned:
                continue
            cached = self._cached.pop(new, None)
            if cached is not None:  # it was in the LRU: its slot goes back to the free list
                self._lru[new[0]].discard(new[1])
                self._free_cache[new[0]].append(cached)
            slot = self._pinned.pop(old)
            try:
                with anyio.CancelScope(shield=True):
                    await self._read_into(new, slot)
            except ColibriError:
                continue  # the slot is dropped from the pinned set; reads fall back to the LRU
            self._pinned[new] = slot
            done += 1
        self.stats.repins += done
        return done

    def _new_slot(self) -> _Slot:
        s = _Slot(self._blob_bytes, self._scales_bytes)
        self.nbytes += s.nbytes
        return s

    def tiers(self) -> dict[Key, str]:
        """Where each resident expert lives now: ``pinned`` or ``lru`` (absent = storage)."""
        t = {k: "lru" for k in self._cached if k not in self._inflight}
        t.update({k: "pinned" for k in self._pinned})
        return t

    # ------------------------------------------------------------------ reads
    async def _read_into(self, key: Key, slot: _Slot) -> None:
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
        t0 = time.perf_counter()
        try:
            if self.placement is not None:  # the copy is chosen there; failover happens there
                views = await self.placement.read_many(
                    self.reader, key, [blob_req, *sreqs], bufs, checks
                )
            else:
                views = await self.reader.read_many([blob_req, *sreqs], bufs)
                if checks is not None:
                    await verify_views(views, checks)
            if self.checksums is not None and len(sreqs) > 1:  # scales in several pieces
                self._check_scales(key, x, views[1:])
        except ColibriError:
            self.stats.read_errors += 1
            raise
        finally:
            self.stats.read_wait_s += time.perf_counter() - t0
        self.stats.reads += 1 + len(sreqs)
        self.stats.experts_read += 1
        self.stats.bytes_read += blob_req.length + sum(r.length for r in sreqs)
        blob = np.frombuffer(views[0], dtype=np.uint8)
        svs = [np.frombuffer(v, dtype=np.uint8) for v in views[1:]]
        slot.weights = _weights_from(x, blob, sreqs, svs)
        slot.key = key

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
                "mismatch: this copy on disk is damaged; run `coli doctor --verify`"
            )

    async def _take_slot(self, key: Key, *, demand: bool) -> tuple[_Slot, bool] | None:
        """A cache slot when the layer's LRU can take the expert, else a transient slot.

        Demand reads may use every transient slot; lookahead reads only the spare half (and
        return None rather than wait), so they never delay what the current step needs."""
        layer, e = key
        lru = self._lru[layer]
        if lru.can_admit(prefill=self.prefill):
            evicted = lru.admit(e, prefill=self.prefill)
            if evicted is not None:
                slot = self._cached.pop((layer, evicted))
                self.stats.evictions += 1
                if (layer, evicted) in self._lookahead_cached:
                    self._lookahead_cached.discard((layer, evicted))
                    self.stats.prefetch_wasted += 1
            else:
                slot = self._free_cache[layer].pop()
            self._cached[key] = slot
            return slot, True
        if not demand:
            if len(self._transient_free) <= self.layout.transient_slots // 2:
                return None
            return self._transient_free.pop(), False
        self.stats.bypass += 1
        while not self._transient_free:
            await self._slot_freed.wait()
        return self._transient_free.pop(), False

    def _release_transient(self, slot: _Slot) -> None:
        slot.key = None
        slot.weights = None
        self._transient_free.append(slot)
        self._slot_freed.set()
        self._slot_freed = anyio.Event()

    async def _gate(self, demand: bool) -> None:
        """Admit one read: at most ``read_depth`` in flight, demand reads before lookahead.

        A few reads in flight keep the disk busy; all misses at once would share the bandwidth
        and land together at the end, leaving nothing to overlap compute with."""
        queued = False
        try:
            while True:
                # Lookahead reads only use an idle disk: they never delay a demand read.
                if (demand and self._io_inflight < self.read_depth) or (
                    not demand and self._io_inflight == 0 and self._demand_queued == 0
                ):
                    self._io_inflight += 1
                    return
                if demand and not queued:
                    self._demand_queued += 1
                    queued = True
                await self._io_changed.wait()
        finally:
            if queued:
                self._demand_queued -= 1

    def _ungate(self) -> None:
        self._io_inflight -= 1
        self._io_changed.set()
        self._io_changed = anyio.Event()

    async def _fetch(self, key: Key, *, demand: bool) -> None:
        layer = key[0]
        if not demand:
            gen = self._layer_gen.get(layer, 0)
            await self._gate(demand=False)
            wanted = key in self._waiters
            if not wanted and self._layer_gen.get(layer, 0) != gen:
                # The layer's step came and went without this expert: skip the stale read.
                self._ungate()
                self._inflight.discard(key)
                self.stats.prefetch_issued -= 1
                return
            demand = wanted
            got = await self._take_slot(key, demand=demand)
        else:
            got = await self._take_slot(key, demand=True)
            await self._gate(demand=True)
        if got is None:  # no spare room for a lookahead read: skip it
            self._ungate()
            self._inflight.discard(key)
            self.stats.prefetch_issued -= 1
            return
        slot, cached = got
        lru = self._lru[layer]
        if cached:
            lru.hold(key[1])
        err: ColibriError | None = None
        try:
            with anyio.CancelScope(shield=True):  # never abandon a buffer the kernel writes into
                await self._read_into(key, slot)
        except ColibriError as exc:
            err = exc
        finally:
            self._ungate()
            self._inflight.discard(key)
            if cached:
                lru.unhold(key[1])
        if err is not None and cached:
            lru.discard(key[1])
            self._cached.pop(key, None)
            self._free_cache[key[0]].append(slot)
        step = self._waiters.pop(key, None)
        if step is None and cached and err is None and not demand:
            self._lookahead_cached.add(key)
        if step is None or step.aborted:
            if not cached:
                if err is None and step is None and not demand:
                    self._prefetched[key] = slot  # parked for the demand step of that layer
                else:
                    self._release_transient(slot)
            return
        if err is not None:
            if not cached:
                self._release_transient(slot)
            step.out.put(err)
            return
        assert slot.weights is not None
        if not cached:
            self._held[key] = slot
        step.out.put((key[1], slot.weights))

    # ------------------------------------------------------------------ loop-side step API
    def _loop_begin(self, step: _Step, experts: Sequence[int]) -> list[tuple[int, ExpertWeights]]:
        """Resident experts now; misses are read and arrive through ``step.out``."""
        layer = step.layer
        lru = self._lru[layer]
        lru.protect(experts)
        predicted = self._predicted.pop(layer, None)
        if predicted is not None:
            self.stats.lookahead_routed += len(experts)
            self.stats.lookahead_predicted_hits += len(predicted.intersection(experts))
        ready: list[tuple[int, ExpertWeights]] = []
        for e in experts:
            key = (layer, e)
            pinned = self._pinned.get(key)
            if pinned is not None and pinned.weights is not None:
                self.stats.hits_pinned += 1
                ready.append((e, pinned.weights))
                continue
            cached = self._cached.get(key)
            if cached is not None and key not in self._inflight and cached.weights is not None:
                self.stats.hits_lru += 1
                if key in self._lookahead_cached:
                    self._lookahead_cached.discard(key)
                    self.stats.prefetch_used += 1
                lru.touch(e)
                ready.append((e, cached.weights))
                continue
            self.stats.misses += 1
            parked = self._prefetched.pop(key, None)
            if parked is not None and parked.weights is not None:
                self.stats.prefetch_used += 1
                self._held[key] = parked
                ready.append((e, parked.weights))
                continue
            self._waiters[key] = step
            if key in self._inflight:
                self.stats.prefetch_used += 1  # a lookahead read already under way
            else:
                self._inflight.add(key)
                self._tg.start_soon(self._demand, key)
        return ready

    async def _demand(self, key: Key) -> None:
        await self._fetch(key, demand=True)

    async def _lookahead(self, key: Key) -> None:
        await self._fetch(key, demand=False)

    def _loop_done_with(self, layer: int, e: int) -> None:
        slot = self._held.pop((layer, e), None)
        if slot is not None:
            self._release_transient(slot)

    def _loop_end(self, step: _Step) -> None:
        step.aborted = True  # late arrivals release their own transient slots
        self._layer_gen[step.layer] = self._layer_gen.get(step.layer, 0) + 1
        self._lru[step.layer].unprotect()
        for key in [k for k, s in self._waiters.items() if s is step]:
            del self._waiters[key]
        for key in [k for k in self._prefetched if k[0] == step.layer]:
            self.stats.prefetch_wasted += 1
            self._release_transient(self._prefetched.pop(key))

    def _loop_prefetch(self, layer: int, experts: Sequence[int]) -> None:
        if not self.prefetch_enabled or layer not in self._lru:
            return
        self._predicted[layer] = set(experts)
        for e in experts:
            key = (layer, e)
            if (
                key in self._pinned
                or key in self._cached
                or key in self._inflight
                or key in self._prefetched
            ):
                continue
            self.stats.prefetch_issued += 1
            self._inflight.add(key)
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


class StreamingExperts:
    """``ExpertSource`` for the compute thread, backed by an :class:`ExpertStore` on the loop.

    Use only from a thread started by ``anyio.to_thread.run_sync`` (the engine does)."""

    def __init__(self, store: ExpertStore) -> None:
        self.store = store

    @property
    def wants_lookahead(self) -> bool:
        return self.store.prefetch_enabled

    def arrivals(self, layer: int, experts: Sequence[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """Yield ``(expert, weights)`` for every id: resident first, then misses as they land.

        Resume the generator only after computing with the yielded expert: its transient
        buffer is recycled then."""
        st = self.store
        step = _Step(layer)
        ready = anyio.from_thread.run_sync(st._loop_begin, step, list(experts))
        try:
            for e, w in ready:
                yield e, w
                anyio.from_thread.run_sync(st._loop_done_with, layer, e)
            for _ in range(len(experts) - len(ready)):
                t0 = time.perf_counter()
                item = step.out.get()
                st.stats.compute_stall_s += time.perf_counter() - t0
                if isinstance(item, BaseException):
                    raise item
                yield item
                anyio.from_thread.run_sync(st._loop_done_with, layer, item[0])
        finally:
            self._end_step(step)

    def map_arrivals(
        self,
        layer: int,
        experts: Sequence[int],
        fn: Callable[[int, ExpertWeights], R],
        pool: Executor,
    ) -> dict[int, R]:
        """``{e: fn(e, weights)}`` with each expert computed on ``pool`` as soon as it arrives.

        The compute thread only dispatches: it waits on one queue for the next arrival or the
        next finished computation, and gives an expert's transient buffer back once its
        computation finished (so reads go on landing while workers compute). On an error every
        started computation is awaited before any buffer is recycled."""
        st = self.store
        step = _Step(layer)
        ready = anyio.from_thread.run_sync(st._loop_begin, step, list(experts))
        results: dict[int, R] = {}
        pending = 0
        to_arrive = len(experts) - len(ready)

        def submit(e: int, w: ExpertWeights) -> None:
            fut = pool.submit(fn, e, w)
            fut.add_done_callback(lambda f: step.out.put(_Done(e, f)))

        try:
            for e, w in ready:
                submit(e, w)
                pending += 1
            while to_arrive or pending:
                t0 = time.perf_counter()
                item = step.out.get()
                if not pending:  # nothing computing: the compute side stalls on the read
                    st.stats.compute_stall_s += time.perf_counter() - t0
                if isinstance(item, _Done):
                    pending -= 1
                    anyio.from_thread.run_sync(st._loop_done_with, layer, item.expert)
                    results[item.expert] = item.future.result()
                elif isinstance(item, BaseException):
                    raise item
                else:
                    to_arrive -= 1
                    submit(*item)
                    pending += 1
        finally:
            while pending:  # an error: no buffer may be recycled under a running computation
                item = step.out.get()
                if isinstance(item, _Done):
                    pending -= 1
                    anyio.from_thread.run_sync(st._loop_done_with, layer, item.expert)
                elif not isinstance(item, BaseException):
                    anyio.from_thread.run_sync(st._loop_done_with, layer, item[0])
            self._end_step(step)
        return results

    def _end_step(self, step: _Step) -> None:
        """End ``step`` on the loop, then give back the slots of arrivals it queued before the
        end and nobody took (late ones release their own: the step is marked aborted)."""
        st = self.store
        anyio.from_thread.run_sync(st._loop_end, step)
        while True:
            try:
                item = step.out.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, (BaseException, _Done)):
                anyio.from_thread.run_sync(st._loop_done_with, step.layer, item[0])

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Lookahead hint: queue reads for ``layer`` (lower priority, may be skipped)."""
        anyio.from_thread.run_sync(self.store._loop_prefetch, layer, list(experts))

"""The tier policy: where each routed expert lives and which read goes next, decided in one place.

Pure and synchronous: no buffers, no I/O, no event loop, no clock.
:class:`runtime.experts.ExpertStore` runs it on the event loop against a
:class:`~storage.reader.Reader` and keeps the buffers (its tests use a fake reader on a fake
clock); ``tests/test_tier_policy.py`` drives the policy directly. It decides only *where* an
expert lives and *when* it is read, so it can change speed, never an output.

Per step of a layer: :meth:`TierPolicy.begin` sorts the routed experts into resident (pinned,
LRU, parked lookahead), already in flight, or to read; :meth:`place` picks each read's slot
(a cache slot, evicting the LRU victim, or a transient one); :meth:`try_issue` gates reads
(at most ``read_depth`` demand reads in flight; a lookahead read goes to the device in pieces,
one piece at a time, and only while no demand read is in flight or waiting);
:meth:`landed` says what happens to a completed read (deliver, park, release);
:meth:`end` closes the step. :meth:`lookahead` turns a prediction into reads, and
:meth:`lookahead_ready`, asked before each piece, drops the ones that went stale: once the step
of the layer they were for has begun without routing to them, the rest is not read.

So a lookahead read never stands between a demand read and the device for more than one piece,
and its results never evict a cached expert: they wait in transient slots, and a step that uses
one takes it into the layer's LRU the way its own read would have been (:meth:`adopt`), so the
cache holds what it would hold without lookahead.

``--prefetch auto`` (the default) keeps a ledger per layer: what its lookahead *saved* (the
read time of a result a step then used, or the head start of a read a step joined in flight)
against what it *cost*: the device time its pieces took from demand reads they shared the
device with (measured piece by piece: the overlap, weighted by a piece's share of the device,
one request among those in flight), and the compute-thread time of the predictions made on
the compute thread itself (the next layer's router where a step runs serially, and a dense
layer's router and hop to the event loop), which on a small, compute-bound model is all
lookahead does. A prediction made on a pool worker while the step's reads are in flight
(:meth:`runtime.experts.StreamingExperts.map_arrivals`) is not on that path and is not charged.
Every ``LEDGER_STEPS`` steps of the layer the difference feeds an average;
the layer reads ahead while the average is >= 0. A layer starts off (the event loop's own
work for lookahead reads is not counted, so it has to show a gain first); while it is off
every ``PROBE_EVERY``-th step may still read ahead (a probe), so the ledger sees whether and
when routing is predictable. The step before each probe is a *dry* probe: its prediction is
made and scored against what the layer then routes to, but not read. The probe reads only
when every read the dry probe would have made was routed; otherwise it stays dry too and
costs no disk time (on random routing most probes stay dry). Lookahead that loses costs at
most one step's reads in ``PROBE_EVERY``, and less as it keeps losing (each losing or dry
probe doubles the interval, up to ``PROBE_EVERY_MAX``; a layer that turns on starts over);
a window that read nothing ahead never turns a layer on. ``on`` and
``off`` force it. Only speed changes: a lookahead read never decides what a step computes.

Shape legend: L layer, E expert, Key = (L, E); "transient" = a slot outside the cache (misses the
LRU cannot take, lookahead results parked until their layer runs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from runtime.policies.lru import LayerLru

__all__ = ["Landing", "Placement", "PrefetchMode", "StepHandle", "TierPolicy", "TierStats"]

Key = tuple[int, int]
Tier = Literal["pinned", "lru", "parked", "inflight", "read"]
Landing = Literal["deliver", "error", "park", "release", "keep"]
PrefetchMode = Literal["auto", "on", "off"]

# --prefetch auto: a layer's lookahead is judged over windows of this many of its steps ...
LEDGER_STEPS = 8  # (PROBE_EVERY is a multiple of it: a probe is the last step of a window)
# ... by an exponentially weighted average of (read time saved - read time it cost) per window,
LEDGER_ALPHA = 0.5
# ... and while it is off, every PROBE_EVERY-th step of the layer still reads ahead, so the
# ledger sees when routing becomes predictable again; each probe that loses doubles that
# interval, up to PROBE_EVERY_MAX steps (a compute-bound model pays ever less for probes that
# never pay), and a layer that turns on starts over at PROBE_EVERY. (Both are multiples of
# LEDGER_STEPS.)
PROBE_EVERY = 8
PROBE_EVERY_MAX = 64
# A lookahead read goes to the device in pieces of this many bytes, so that a demand read that
# arrives meanwhile waits for at most one piece, and a read that went stale stops early.
LOOKAHEAD_PIECE = 4 << 20
# At most this many reads per prediction, the most likely first: the device idles between two
# layers for about one expert's read, and a read that has not started when its layer begins
# is dropped anyway.
LOOKAHEAD_READS = 2


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
    prefetch_aborted: int = 0  # lookahead reads stopped part-way (their layer routed elsewhere)
    prefetch_wasted_bytes: int = 0  # blob bytes lookahead reads read for no step (pieces)
    evictions: int = 0
    bypass: int = 0  # misses served through a transient slot
    read_errors: int = 0
    repins: int = 0
    compute_stall_s: float = 0.0  # time the compute thread waited for an expert to land
    read_wait_demand_s: float = 0.0  # ... of it, for an expert a demand read brought
    read_wait_lookahead_s: float = 0.0  # ... for one a lookahead read was already bringing
    lookahead_predicted_hits: int = 0  # routed experts the lookahead had predicted
    lookahead_routed: int = 0  # routed experts of layers that had a prediction
    lookahead_saved_s: float = 0.0  # demand read time lookahead results spared steps
    lookahead_cost_s: float = 0.0  # pieces' time beside demand reads + prediction compute
    lookahead_cpu_s: float = 0.0  # ... of it, compute-thread time of predictions and hops
    lookahead_layers_off: int = 0  # layers --prefetch auto judged and keeps lookahead off for
    lookahead_dry_probes: int = 0  # predictions of off layers scored, not read (auto)
    early_arrivals: int = 0  # experts handed over with gate and up landed, down still read

    @property
    def hit_rate(self) -> float:
        """Lookups served from memory (pinned or LRU) over all lookups."""
        looked = self.hits_pinned + self.hits_lru + self.misses
        return (self.hits_pinned + self.hits_lru) / looked if looked else 0.0

    def as_dict(self) -> dict[str, float | None]:
        d: dict[str, float | None] = dict(self.__dict__)
        # None before the first lookup: no hit rate yet, rather than a 0 % one
        looked = self.hits_pinned + self.hits_lru + self.misses
        d["hit_rate"] = self.hit_rate if looked else None
        d["lookahead_recall"] = (  # (None before the first prediction, as hit_rate)
            self.lookahead_predicted_hits / self.lookahead_routed if self.lookahead_routed else None
        )
        return d


@dataclass(eq=False)
class StepHandle:
    """One layer's step as the policy knows it (the store attaches its arrival queue)."""

    layer: int
    aborted: bool = False


@dataclass
class _Ledger:
    """One layer's lookahead account under ``--prefetch auto``."""

    saved_s: float = 0.0  # this window
    cost_s: float = 0.0
    steps: int = 0
    score: float | None = None  # EWMA of saved - cost per window
    on: bool = False  # under "auto" a layer starts off: its probes must show that it pays
    probe_every: int = PROBE_EVERY  # while off: one step in this many reads ahead
    promising: bool = False  # the last dry probe's reads would all have been used
    wet: bool = False  # this window's probe read ahead


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a read lands: a cache slot (``evicted``: the key whose slot it takes, if any) or a
    transient slot."""

    cached: bool
    evicted: Key | None = None


class TierPolicy:
    """Key-level state of every tier and the decisions over it (see the module docstring)."""

    def __init__(
        self,
        layers: Iterable[int],
        *,
        lru_slots: int,
        transient_slots: int,
        read_depth: int = 2,
        prefetch: PrefetchMode | bool = "auto",
    ) -> None:
        """``prefetch``: "on" always reads ahead, "off" never, "auto" per layer while the
        lookahead saves more read time than it costs (True / False mean on / off)."""
        self.lru = {layer: LayerLru(lru_slots) for layer in layers}
        self.transient_slots = transient_slots
        self.transient_free = transient_slots
        self.read_depth = read_depth
        if isinstance(prefetch, bool):
            prefetch = "on" if prefetch else "off"
        self.prefetch_mode: PrefetchMode = prefetch
        self._ledger = {layer: _Ledger() for layer in self.lru}
        self._la_start: dict[Key, float] = {}  # lookahead reads on the device: first piece
        # lookahead reads counted in ``prefetch_issued``: once their first piece goes to the
        # device or a step joins them (a prediction dropped before either never counts, so the
        # counter only grows)
        self._la_issued: set[Key] = set()
        self._la_read_s: dict[Key, float] = {}  # lookahead reads: device time of their pieces
        self._la_piece: dict[Key, tuple[float, float]] = {}  # piece on the device: (start, busy)
        self._la_begun: dict[Key, int] = {}  # lookahead reads: their layer's begun steps then
        self._la_bytes: dict[Key, int] = {}  # lookahead reads: blob bytes of their pieces
        self._begun: dict[int, int] = {}  # layer -> steps begun
        self._lookahead_held: set[Key] = set()  # lookahead reads in flight a step joined
        self.prefill = False  # while prefilling, the LRU admits only into free slots
        self.stats = TierStats()
        self.pinned: set[Key] = set()
        self.inflight: set[Key] = set()
        self.parked: set[Key] = set()  # lookahead results in transient slots
        self.waiters: dict[Key, StepHandle] = {}
        self._lookahead_cached: set[Key] = set()  # lookahead reads that landed in a cache slot
        self._predicted: dict[int, set[int]] = {}  # layer -> lookahead prediction (for recall)
        self._dry: dict[int, set[int]] = {}  # layer -> what a dry probe would have read
        self._demand_inflight = 0
        self._lookahead_inflight = 0
        self._demand_queued = 0
        # device seconds a lookahead piece beside demand reads takes from them (up to
        # _busy_since, if set; the stretch since then counts at _busy_share), see demand_busy
        self._demand_busy_s = 0.0
        self._busy_since: float | None = None
        self._busy_share = 0.5

    # ------------------------------------------------------------------ where experts are
    def cached(self, key: Key) -> bool:
        """In the layer's LRU with its read complete."""
        return key[1] in self.lru[key[0]] and key not in self.inflight

    def tiers(self) -> dict[Key, str]:
        """Where each resident expert lives now: ``pinned`` or ``lru`` (absent = storage)."""
        t = {
            (layer, e): "lru"
            for layer, lru in self.lru.items()
            for e in lru.keys()
            if (layer, e) not in self.inflight
        }
        t.update({k: "pinned" for k in self.pinned})
        return t

    # ------------------------------------------------------------------ a layer's step
    def begin(
        self, step: StepHandle, experts: Sequence[int], *, now: float = 0.0
    ) -> list[tuple[int, Tier]]:
        """Classify each routed expert of ``step`` (ascending ids): resident ("pinned", "lru",
        "parked": use it now), "inflight" (a lookahead read is under way: wait for it) or
        "read" (start a demand read). Waiting and reading experts are registered to ``step``."""
        layer = step.layer
        lru = self.lru[layer]
        lru.protect(experts)
        self._begun[layer] = self._begun.get(layer, 0) + 1
        predicted = self._predicted.pop(layer, None)
        if predicted is not None:
            self.stats.lookahead_routed += len(experts)
            self.stats.lookahead_predicted_hits += len(predicted.intersection(experts))
        would = self._dry.pop(layer, None)
        if would is not None:  # a dry probe: would every read it skipped have been used?
            self._ledger[layer].promising = bool(would) and would.issubset(experts)
        out: list[tuple[int, Tier]] = []
        for e in experts:
            key = (layer, e)
            if key in self.pinned:
                self.stats.hits_pinned += 1
                out.append((e, "pinned"))
            elif self.cached(key):
                self.stats.hits_lru += 1
                if key in self._lookahead_cached:
                    self._lookahead_cached.discard(key)
                    self.stats.prefetch_used += 1
                    self._saved(key, self._la_read_s.pop(key, 0.0))
                lru.touch(e)
                out.append((e, "lru"))
            else:
                self.stats.misses += 1
                if key in self.parked:
                    self.parked.discard(key)
                    self.stats.prefetch_used += 1
                    self._saved(key, self._la_read_s.pop(key, 0.0))
                    out.append((e, "parked"))
                    continue
                self.waiters[key] = step
                if key in self.inflight:
                    self._issued(key)
                    self.stats.prefetch_used += 1  # a lookahead read already under way
                    self._lookahead_held.add(key)
                    started = self._la_start.get(key)
                    if started is not None:  # its head start is read time the step saves
                        self._saved(key, max(0.0, now - started))
                    out.append((e, "inflight"))
                else:
                    self.inflight.add(key)
                    out.append((e, "read"))
        return out

    def end(self, step: StepHandle) -> list[Key]:
        """Close ``step``: later arrivals for it release their own slots. Returns the parked
        lookahead results of its layer that it did not use (their slots go back)."""
        step.aborted = True
        layer = step.layer
        self._lookahead_held -= {k for k in self._lookahead_held if k[0] == layer}
        self.lru[layer].unprotect()
        for key in [k for k, s in self.waiters.items() if s is step]:
            del self.waiters[key]
        unused = [k for k in self.parked if k[0] == layer]
        for key in unused:
            self.parked.discard(key)
            self._wasted(key)
            self.release_transient()
        self._close_window(layer)  # after the unused results of this step were booked
        return unused

    # ------------------------------------------------------------------ --prefetch auto
    def _saved(self, key: Key, seconds: float) -> None:
        """A step used ``key``'s lookahead result: ``seconds`` of demand read time saved."""
        self._la_bytes.pop(key, None)
        self._ledger[key[0]].saved_s += seconds
        self.stats.lookahead_saved_s += seconds

    def _wasted(self, key: Key) -> None:
        """``key``'s lookahead result leaves unused (its cost was booked piece by piece)."""
        self.stats.prefetch_wasted += 1
        self.stats.prefetch_wasted_bytes += self._la_bytes.pop(key, 0)
        self._la_read_s.pop(key, None)

    def _close_window(self, layer: int) -> None:
        """Count a step of ``layer``; every LEDGER_STEPS steps, judge its lookahead: on while
        the average of (read time saved - read time cost) per window is >= 0."""
        led = self._ledger.get(layer)
        if led is None:
            return
        led.steps += 1
        if led.steps % LEDGER_STEPS:
            return
        net = led.saved_s - led.cost_s
        led.score = (
            net if led.score is None else LEDGER_ALPHA * net + (1 - LEDGER_ALPHA) * (led.score)
        )
        led.saved_s = led.cost_s = 0.0
        if self.prefetch_mode == "auto":
            probed = not led.on and led.steps % led.probe_every == 0  # this window's last step
            wet, led.wet = led.wet, False
            if led.on or wet:  # (off, a window that read nothing ahead cannot turn it on)
                led.on = led.score >= 0.0
            if led.on:
                led.probe_every = PROBE_EVERY
            elif probed and (net < 0.0 or not wet):  # the probe lost (or stayed dry): the
                led.probe_every = min(PROBE_EVERY_MAX, 2 * led.probe_every)  # next comes later
            self.stats.lookahead_layers_off = sum(
                x.score is not None and not x.on for x in self._ledger.values()
            )

    def reads_ahead(self, layer: int) -> bool:
        """Whether a prediction for ``layer`` is made now: always under "on", never under
        "off"; under "auto" while the layer's ledger says it pays, and on a layer that is off,
        for its probe step and the step before it (the dry probe: see :meth:`lookahead`)."""
        if self.prefetch_mode != "auto":
            return self.prefetch_mode == "on"
        led = self._ledger[layer]
        # the probe is the last step of a window, so the window it closes judges it
        return led.on or led.steps % led.probe_every >= led.probe_every - 2

    def _probe_reads(self, layer: int) -> bool:
        """Under "auto", for a layer that is off: whether this step's prediction is read (a
        wet probe) rather than only scored (dry)."""
        led = self._ledger[layer]
        return led.steps % led.probe_every == led.probe_every - 1 and led.promising

    def _issued(self, key: Key) -> None:
        """Count ``key``'s lookahead read as issued, once."""
        if key not in self._la_issued:
            self._la_issued.add(key)
            self.stats.prefetch_issued += 1

    def piece_started(self, key: Key, now: float) -> None:
        """A piece of ``key``'s lookahead read went to the device at ``now``."""
        self._issued(key)
        self._la_start.setdefault(key, now)
        self._la_piece[key] = (now, self.demand_busy(now))

    def piece_done(self, key: Key, now: float, nbytes: int = 0) -> None:
        """That piece (``nbytes``) finished at ``now``: its device time counts to the read, and
        the time it shared the device with demand reads is booked as the layer's lookahead
        cost."""
        start, busy = self._la_piece.pop(key)
        self._la_read_s[key] = self._la_read_s.get(key, 0.0) + max(0.0, now - start)
        self._la_bytes[key] = self._la_bytes.get(key, 0) + nbytes
        cost = max(0.0, self.demand_busy(now) - busy)
        if cost:
            self._ledger[key[0]].cost_s += cost
            self.stats.lookahead_cost_s += cost

    def charge(self, layer: int, cpu_s: float) -> None:
        """A prediction for ``layer`` took ``cpu_s`` seconds of the compute thread (the router
        and, from a dense layer, the hop to the event loop): a cost of its lookahead."""
        led = self._ledger.get(layer)
        if led is None or cpu_s <= 0.0:
            return
        led.cost_s += cpu_s
        self.stats.lookahead_cost_s += cpu_s
        self.stats.lookahead_cpu_s += cpu_s

    def demand_busy(self, now: float) -> float:
        """Device seconds, up to ``now``, that a lookahead piece in flight beside the demand
        reads would have taken from them: the time demand reads were in flight or waiting,
        each stretch weighted by a piece's share of the device then, ``1 / (1 + k)`` with
        ``k`` demand reads in flight (at least one), as the device serves the requests it
        holds alike."""
        since = self._busy_since
        now_s = max(0.0, now - since) * self._busy_share if since is not None else 0.0
        return self._demand_busy_s + now_s

    def _demand_changed(self, now: float) -> None:
        if self._busy_since is not None:  # close the stretch at its share
            self._demand_busy_s += max(0.0, now - self._busy_since) * self._busy_share
            self._busy_since = None
        if self._demand_inflight + self._demand_queued > 0:
            self._busy_since = now
            self._busy_share = 1.0 / (1 + max(1, self._demand_inflight))

    # ------------------------------------------------------------------ slots
    def place(self, key: Key, *, demand: bool) -> Placement | None:
        """The slot for ``key``'s read: a cache slot when the layer's LRU can take it (a demand
        read evicts its victim; a lookahead read only takes a free one), else a transient one.
        Lookahead reads only use the spare half of the transient slots. None: no slot now (a
        lookahead read is then skipped, a demand read waits for :meth:`release_transient` and
        asks again)."""
        layer, e = key
        lru = self.lru[layer]
        # a lookahead read takes a cache slot only when one is free: it never evicts
        if lru.can_admit(prefill=self.prefill) if demand else len(lru) < lru.capacity:
            evicted = self._admit(key)
            lru.hold(e)  # not evictable while its read is in flight
            return Placement(True, evicted)
        if not demand and self.transient_free <= self.transient_slots // 2:
            return None
        if self.transient_free == 0:
            return None
        self.transient_free -= 1
        if demand:
            self.stats.bypass += 1
        return Placement(False)

    def release_transient(self) -> None:
        """A transient slot came back (its expert was computed, or its read was dropped)."""
        self.transient_free += 1
        assert self.transient_free <= self.transient_slots

    def adopt(self, key: Key) -> Placement | None:
        """A step takes ``key``, a lookahead result in a transient slot (parked, or a read it
        joined that just landed): the layer's LRU takes it as it would have taken the step's
        own read (evicting its victim), so lookahead does not change what the cache holds.
        Returns where it went (the store swaps buffers: the slot becomes a cache slot, the
        victim's or a free cache slot's buffer becomes transient), or None when the LRU cannot
        take it now (it stays in its transient slot until the step has computed with it)."""
        self._lookahead_held.discard(key)
        lru = self.lru[key[0]]
        if key[1] in lru or not lru.can_admit(prefill=self.prefill):
            return None
        evicted = self._admit(key)
        self.release_transient()  # a buffer of the cache becomes the transient one
        return Placement(True, evicted)

    def _admit(self, key: Key) -> Key | None:
        """Put ``key`` in its layer's LRU (the caller checked it can): the key it evicted, if
        any, counted (and booked wasted when it was an unused lookahead result)."""
        layer, e = key
        victim = self.lru[layer].admit(e, prefill=self.prefill)
        if victim is None:
            return None
        evicted = (layer, victim)
        self.stats.evictions += 1
        if evicted in self._lookahead_cached:
            self._lookahead_cached.discard(evicted)
            self._wasted(evicted)
        return evicted

    def adoptable(self, key: Key) -> bool:
        """Whether ``key``, landing for a step, is a lookahead read the step joined in flight
        (to :meth:`adopt` once it lands)."""
        return key in self._lookahead_held

    # ------------------------------------------------------------------ the read gate
    def try_issue(self, *, demand: bool, now: float = 0.0) -> bool:
        """Start one read (a lookahead read: one piece) if the gate allows it now: demand reads
        while fewer than ``read_depth`` demand reads are in flight; a lookahead piece only when
        no demand read is in flight or waiting, and one piece at a time (so a demand read that
        arrives meanwhile shares the device with at most one piece). A few demand reads in
        flight keep the device busy; all misses at once would share the bandwidth and land
        together at the end, leaving nothing to overlap compute with."""
        if demand:
            ok = self._demand_inflight < self.read_depth
            if ok:
                self._demand_inflight += 1
                self._demand_changed(now)
            return ok
        ok = self._demand_inflight == 0 and self._demand_queued == 0
        ok = ok and self._lookahead_inflight == 0
        if ok:
            self._lookahead_inflight += 1
        return ok

    @property
    def demand_queued(self) -> int:
        """Demand reads waiting at the gate now."""
        return self._demand_queued

    def queue_demand(self, delta: int, now: float = 0.0) -> None:
        """A demand read starts (+1) or stops (-1) waiting at the gate."""
        self._demand_queued += delta
        assert self._demand_queued >= 0
        self._demand_changed(now)

    def io_done(self, *, demand: bool, now: float = 0.0) -> None:
        """A read (``demand``) or lookahead piece that passed the gate finished (or was dropped
        after passing it)."""
        if demand:
            self._demand_inflight -= 1
            assert self._demand_inflight >= 0
            self._demand_changed(now)
        else:
            self._lookahead_inflight -= 1
            assert self._lookahead_inflight >= 0

    # ------------------------------------------------------------------ lookahead
    def lookahead(self, layer: int, experts: Sequence[int]) -> list[Key]:
        """A prediction that ``layer`` will route to ``experts`` (most likely first): the keys
        to read ahead, in that order (not resident, not in flight; at most ``LOOKAHEAD_READS``).
        They are marked in flight."""
        if layer not in self.lru or not self.reads_ahead(layer):
            return []
        self._predicted[layer] = set(experts)
        keys: list[Key] = []
        for e in experts:
            key = (layer, e)
            if key in self.pinned or e in self.lru[layer] or key in self.inflight:
                continue
            if key in self.parked:
                continue
            if len(keys) == LOOKAHEAD_READS:
                break
            keys.append(key)
        led = self._ledger[layer]
        if self.prefetch_mode == "auto" and not led.on:
            if not self._probe_reads(layer):  # dry: scored when the layer routes, not read
                self._dry[layer] = {e for _, e in keys}
                self.stats.lookahead_dry_probes += 1
                return []
            led.wet = True
        for key in keys:
            self.inflight.add(key)
            self._la_begun[key] = self._begun.get(layer, 0)
        return keys

    def lookahead_ready(self, key: Key) -> bool | None:
        """Asked before each piece of a lookahead read of ``key``: True when a step now waits
        for it (the rest is a demand read), False to go on as lookahead, None to stop (the
        step of its layer began since the prediction and did not route to it)."""
        if key in self.waiters:
            self._la_begun.pop(key, None)
            return True
        if self._begun.get(key[0], 0) != self._la_begun.get(key, -1):
            return None
        return False

    def drop(self, key: Key, placement: Placement | None = None) -> None:
        """A lookahead read of ``key`` stops: before its first piece (stale, or no spare slot:
        it never happened) or part-way (counted aborted and wasted). ``placement``: the slot
        it had (a transient one is counted back; a cache slot leaves the LRU, and the store
        puts its buffer back on the free list)."""
        if placement is not None:
            if placement.cached:
                self.lru[key[0]].unhold(key[1])
                self.lru[key[0]].discard(key[1])
            else:
                self.release_transient()
        self.inflight.discard(key)
        self._la_begun.pop(key, None)
        self._la_piece.pop(key, None)
        self._la_issued.discard(key)
        if self._la_start.pop(key, None) is None:
            return  # before its first piece: it never happened (and was never counted)
        self.stats.prefetch_aborted += 1
        self._wasted(key)

    # ------------------------------------------------------------------ completions
    def landed(self, key: Key, placement: Placement, *, ok: bool, demand: bool) -> Landing:
        """A read of ``key`` into ``placement`` finished (``ok``: without error; a failed read
        into a cache slot leaves the LRU, and the store gives that slot back). Returns what
        happens next:

        * "deliver": hand the expert to the waiting step (a transient slot stays held by it);
        * "error": hand the error to the waiting step (a transient slot was released);
        * "park": keep the lookahead result in its transient slot until its layer runs;
        * "release": nobody needs it: the transient slot goes back;
        * "keep": nobody waits; a cache slot keeps what it read."""
        layer, e = key
        self.inflight.discard(key)
        lru = self.lru[layer]
        if placement.cached:
            lru.unhold(e)
            if not ok:
                lru.discard(e)
        self._la_start.pop(key, None)
        self._la_begun.pop(key, None)
        self._la_issued.discard(key)
        read_s = self._la_read_s.pop(key, 0.0)  # kept below for a result a step may use later
        step = self.waiters.pop(key, None)
        if step is None and placement.cached and ok and not demand:
            self._lookahead_cached.add(key)
            self._la_read_s[key] = read_s
        if step is None or step.aborted:
            if placement.cached:
                return "keep"
            if ok and step is None and not demand:
                self.parked.add(key)
                self._la_read_s[key] = read_s
                return "park"
            self.release_transient()
            return "release"
        if not ok:
            if not placement.cached:
                self.release_transient()
            return "error"
        return "deliver"

    # ------------------------------------------------------------------ pinned set
    def pin(self, key: Key) -> None:
        self.pinned.add(key)

    def unpin(self, key: Key) -> None:
        self.pinned.discard(key)

    def uncache(self, key: Key) -> bool:
        """Take ``key`` out of its layer's LRU (it moves to the pinned set); True if it was
        there (its cache slot goes back to the free list)."""
        lru = self.lru[key[0]]
        if key[1] not in lru:
            return False
        lru.discard(key[1])
        self._lookahead_cached.discard(key)
        return True

"""The tier policy on its own: no buffers, no reads, no event loop (runtime/policies/tiers.py)."""

from __future__ import annotations

import itertools

import pytest

from runtime.policies import Placement, StepHandle, TierPolicy
from runtime.policies.tiers import LEDGER_STEPS, PROBE_EVERY, PROBE_EVERY_MAX


def _policy(**kw: object) -> TierPolicy:
    args: dict[object, object] = {
        "lru_slots": 2,
        "transient_slots": 4,
        "read_depth": 2,
        "prefetch": "on",
    }
    args.update(kw)
    return TierPolicy([1, 2], **args)  # type: ignore[arg-type]


def _land_all(p: TierPolicy, step: StepHandle, placed: dict[int, Placement]) -> list[str]:
    return [p.landed((step.layer, e), w, ok=True, demand=True) for e, w in placed.items()]


def test_begin_sorts_experts_by_tier_and_counts() -> None:
    p = _policy()
    p.pin((1, 0))
    step = StepHandle(1)
    tiers = p.begin(step, [0, 3, 5])
    assert tiers == [(0, "pinned"), (3, "read"), (5, "read")]
    assert p.stats.hits_pinned == 1 and p.stats.misses == 2
    assert p.inflight == {(1, 3), (1, 5)}
    assert p.waiters == {(1, 3): step, (1, 5): step}
    placed = {e: p.place((1, e), demand=True) for e in (3, 5)}
    assert all(w == Placement(True) for w in placed.values())  # two free cache slots
    assert _land_all(p, step, placed) == ["deliver", "deliver"]  # type: ignore[arg-type]
    p.end(step)
    again = StepHandle(1)
    assert p.begin(again, [3, 5]) == [(3, "lru"), (5, "lru")]
    assert p.stats.hits_lru == 2
    assert p.tiers() == {(1, 0): "pinned", (1, 3): "lru", (1, 5): "lru"}


def test_lru_evicts_its_oldest_unprotected_entry_and_bypasses_when_all_are_in_use() -> None:
    p = _policy()
    for e in (3, 5):  # fill layer 1's two slots
        step = StepHandle(1)
        p.begin(step, [e])
        p.landed((1, e), p.place((1, e), demand=True), ok=True, demand=True)  # type: ignore[arg-type]
        p.end(step)
    step = StepHandle(1)
    p.begin(step, [7])
    where = p.place((1, 7), demand=True)
    assert where == Placement(True, evicted=(1, 3))  # 3 is the least recently used
    assert p.stats.evictions == 1
    p.landed((1, 7), where, ok=True, demand=True)  # type: ignore[arg-type]
    p.end(step)
    # a step routed to 5 and 7 (both cached, protected) and 9: 9 cannot take their slots
    step = StepHandle(1)
    assert p.begin(step, [5, 7, 9]) == [(5, "lru"), (7, "lru"), (9, "read")]
    where = p.place((1, 9), demand=True)
    assert where == Placement(False)
    assert p.stats.bypass == 1 and p.transient_free == 3
    assert p.landed((1, 9), where, ok=True, demand=True) == "deliver"  # type: ignore[arg-type]
    p.release_transient()  # the compute thread is done with it
    p.end(step)
    assert p.transient_free == 4


def test_prefill_admits_only_into_free_slots() -> None:
    p = _policy(lru_slots=1)
    step = StepHandle(1)
    p.begin(step, [0])
    p.landed((1, 0), p.place((1, 0), demand=True), ok=True, demand=True)  # type: ignore[arg-type]
    p.end(step)
    p.prefill = True
    step = StepHandle(1)
    p.begin(step, [1])
    assert p.place((1, 1), demand=True) == Placement(False)  # the decode hot set stays
    assert p.stats.evictions == 0


def test_lookahead_uses_only_the_spare_half_of_the_transient_slots() -> None:
    p = _policy(lru_slots=0)
    keys = p.lookahead(2, [1, 2, 3])  # the two most likely only
    assert keys == [(2, 1), (2, 2)]
    assert p.lookahead(1, [3]) == [(1, 3)]
    assert p.place((2, 1), demand=False) == Placement(False)
    assert p.place((2, 2), demand=False) == Placement(False)
    # issued once a read reaches the device, so that the exported counter only grows (a
    # scrape between the prediction and its drop saw it go down)
    assert p.stats.prefetch_issued == 0
    p.piece_started((2, 1), 0.0)
    p.piece_started((2, 1), 0.1)  # its second piece: still one read
    p.piece_started((2, 2), 0.0)
    assert p.stats.prefetch_issued == 2
    assert p.place((1, 3), demand=False) is None  # two of four left: demand reads keep them
    p.drop((1, 3))
    assert p.stats.prefetch_issued == 2 and (1, 3) not in p.inflight
    assert p.place((2, 4), demand=True) == Placement(False)
    assert p.place((2, 5), demand=True) == Placement(False)
    assert p.place((2, 6), demand=True) is None  # a demand read waits for a slot
    p.release_transient()
    assert p.place((2, 6), demand=True) == Placement(False)


def test_the_gate_puts_demand_reads_first() -> None:
    p = _policy(read_depth=2)
    assert p.try_issue(demand=True)
    assert not p.try_issue(demand=False)  # a demand read is in flight: no lookahead
    assert p.try_issue(demand=True)
    assert not p.try_issue(demand=True)  # read_depth reached
    p.queue_demand(+1)
    p.io_done(demand=True)
    p.io_done(demand=True)
    assert not p.try_issue(demand=False)  # idle, but a demand read is queued
    assert p.try_issue(demand=True)
    p.queue_demand(-1)
    p.io_done(demand=True)
    assert p.try_issue(demand=False)  # an idle device: one lookahead piece ...
    assert not p.try_issue(demand=False)  # ... at a time
    assert p.try_issue(demand=True)  # a demand read never waits behind lookahead
    assert p.try_issue(demand=True)


def test_lookahead_pieces_book_the_time_they_shared_the_device_with_demand_reads() -> None:
    p = _policy()
    (key,) = p.lookahead(2, [9])
    assert p.try_issue(demand=False, now=0.0)
    p.piece_started(key, 0.0)
    p.piece_done(key, 1.0)  # alone on the device: free
    p.io_done(demand=False, now=1.0)
    assert p.stats.lookahead_cost_s == 0.0
    assert p.try_issue(demand=False, now=1.0)
    p.piece_started(key, 1.0)
    assert p.try_issue(demand=True, now=1.5)  # a demand read arrives mid-piece
    p.piece_done(key, 2.0)
    p.io_done(demand=False, now=2.0)
    # 0.5 s beside one demand read: the piece took half the device from it
    assert p.stats.lookahead_cost_s == pytest.approx(0.25)
    assert p.try_issue(demand=False, now=2.0) is False  # (no piece beside a demand read)
    assert p.try_issue(demand=True, now=2.5)  # a second demand read: a piece's share is 1/3
    p.io_done(demand=True, now=3.0)
    p.io_done(demand=True, now=4.0)
    assert p.demand_busy(10.0) == pytest.approx(1.0 / 2 + 0.5 / 3 + 1.0 / 2)


def test_a_lookahead_read_never_evicts_and_its_result_joins_the_cache_when_used() -> None:
    p = _policy(lru_slots=1)
    step = StepHandle(1)
    p.begin(step, [0])
    p.landed((1, 0), p.place((1, 0), demand=True), ok=True, demand=True)  # type: ignore[arg-type]
    p.end(step)  # the layer's one cache slot holds 0
    (key,) = p.lookahead(1, [4])
    assert p.place(key, demand=False) == Placement(False)  # not 0's slot
    assert p.landed(key, Placement(False), ok=True, demand=False) == "park"
    assert p.tiers() == {(1, 0): "lru"}
    step = StepHandle(1)
    assert p.begin(step, [4]) == [(4, "parked")]
    # the step takes it: the cache takes it as it would have taken the step's own read of it
    assert p.adopt(key) == Placement(True, evicted=(1, 0))
    assert p.transient_free == 4
    p.end(step)
    assert p.tiers() == {(1, 4): "lru"}
    assert p.begin(StepHandle(1), [4]) == [(4, "lru")]


def test_a_lookahead_read_stops_once_its_layer_began_without_it() -> None:
    p = _policy(lru_slots=0)
    (k9, k7) = p.lookahead(2, [9, 7])
    assert p.lookahead_ready(k9) is False and p.lookahead_ready(k7) is False
    where = p.place(k9, demand=False)
    assert where == Placement(False)
    p.piece_started(k9, 0.0)
    p.piece_done(k9, 1.0)
    step = StepHandle(2)
    assert p.begin(step, [7]) == [(7, "inflight")]  # the step joins 7; 9 is not routed
    assert p.adoptable(k7) and not p.adoptable(k9)
    assert p.lookahead_ready(k7) is True  # its next piece is a demand read
    assert p.lookahead_ready(k9) is None  # the rest of 9 is not read
    p.drop(k9, where)
    assert p.stats.prefetch_aborted == 1 and p.stats.prefetch_wasted == 1
    assert p.transient_free == 4 and k9 not in p.inflight


def test_a_parked_lookahead_is_used_by_its_step_or_given_back_at_its_end() -> None:
    p = _policy(lru_slots=0)
    (key,) = p.lookahead(1, [4])
    where = p.place(key, demand=False)
    assert where == Placement(False)
    assert p.landed(key, where, ok=True, demand=False) == "park"
    step = StepHandle(1)
    assert p.begin(step, [4]) == [(4, "parked")]
    assert p.stats.prefetch_used == 1
    p.end(step)
    # predicted, parked, and the step routed elsewhere: the slot comes back, counted wasted
    (key,) = p.lookahead(1, [6])
    p.landed(key, p.place(key, demand=False), ok=True, demand=False)  # type: ignore[arg-type]
    step = StepHandle(1)
    p.begin(step, [8])
    assert p.end(step) == [(1, 6)]
    assert p.stats.prefetch_wasted == 1
    assert p.stats.lookahead_routed == 2 and p.stats.lookahead_predicted_hits == 1


def test_a_step_waits_for_a_lookahead_read_in_flight_instead_of_reading_twice() -> None:
    p = _policy()
    (key,) = p.lookahead(2, [9])
    step = StepHandle(2)
    assert p.begin(step, [9]) == [(9, "inflight")]
    assert p.lookahead_ready(key) is True  # it became a demand read
    where = p.place(key, demand=True)
    assert p.landed(key, where, ok=True, demand=True) == "deliver"  # type: ignore[arg-type]


def test_a_stale_lookahead_is_dropped_when_it_reaches_the_device() -> None:
    p = _policy()
    (key,) = p.lookahead(2, [9])
    step = StepHandle(2)
    p.begin(step, [1])
    p.end(step)  # layer 2's step came and went without expert 9
    assert p.lookahead_ready(key) is None
    p.drop(key)
    assert key not in p.inflight and p.stats.prefetch_issued == 0
    assert p.stats.prefetch_aborted == 0  # nothing of it was read


def test_a_failed_read_leaves_the_cache_and_reaches_its_step() -> None:
    p = _policy()
    step = StepHandle(1)
    p.begin(step, [2, 3])
    w2, w3 = p.place((1, 2), demand=True), p.place((1, 3), demand=True)
    assert w2 is not None and w2.cached and w3 is not None and w3.cached
    assert p.landed((1, 2), w2, ok=False, demand=True) == "error"
    assert 2 not in p.lru[1]
    p.end(step)  # the step was cancelled before 3 landed
    assert p.landed((1, 3), w3, ok=False, demand=True) == "keep"
    assert 3 not in p.lru[1] and p.transient_free == 4 and not p.inflight


@pytest.mark.parametrize("ok", [True, False])
def test_a_transient_read_for_an_ended_step_gives_its_slot_back(ok: bool) -> None:
    p = _policy(lru_slots=0)
    step = StepHandle(1)
    p.begin(step, [5])
    where = p.place((1, 5), demand=True)
    assert p.transient_free == 3
    p.end(step)
    assert p.landed((1, 5), where, ok=ok, demand=True) == "release"  # type: ignore[arg-type]
    assert p.transient_free == 4 and not p.parked  # a demand read is never parked


# ----------------------------------------------------------------------------- --prefetch auto
READ_S = 0.01  # fake seconds per read


def _step_with_lookahead(
    p: TierPolicy, layer: int, predicted: list[int], routed: list[int]
) -> None:
    """One step of ``layer`` on a fake clock: the previous layer read ``predicted`` ahead, one
    piece each, with a demand read arriving halfway through each piece, then the step routes to
    ``routed``."""
    now = float(p.stats.experts_read)  # any increasing clock will do
    for key in p.lookahead(layer, predicted):
        assert p.try_issue(demand=False, now=now)
        where = p.place(key, demand=False)
        assert where is not None
        p.piece_started(key, now)
        assert p.try_issue(demand=True, now=now + READ_S / 2)  # it shares the device
        p.piece_done(key, now + READ_S)
        p.io_done(demand=False, now=now + READ_S)
        p.io_done(demand=True, now=now + READ_S)
        p.landed(key, where, ok=True, demand=False)
    step = StepHandle(layer)
    for e, tier in p.begin(step, routed, now=now + 2 * READ_S):
        if tier == "parked" and p.adopt((layer, e)) is None:
            p.release_transient()  # no cache slot: given back once computed
        if tier == "read":
            w = p.place((layer, e), demand=True)
            assert w is not None
            assert p.landed((layer, e), w, ok=True, demand=True) == "deliver"  # type: ignore[arg-type]
            if not w.cached:
                p.release_transient()
    p.stats.experts_read += 1
    p.end(step)


def test_auto_starts_off_and_reads_ahead_only_on_probe_steps_while_it_loses() -> None:
    p = _policy(lru_slots=0, transient_slots=8, prefetch="auto")
    assert not p.reads_ahead(1)  # a layer starts off: lookahead must prove itself
    probes = []
    for i in range(6 * PROBE_EVERY_MAX):  # predictions never routed: pure cost
        if p.reads_ahead(1):
            probes.append(i)
        _step_with_lookahead(p, 1, [1, 2], [5, 6])
    st = p.stats
    # the first probe after PROBE_EVERY steps, a dry one on the step before each; each probe
    # that lost (here: stayed dry, its dry probe's guess not routed) doubles the interval
    wet_steps = [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 32 - 1, 64 - 1, 128 - 1]
    assert probes[:10] == [i for w in wet_steps for i in (w - 1, w)]
    assert [b - a for a, b in itertools.pairwise(probes[1::2])][-2:] == [PROBE_EVERY_MAX] * 2
    # guesses that a dry probe showed unused are never read: no disk time lost to them
    assert st.prefetch_issued == 0 and st.lookahead_cost_s == 0.0
    assert st.lookahead_dry_probes == len(probes)
    assert st.lookahead_saved_s == 0.0 and st.lookahead_layers_off == 1
    # routing turns predictable: the next dry probe (at most PROBE_EVERY_MAX steps away) is
    # promising, so the probe after it reads, pays, the layer reads ahead again, and its
    # probes would start over at PROBE_EVERY
    for _ in range(PROBE_EVERY_MAX):
        _step_with_lookahead(p, 1, [3, 4], [3, 4])
    assert p.reads_ahead(1) and st.lookahead_layers_off == 0
    assert p._ledger[1].probe_every == PROBE_EVERY


def test_a_probe_reads_only_after_a_dry_probe_whose_guess_was_routed() -> None:
    """The step before a probe predicts without reading (dry); the probe reads only when the
    dry probe's would-be reads were all routed; otherwise it stays dry too. A wet probe that
    loses still costs its reads and turns nothing on."""
    p = _policy(lru_slots=0, transient_slots=8, prefetch="auto")
    for i in range(PROBE_EVERY - 1):  # the dry probe's guess is routed
        routed = [1, 2] if i == PROBE_EVERY - 2 else [5, 6]
        _step_with_lookahead(p, 1, [1, 2], routed)
    assert p.stats.lookahead_dry_probes == 1 and p.stats.prefetch_issued == 0
    _step_with_lookahead(p, 1, [3, 4], [5, 6])  # the probe reads; its guess is not routed
    st = p.stats
    assert st.prefetch_issued == 2 and st.prefetch_wasted == 2 and st.lookahead_cost_s > 0
    assert st.lookahead_layers_off == 1 and p._ledger[1].probe_every == 2 * PROBE_EVERY
    # the next dry probe's guess is routed only in part: its probe stays dry
    for i in range(2 * PROBE_EVERY):
        routed = [1, 5] if i == 2 * PROBE_EVERY - 2 else [5, 6]
        _step_with_lookahead(p, 1, [1, 2], routed)
    assert st.prefetch_issued == 2 and st.lookahead_dry_probes == 3


def test_auto_turns_lookahead_on_when_it_pays_and_off_again_when_it_stops() -> None:
    p = _policy(lru_slots=0, transient_slots=8, prefetch="auto")
    for _ in range(PROBE_EVERY):  # the first probe's reads are all used
        _step_with_lookahead(p, 1, [3, 4], [3, 4])
    assert p.reads_ahead(1) and p.stats.lookahead_layers_off == 0
    assert p.stats.lookahead_saved_s > 0
    used = p.stats.prefetch_used
    for _ in range(2 * LEDGER_STEPS):
        _step_with_lookahead(p, 1, [3, 4], [3, 4])
    assert p.stats.prefetch_used == used + 4 * LEDGER_STEPS  # every step reads ahead now
    # routing turns unpredictable: the ledger goes negative and the layer stops reading ahead
    for _ in range(4 * LEDGER_STEPS):
        _step_with_lookahead(p, 1, [1, 2], [5, 6])
        if not p.reads_ahead(1):
            break
    assert not p.reads_ahead(1) and p.stats.lookahead_layers_off == 1
    assert p.stats.lookahead_cost_s > 0
    # and predictable again: the probes bring it back
    for _ in range(8 * PROBE_EVERY):
        _step_with_lookahead(p, 1, [3, 4], [3, 4])
        if p.stats.lookahead_layers_off == 0:
            break
    assert p.reads_ahead(1) and p.stats.lookahead_layers_off == 0


@pytest.mark.parametrize("mode", ["on", "off"])
def test_forced_modes_ignore_the_ledger(mode: str) -> None:
    p = _policy(lru_slots=0, transient_slots=8, prefetch=mode)
    for _ in range(3 * LEDGER_STEPS):
        _step_with_lookahead(p, 1, [1, 2], [5, 6])
    assert p.reads_ahead(1) is (mode == "on")
    assert p.stats.lookahead_layers_off == 0
    assert p.stats.prefetch_issued == (6 * LEDGER_STEPS if mode == "on" else 0)


def test_auto_charges_the_compute_a_prediction_takes() -> None:
    """On a compute-bound model a right prediction saves little disk time; the router and hop
    it took are charged too, so a layer whose lookahead saves less than it costs stays off."""
    p = _policy(lru_slots=0, transient_slots=8, prefetch="auto")
    n = 0
    for _ in range(4 * PROBE_EVERY):
        if p.reads_ahead(1):  # a probe (dry or wet): its prediction took compute time
            p.charge(1, 2 * READ_S)
            n += 1
        _step_with_lookahead(p, 1, [3, 4], [3, 4])  # used: saves 2 x READ_S per wet probe
    st = p.stats
    assert n == 6  # (dry 6, 14, 30, wet 7, 15, 31: each probe lost, the next came later)
    wet = n // 2
    assert st.prefetch_used == 2 * wet
    assert st.lookahead_saved_s == pytest.approx(2 * wet * READ_S)
    assert st.lookahead_cpu_s == pytest.approx(n * 2 * READ_S)
    assert not p.reads_ahead(1) and st.lookahead_layers_off == 1
    p.charge(7, 1.0)  # not a MoE layer: ignored
    assert st.lookahead_cpu_s == pytest.approx(n * 2 * READ_S)

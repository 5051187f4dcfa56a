"""The expert store on its own (runtime/experts.py): the loop-side I/O that runs the tier policy,
driven against a FakeReader (scripted delays on a fake clock, injected errors, stalled reads)
and the compute-thread facade, without a model."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest
from _demo import TINY
from fake_reader import FakeReader, Rule

from runtime.experts import (
    ExpertStore,
    StoreLayout,
    StreamingExperts,
    layer_slot_sizes,
    plan_layout,
    slot_sizes,
)
from runtime.weights import ExpertWeights, ResidentExperts
from storage.container import Container
from storage.errors import ReadError
from storage.multidisk.identity import ModelCopy
from storage.multidisk.placement import Placement

C = Container.open(TINY)
LAYERS = C.expert_layers()
TOP_K = C.arch.top_k
ALL = list(range(C.arch.n_routed_experts))


def _digest(w: ExpertWeights) -> str:
    h = hashlib.sha256()
    for lin in (w.gate, w.up, w.down):
        h.update(np.ascontiguousarray(lin.q.data).tobytes())
        if lin.q.scales is not None:
            h.update(lin.q.scales.tobytes())
    return h.hexdigest()


RESIDENT = ResidentExperts(C)
WANT = {(layer, e): _digest(RESIDENT.get(layer, [e])[e]) for layer in LAYERS for e in ALL}


def _layout(
    lru: int = 2, transient: int = 2 * TOP_K, pinned: tuple[tuple[int, int], ...] = ()
) -> StoreLayout:
    """Cache slots sized per layer (TINY's MTP experts are int8, twice a main int4 one: its
    main layers' cache slots are too small to serve as transient slots), as plan_layout sizes
    them."""
    blob, scales = slot_sizes(C)
    per = tuple((layer, b, s) for layer, (b, s) in sorted(layer_slot_sizes(C).items()))
    return StoreLayout(pinned, lru, len(LAYERS), transient, blob + max(scales, 4096), per)


Body = Callable[[ExpertStore, StreamingExperts], Awaitable[None]]


def _run(
    reader: FakeReader,
    body: Body,
    *,
    prefetch: bool = False,
    read_piece: int | None = None,
    early_reads: bool = True,
    store_layout: StoreLayout | None = None,
    **layout: int,
) -> None:
    """``body`` against a started store (``store_layout``, else ``_layout(**layout)``)."""

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            opts: dict[str, Any] = {"early_reads": early_reads}
            if read_piece is not None:
                opts["read_piece"] = read_piece
            lay = store_layout if store_layout is not None else _layout(**layout)
            store = ExpertStore(C, reader, lay, prefetch=prefetch, clock=reader.clock, **opts)
            await store.start(tg)
            try:
                await body(store, StreamingExperts(store))
            finally:
                tg.cancel_scope.cancel()

    anyio.run(main)


async def _reads_landed(store: ExpertStore) -> None:
    """Until no read is in flight (lookahead reads parked, a failed step's others landed)."""
    with anyio.fail_after(10):
        while store._inflight:
            await anyio.sleep(0.001)


async def _step(src: StreamingExperts, layer: int, experts: list[int]) -> dict[int, str]:
    """One layer's step on a worker thread, as the model runs it: digest each arrival."""

    def consume() -> dict[int, str]:
        return {e: _digest(w) for e, w in src.arrivals(layer, experts)}

    return await anyio.to_thread.run_sync(consume)


async def _step_while(
    src: StreamingExperts,
    layer: int,
    experts: list[int],
    gate: anyio.Event,
    meanwhile: Callable[[], Awaitable[None]],
) -> dict[int, str]:
    """:func:`_step` with a read stalled until ``gate`` is set: ``meanwhile()`` runs while the
    step waits, then the gate opens (also when ``meanwhile`` fails: nothing hangs)."""
    out: dict[str, dict[int, str]] = {}
    async with anyio.create_task_group() as tg:

        async def step() -> None:
            out["got"] = await _step(src, layer, experts)

        tg.start_soon(step)
        try:
            await meanwhile()
        finally:
            gate.set()
    return out["got"]


def _settled(store: ExpertStore) -> None:
    """Nothing in flight, held or parked; every transient slot is back, and still holds any
    layer's expert (slots handed between the cache and the transient ones kept their sizes)."""
    assert not store._inflight
    assert not store._held
    assert not store._prefetched
    assert len(store._transient_free) == store.layout.transient_slots
    assert all(store._fits(slot, None) for slot in store._transient_free)
    for key, slot in store._cached.items():
        assert store._fits(slot, key[0])
    assert store.policy.transient_free == store.layout.transient_slots


def test_every_arrival_is_the_experts_bytes_and_reads_respect_the_depth() -> None:
    reader = FakeReader()
    reader.rules.append(Rule(delay=0.01))

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        for rnd in range(3):
            for layer in LAYERS:
                experts = sorted({(rnd + 3 * i) % len(ALL) for i in range(6)})
                got = await _step(src, layer, experts)
                assert got == {e: WANT[(layer, e)] for e in experts}
        _settled(store)
        st = store.stats
        assert st.hits_lru > 0 and st.misses > 0 and st.bypass > 0  # every path ran
        assert reader.peak <= store.policy.read_depth
        assert st.experts_read == len(reader.extents)
        # one read at a time: the fake clock moves only inside reads, so the read wait is
        # exactly the reads' delays
        before, n = st.read_wait_s, st.experts_read
        for e in (11, 12, 13):
            await _step(src, LAYERS[0], [e])
        assert st.read_wait_s - before == pytest.approx(0.01 * (st.experts_read - n))

    _run(reader, body)


def test_a_read_error_reaches_the_step_and_returns_every_slot() -> None:
    layer = LAYERS[0]
    bad = C.expert(layer, 5).start
    reader = FakeReader(rules=[Rule(offset=bad, error=True, times=1)])

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        with pytest.raises(ReadError, match="injected"):
            await _step(src, layer, [1, 5, 9])
        await _reads_landed(store)  # the step's other reads still land
        _settled(store)
        assert 5 not in store.policy.lru[layer]  # a failed read is not cached
        assert store.stats.read_errors == 1
        # the next step reads it again (the error was transient) and gets the right bytes
        assert await _step(src, layer, [5]) == {5: WANT[(layer, 5)]}

    _run(reader, body)


def test_a_step_ended_with_reads_stalled_gives_everything_back() -> None:
    layer = LAYERS[1]
    gate = anyio.Event()
    fast = C.expert(layer, 0).start
    reader = FakeReader(rules=[Rule(offset=fast), Rule(release=gate)])

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        def first_then_fail() -> int:
            # the model's computation of the first arrival fails: the step ends early
            for e, _ in src.arrivals(layer, [0, 2, 4, 6, 8]):
                return e
            raise AssertionError("no arrival")

        assert await anyio.to_thread.run_sync(first_then_fail) == 0
        assert store._inflight  # the stalled reads are still on the device
        reader.rules.clear()
        gate.set()  # they land with nobody waiting: their slots come back
        await _reads_landed(store)
        _settled(store)
        assert await _step(src, layer, [0, 2]) == {e: WANT[(layer, e)] for e in (0, 2)}

    _run(reader, body, lru=0)


def test_lookahead_reads_land_parked_and_serve_the_next_step() -> None:
    layer = LAYERS[2]
    reader = FakeReader()

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        await anyio.to_thread.run_sync(lambda: src.prefetch(layer, [1, 3]))
        await _reads_landed(store)
        assert set(store._prefetched) == {(layer, 1), (layer, 3)}
        reads = len(reader.extents)
        assert await _step(src, layer, [1, 3, 7]) == {e: WANT[(layer, e)] for e in (1, 3, 7)}
        assert len(reader.extents) == reads + 1  # only 7 was read on demand
        st = store.stats
        assert st.prefetch_used == 2 and st.lookahead_predicted_hits == 2
        _settled(store)

    _run(reader, body, prefetch=True, lru=0)


def test_slots_are_sized_per_layer_and_add_up_to_the_layout() -> None:
    """A main layer's cache slots hold its int4 experts, not the MTP layer's int8 ones (twice
    as big): the same budget caches more experts; transient slots hold any layer's."""
    mtp = LAYERS[-1]
    assert mtp >= C.arch.num_hidden_layers
    sizes = layer_slot_sizes(C)
    main = sizes[LAYERS[0]][0] + max(sizes[LAYERS[0]][1], 4096)
    big = sizes[mtp][0] + max(sizes[mtp][1], 4096)
    assert big > main
    full = plan_layout(C, None, top_k=TOP_K)
    pins = main + big  # the two pinned experts below
    budget = full.transient_slots * full.slot_bytes + pins + 3 * (main * (len(LAYERS) - 1) + big)
    layout = plan_layout(C, budget, top_k=TOP_K, pinned=[(LAYERS[0], 0), (mtp, 1)])
    assert layout.lru_slots_per_layer == 3 and layout.pinned == ((LAYERS[0], 0), (mtp, 1))
    assert layout.layer_slot_bytes(LAYERS[0]) == main and layout.layer_slot_bytes(mtp) == big
    # one slot for every layer at the transient size would have left room for fewer
    left = budget - (full.transient_slots + 2) * full.slot_bytes
    uniform = left // (len(LAYERS) * full.slot_bytes)
    assert uniform < 3

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        assert store.nbytes == layout.nbytes <= budget
        for layer, free in store._free_cache.items():
            assert all(x.nbytes == layout.layer_slot_bytes(layer) for x in free)
        assert {k: x.nbytes for k, x in store._pinned.items()} == {
            (LAYERS[0], 0): main,
            (mtp, 1): big,
        }
        assert all(x.nbytes == full.slot_bytes for x in store._transient_free)

    _run(FakeReader(), body, store_layout=layout)


def test_a_lookahead_result_adopted_by_a_smaller_cache_slot_is_copied_there() -> None:
    """The cache takes a parked lookahead result as it would have taken the step's own read;
    a main layer's cache slot is too small to become a transient slot, so the expert is
    copied into it and its transient slot goes back: later reads into that transient slot
    leave the cached copy as it was."""
    layer = LAYERS[1]
    reader = FakeReader()

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        await anyio.to_thread.run_sync(lambda: src.prefetch(layer, [1, 3]))
        await _reads_landed(store)
        assert await _step(src, layer, [1, 3]) == {e: WANT[(layer, e)] for e in (1, 3)}
        assert store.tiers() == {(layer, 1): "lru", (layer, 3): "lru"}
        _settled(store)
        # other experts through every transient slot (overwriting what the lookahead read)
        for e in (8, 9, 10, 11):
            got = await _step(src, LAYERS[0], [e, e + 4])
            assert got == {x: WANT[(LAYERS[0], x)] for x in (e, e + 4)}
        n = len(reader.extents)
        assert await _step(src, layer, [1, 3]) == {e: WANT[(layer, e)] for e in (1, 3)}
        assert len(reader.extents) == n  # served from the cache copies
        _settled(store)

    _run(reader, body, prefetch=True, lru=2)


def test_repin_swaps_pins_among_layers_of_one_slot_size() -> None:
    """Live re-pin reuses the cold pin's slot, which is sized for its layer: the hottest
    outsider overall (an MTP expert) takes the MTP pin's slot, not the colder main pin's
    (too small for it), and a hot main expert takes the main pin's."""
    mtp = LAYERS[-1]
    main_layer = LAYERS[0]

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        counts = np.zeros((C.arch.total_layers, len(ALL)), np.int64)
        counts[mtp, 5] = 1000  # hot MTP expert: only the MTP pin's slot fits it
        counts[main_layer, 7] = 900
        assert await store.repin(counts) == 2
        assert set(store._pinned) == {(main_layer, 7), (mtp, 5)}
        for key, slot in store._pinned.items():
            assert store._fits(slot, key[0])
        for layer, e in list(store._pinned):
            assert await _step(src, layer, [e]) == {e: WANT[(layer, e)]}

    _run(FakeReader(), body, store_layout=_layout(pinned=((main_layer, 0), (mtp, 0))))


def test_a_demand_miss_waits_for_the_lookahead_read_already_in_flight() -> None:
    layer = LAYERS[3]
    gate = anyio.Event()
    reader = FakeReader(rules=[Rule(offset=C.expert(layer, 4).start, release=gate)])

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        await anyio.to_thread.run_sync(lambda: src.prefetch(layer, [4]))
        await anyio.sleep(0.01)  # the lookahead read is on the device (stalled)
        got = await _step_while(src, layer, [4], gate, lambda: anyio.sleep(0.05))
        assert got == {4: WANT[(layer, 4)]}
        offsets = [off for _, off in reader.extents]
        assert offsets.count(C.expert(layer, 4).start) == 1  # read once, not twice
        st = store.stats
        assert st.prefetch_used == 1
        # the wait is booked as waiting on a lookahead read, not as a demand miss
        assert st.read_wait_lookahead_s >= 0.04 and st.read_wait_demand_s == 0.0
        assert st.compute_stall_s == st.read_wait_lookahead_s
        _settled(store)

    _run(reader, body, prefetch=True)


PIECE = 8192  # lookahead pieces this small split a TINY expert blob into several


def _pieces_of(layer: int, e: int) -> list[int]:
    x = C.expert(layer, e)
    aligned = x.start - x.start % 4096
    return list(range(aligned, x.start + (x.end - x.start), PIECE))


def test_a_lookahead_read_stops_part_way_once_its_layer_routed_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("runtime.experts.LOOKAHEAD_PIECE", PIECE)
    layer = LAYERS[1]
    offsets = _pieces_of(layer, 4)
    assert len(offsets) >= 3
    gate = anyio.Event()
    reader = FakeReader(rules=[Rule(offset=offsets[1], release=gate)])

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        await anyio.to_thread.run_sync(lambda: src.prefetch(layer, [4]))
        await anyio.sleep(0.01)  # its second piece is on the device (stalled)
        # the layer's step routes elsewhere: its demand read does not wait for the piece
        assert await _step(src, layer, [7]) == {7: WANT[(layer, 7)]}
        gate.set()
        await _reads_landed(store)
        read = [off for _, off in reader.extents]
        assert read.count(offsets[0]) == read.count(offsets[1]) == 1
        assert not set(offsets[2:]) & set(read)  # the rest was never read
        st = store.stats
        assert st.prefetch_aborted == 1 and st.prefetch_wasted == 1 and st.prefetch_used == 0
        assert st.prefetch_wasted_bytes == 2 * PIECE  # what its two pieces read
        assert (layer, 4) not in store.tiers()
        _settled(store)

    _run(reader, body, prefetch=True, lru=2)


def test_a_step_takes_over_a_lookahead_read_waiting_for_its_next_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookahead read between two pieces waits while a demand read holds the device; once a
    step routes to it, its rest goes at once as a demand read, not after that demand read."""
    monkeypatch.setattr("runtime.experts.LOOKAHEAD_PIECE", PIECE)
    layer, other = LAYERS[2], LAYERS[1]
    offsets = _pieces_of(layer, 5)
    piece_gate, busy = anyio.Event(), anyio.Event()
    reader = FakeReader(
        rules=[
            Rule(offset=offsets[1], release=piece_gate),
            Rule(offset=C.expert(other, 7).start, release=busy),
        ]
    )

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        await anyio.to_thread.run_sync(lambda: src.prefetch(layer, [5]))
        await anyio.sleep(0.01)  # its second piece is on the device (stalled)
        out: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:

            async def other_step() -> None:
                out["other"] = await _step(src, other, [7])

            tg.start_soon(other_step)  # its demand read holds the device (stalled)
            await anyio.sleep(0.01)
            piece_gate.set()  # the piece lands; the next one may not go beside a demand read
            await anyio.sleep(0.01)
            assert store.stats.prefetch_issued == 1 and (layer, 5) in store._inflight

            def consume() -> dict[int, str]:
                return {e: _digest(w) for e, w in src.arrivals(layer, [5])}

            try:
                with anyio.fail_after(5):  # (it would wait for the other read to land)
                    got = await anyio.to_thread.run_sync(consume, abandon_on_cancel=True)
            finally:
                other_still_reading = "other" not in out
                busy.set()
        assert other_still_reading
        assert got == {5: WANT[(layer, 5)]} and out["other"] == {7: WANT[(other, 7)]}
        read = [off for _, off in reader.extents]
        assert read.count(offsets[0]) == read.count(offsets[1]) == 1
        assert offsets[2] in read and not set(offsets[3:]) & set(read)  # the rest: one request
        assert store.stats.prefetch_used == 1
        _settled(store)

    _run(reader, body, prefetch=True, lru=2)


def test_a_joined_lookahead_read_reads_the_rest_at_once_and_joins_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("runtime.experts.LOOKAHEAD_PIECE", PIECE)
    layer = LAYERS[2]
    offsets = _pieces_of(layer, 5)
    gate = anyio.Event()
    reader = FakeReader(rules=[Rule(offset=offsets[1], release=gate)])

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        await anyio.to_thread.run_sync(lambda: src.prefetch(layer, [5]))
        await anyio.sleep(0.01)
        got = await _step_while(src, layer, [5], gate, lambda: anyio.sleep(0.02))
        assert got == {5: WANT[(layer, 5)]}
        read = [off for _, off in reader.extents]
        # two pieces as lookahead, then the rest in one request once the step waited for it
        assert read.count(offsets[0]) == read.count(offsets[1]) == 1
        assert offsets[2] in read and not set(offsets[3:]) & set(read)
        # the cache took it as it would have taken the step's own read: no read the next time
        assert store.tiers()[(layer, 5)] == "lru"
        n = len(reader.extents)
        assert await _step(src, layer, [5]) == {5: WANT[(layer, 5)]}
        assert len(reader.extents) == n and store.stats.prefetch_used == 1
        _settled(store)

    _run(reader, body, prefetch=True, lru=2)


# Demand reads in pieces (runtime/policies/pieces.py): the tiny model's experts are 36 KiB
# (down, gate, up: 12 KiB each), read here in pieces of PIECE bytes too.


def _demand_pieces(layer: int, e: int) -> list[int]:
    """The file offsets expert ``e``'s blob pieces start at, in the order they should go."""
    x = C.expert(layer, e)
    lo = min(x.parts[p][0] for p in ("gate_proj", "up_proj"))
    rel = list(range(lo, x.nbytes, PIECE)) + list(range(0, lo, PIECE))
    return [x.start + r for r in rel]


def test_a_demand_read_goes_in_pieces_gate_and_up_first_and_lands_whole() -> None:
    layer = LAYERS[0]
    reader = FakeReader()

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        reads = store.stats.reads
        assert await _step(src, layer, [5]) == {5: WANT[(layer, 5)]}
        assert [off for _, off in reader.extents] == _demand_pieces(layer, 5)
        assert len(_demand_pieces(layer, 5)) > 2
        # every request counted: the pieces, plus the scales (one request, with the first)
        assert store.stats.reads - reads == len(reader.extents) + 1
        assert store.stats.experts_read == 1
        # a step of several misses: all in order, within the window, every byte right
        experts = [1, 2, 3, 4, 6, 7]
        assert await _step(src, layer, experts) == {e: WANT[(layer, e)] for e in experts}
        assert reader.peak_bytes <= store._window.window
        assert store._window.inflight_bytes == 0 and store._window.queued == 0
        _settled(store)

    _run(reader, body, read_piece=PIECE, lru=0)


@pytest.mark.parametrize("piece", [None, PIECE])
def test_the_last_read_of_a_step_waits_for_the_one_before_it(piece: int | None) -> None:
    """Two misses, nothing else waiting: the second goes once the first landed, so the first is
    computed while the second reads (two reads on the device together land together); whole
    reads (the default) or in pieces."""
    layer = LAYERS[1]
    gate = anyio.Event()

    def offsets(e: int) -> list[int]:
        return _demand_pieces(layer, e) if piece else [C.expert(layer, e).start]

    first = offsets(2)
    reader = FakeReader(rules=[Rule(offset=first[0], release=gate)])

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        async def meanwhile() -> None:
            with anyio.fail_after(10):
                while not reader.in_flight:
                    await anyio.sleep(0.001)
            await anyio.sleep(0.02)
            sent = {off for _, off in reader.extents} | {first[0]}
            assert not sent & set(offsets(6))  # 6 waits for all of 2

        got = await _step_while(src, layer, [2, 6], gate, meanwhile)
        assert got == {e: WANT[(layer, e)] for e in (2, 6)}
        read = [off for _, off in reader.extents]
        n = len(first)  # (extents are recorded as reads complete: 2's first piece came last)
        assert sorted(read[:n]) == sorted(first) and read[n:] == offsets(6)  # 2, then 6
        _settled(store)

    _run(reader, body, read_piece=piece, lru=0)


def test_a_landing_sends_the_read_it_let_go_before_building_its_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second of two misses goes once the first landed; it goes to the device before the
    first expert's weights are built (Python the disk would otherwise idle through), and the
    count of granted-but-unsent reads comes back to zero."""
    import runtime.experts as experts_mod

    layer = LAYERS[1]
    reader = FakeReader()
    built: list[tuple[int, int]] = []
    real = experts_mod._weights_from

    def recording(x: Any, *args: Any) -> ExpertWeights:
        built.append((x.expert, reader.in_flight))
        return real(x, *args)

    monkeypatch.setattr(experts_mod, "_weights_from", recording)

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        got = await _step(src, layer, [2, 6])
        assert got == {e: WANT[(layer, e)] for e in (2, 6)}
        assert built == [(2, 1), (6, 0)]  # 6 on the device while 2's weights were built
        assert store._unsent == 0
        _settled(store)

    _run(reader, body, lru=0)


def test_a_failed_piece_fails_its_read_after_the_others_and_returns_every_slot() -> None:
    layer = LAYERS[2]
    bad = _demand_pieces(layer, 5)[2]
    reader = FakeReader(rules=[Rule(offset=bad, error=True, times=1)])

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        with pytest.raises(ReadError, match="injected"):
            await _step(src, layer, [1, 5, 9])
        await _reads_landed(store)
        _settled(store)
        assert store._window.inflight_bytes == 0 and store._window.queued == 0
        assert store.stats.read_errors == 1
        assert await _step(src, layer, [5]) == {5: WANT[(layer, 5)]}

    _run(reader, body, read_piece=PIECE, lru=0)


def test_with_a_mirror_the_last_read_does_not_wait(tmp_path: Path) -> None:
    """Two reads may be on two devices when mirrors serve reads: the last one goes at once."""
    layer = LAYERS[1]
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    shards = sorted({C.expert(layer, e).path for e in ALL})
    for f in shards:
        shutil.copyfile(f, mirror / f.name)
    copies = [
        ModelCopy(0, TINY, None, {f: f for f in shards}),
        ModelCopy(1, mirror, None, {f: mirror / f.name for f in shards}),
    ]
    gate = anyio.Event()
    reader = FakeReader(rules=[Rule(offset=C.expert(layer, 2).start, release=gate)])

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        store.placement = Placement(copies, adapt=False)

        async def meanwhile() -> None:
            with anyio.fail_after(10):  # 6 is read while 2 is still on its device
                while C.expert(layer, 6).start not in {o for _, o in reader.extents}:
                    await anyio.sleep(0.001)

        got = await _step_while(src, layer, [2, 6], gate, meanwhile)
        assert got == {e: WANT[(layer, e)] for e in (2, 6)}
        _settled(store)

    _run(reader, body, lru=0)


# ---------------------------------------------------------------------- early arrivals
def _gate_up_digest(w: ExpertWeights) -> str:
    h = hashlib.sha256()
    for lin in (w.gate, w.up):
        h.update(np.ascontiguousarray(lin.q.data).tobytes())
        assert lin.q.scales is not None
        h.update(lin.q.scales.tobytes())
    return h.hexdigest()


GATE_UP = {k: _gate_up_digest(RESIDENT.get(k[0], [k[1]])[k[1]]) for k in WANT}


def _stage_offsets(layer: int, e: int) -> tuple[int, int]:
    """Where expert ``e``'s two stages start in its file: its gate projection's block (the
    TINY layout is down, gate, up), then its blob's start (down)."""
    x = C.expert(layer, e)
    assert x.parts["down_proj"][0] == 0 and x.start % 4096 == 0
    return x.start + x.parts["gate_proj"][0], x.start


class _Early:
    """A consumer that takes early arrivals, as ``ExpertCompute`` does: ``early`` notes what
    it saw (the gate and up bytes, whether the down stage had landed) and returns what
    finishes the expert from the same weights once it landed whole."""

    def __init__(self, reader: FakeReader) -> None:
        self.reader = reader
        self.seen: list[tuple[int, str, bool]] = []
        self.called = threading.Event()

    def early(self, layer: int) -> Callable[[int, ExpertWeights], Callable[[], str]]:
        def start(e: int, w: ExpertWeights) -> Callable[[], str]:
            down_landed = _stage_offsets(layer, e)[1] in {o for _, o in self.reader.extents}
            self.seen.append((e, _gate_up_digest(w), down_landed))
            self.called.set()
            return lambda: _digest(w)  # the partial weights, now whole

        return start


async def _map_step(
    src: StreamingExperts,
    layer: int,
    experts: list[int],
    early: Callable[[int, ExpertWeights], Callable[[], str]] | None,
    pool: ThreadPoolExecutor | None = None,
    digested: Callable[[int], None] | None = None,
) -> dict[int, str]:
    """One layer's step on the pool path (``map_arrivals``, one worker), digesting each
    expert (``digested(e)`` once it was)."""

    def digest(e: int, w: ExpertWeights) -> str:
        out = _digest(w)
        if digested is not None:
            digested(e)
        return out

    def consume() -> dict[int, str]:
        with ThreadPoolExecutor(1) if pool is None else contextlib.nullcontext(pool) as p:
            return src.map_arrivals(layer, experts, digest, p, early=early)

    return await anyio.to_thread.run_sync(consume)


def test_a_read_alone_hands_over_gate_and_up_before_down_lands() -> None:
    """One miss: read in two stages (gate and up with the scales, then down); the consumer's
    ``early`` runs while the down stage is held back, and what it returns finishes the expert
    from the same buffer, whole."""
    layer = LAYERS[0]
    first, second = _stage_offsets(layer, 5)
    gate = anyio.Event()
    reader = FakeReader(rules=[Rule(offset=second, release=gate)])
    con = _Early(reader)

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        out: dict[str, dict[int, str]] = {}

        async def step() -> None:
            out["got"] = await _map_step(src, layer, [5], con.early(layer))

        async with anyio.create_task_group() as tg:
            tg.start_soon(step)
            try:
                with anyio.fail_after(10):
                    while not con.called.is_set():
                        await anyio.sleep(0.001)
                assert reader.in_flight == 1  # the down stage, held
            finally:
                gate.set()
        assert out["got"] == {5: WANT[(layer, 5)]}
        assert con.seen == [(5, GATE_UP[(layer, 5)], False)]
        assert [o for _, o in reader.extents] == [first, second]
        assert store.stats.early_arrivals == 1 and store.stats.experts_read == 1
        assert store.stats.reads == 5  # gate, up and the scales; then down in two
        _settled(store)

    _run(reader, body, lru=0)


@pytest.mark.parametrize("mode", ["early", "no consumer", "store off"])
def test_only_a_read_alone_goes_in_two_stages(mode: str) -> None:
    """Two misses: the first goes whole (the second waits behind it), the second, alone on the
    device, in two stages; with a consumer that takes no early arrivals, or a store told not
    to (``early_reads=False``), both go whole. The bytes are the same every way. (The second's
    first stage is held until the first expert's computation is done: only an expert that is
    the last with nothing else computing is begun early.)"""
    layer = LAYERS[1]
    gate = anyio.Event()
    six = _stage_offsets(layer, 6)[0] if mode == "early" else C.expert(layer, 6).start
    reader = FakeReader(rules=[Rule(offset=six, release=gate)])
    con = _Early(reader)

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        early = None if mode == "no consumer" else con.early(layer)
        out: dict[str, dict[int, str]] = {}
        two_done = threading.Event()
        with ThreadPoolExecutor(1) as pool:

            async def step() -> None:
                out["got"] = await _map_step(
                    src, layer, [2, 6], early, pool, lambda e: e == 2 and two_done.set()
                )

            async with anyio.create_task_group() as tg:
                tg.start_soon(step)
                try:
                    with anyio.fail_after(10):
                        while not reader.in_flight or len(reader.extents) < 1:
                            await anyio.sleep(0.001)
                        # 2 landed and was computed (not just landed: the compute thread may
                        # not have handed it to the worker yet); once the worker takes the
                        # next job, the computation's end was handed back too
                        await anyio.to_thread.run_sync(two_done.wait, abandon_on_cancel=True)
                    await anyio.to_thread.run_sync(pool.submit(lambda: None).result)
                finally:
                    gate.set()
        got = out["got"]
        assert got == {e: WANT[(layer, e)] for e in (2, 6)}
        read = [o for _, o in reader.extents]
        if mode == "early":
            assert read == [C.expert(layer, 2).start, *_stage_offsets(layer, 6)]
            # (its down stage is not held here: it may have landed by then)
            assert [seen[:2] for seen in con.seen] == [(6, GATE_UP[(layer, 6)])]
            assert store.stats.early_arrivals == 1
        else:
            assert read == [C.expert(layer, e).start for e in (2, 6)]
            assert not con.seen and store.stats.early_arrivals == 0
        _settled(store)

    _run(reader, body, lru=0, early_reads=mode != "store off")


def test_a_failed_down_stage_fails_the_step_and_returns_every_slot() -> None:
    layer = LAYERS[2]
    reader = FakeReader(rules=[Rule(offset=_stage_offsets(layer, 5)[1], error=True, times=1)])
    con = _Early(reader)

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        with pytest.raises(ReadError, match="injected"):
            await _map_step(src, layer, [5], con.early(layer))
        assert [e for e, _, _ in con.seen] == [5]  # begun early, then the error
        await _reads_landed(store)
        _settled(store)
        assert store.stats.read_errors == 1
        assert await _map_step(src, layer, [5], con.early(layer)) == {5: WANT[(layer, 5)]}

    _run(reader, body, lru=0)


def test_repin_makes_at_most_four_swaps_over_every_slot_size() -> None:
    """Swaps are found per slot size (main layers, MTP layer): each class made up to 4, so a
    re-pin between two turns could block on 8 reads instead of the 4 it promises."""
    mtp = LAYERS[-1]
    pins = tuple((LAYERS[0], e) for e in range(4)) + tuple((mtp, e) for e in range(4))

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        counts = np.zeros((C.arch.total_layers, len(ALL)), np.int64)
        counts[LAYERS[0], 8:12] = 1000  # four hot main experts
        counts[mtp, 8:12] = 1000  # and four hot MTP ones
        assert await store.repin(counts) == 4

    _run(FakeReader(), body, store_layout=_layout(pinned=pins))


def test_a_step_ends_without_waiting_for_the_event_loop() -> None:
    """The compute side posts a step's end to the loop and goes on (its next layer need not
    wait for the loop to wake and answer): here the loop runs the end only once the step has
    returned, which would deadlock a step that waited for its end."""
    layer = LAYERS[0]
    returned = threading.Event()
    reader = FakeReader()

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        end = store._loop_end
        order: list[str] = []

        def late_end(step: Any) -> None:
            # (on the loop thread, blocked until the compute side has moved on)
            order.append("returned" if returned.wait(5) else "waited for")
            end(step)

        store._loop_end = late_end  # type: ignore[method-assign]

        def consume() -> dict[int, str]:
            with ThreadPoolExecutor(1) as p:
                got = src.map_arrivals(layer, [1, 5, 9], lambda e, w: _digest(w), p)
            returned.set()
            return got

        got = await anyio.to_thread.run_sync(consume)
        assert got == {e: WANT[(layer, e)] for e in (1, 5, 9)}
        await _step(src, layer, [2])  # (its begin runs after the posted end)
        assert order == ["returned", "returned"]
        await _reads_landed(store)
        _settled(store)

    _run(reader, body, lru=0)


def test_an_error_of_a_posted_step_end_fails_the_next_step_once() -> None:
    layer = LAYERS[1]
    reader = FakeReader()

    async def body(store: ExpertStore, src: StreamingExperts) -> None:
        end = store._loop_end
        calls = [0]

        def failing_end(step: Any) -> None:
            calls[0] += 1
            end(step)
            if calls[0] == 1:
                raise RuntimeError("injected end failure")

        store._loop_end = failing_end  # type: ignore[method-assign]
        assert await _step(src, layer, [3]) == {3: WANT[(layer, 3)]}  # (its end fails later)
        with pytest.raises(RuntimeError, match="injected end failure"):
            await _step(src, layer, [4])
        # raised once: the step after it runs, and nothing was left held
        assert await _step(src, layer, [4, 6]) == {e: WANT[(layer, e)] for e in (4, 6)}
        await _reads_landed(store)
        _settled(store)

    _run(reader, body, lru=0)

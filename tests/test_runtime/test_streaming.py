"""Placement only decides speed: greedy tokens and logits are bit-identical across RAM budgets
(nothing cached ... everything resident), reader backends and prefetch on/off; and a failed
read is a clear error after which the engine keeps serving."""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from _demo import budget_for_lru, demo_model

import colibri
from colibri._engine import ENGINE_ID, TokenEvent
from storage.container import Container
from storage.errors import ColibriError, ReadError
from storage.usage import UsageCounts, load_usage, save_usage

DEMO = demo_model()
PROMPT = [5, 17, 99, 300, 12, 44, 8, 250, 31]


@pytest.fixture(autouse=True)
def _private_state(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test learns into its own state dir (no `.coli_usage` shared through ~/.cache)."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    with colibri.open_model(DEMO, learn=False) as m:
        assert m.stats()["experts"]["mode"] == "resident"
        return {"tokens": m.generate(PROMPT, max_new_tokens=24), "logits": m.forward(PROMPT)}


def _run(path: Path, **opts: Any) -> tuple[list[int], np.ndarray, dict[str, Any]]:
    with colibri.open_model(path, **opts) as m:
        toks = m.generate(PROMPT, max_new_tokens=24)
        logits = m.forward(PROMPT)
        return toks, logits, m.stats()["experts"]


@pytest.mark.parametrize("lru", [0, 1, 3, 16])
@pytest.mark.parametrize("prefetch", ["auto", "on", "off"])
def test_budgets_do_not_change_output(reference: dict[str, Any], lru: int, prefetch: str) -> None:
    budget = budget_for_lru(DEMO, lru)
    toks, logits, st = _run(DEMO, ram_budget=budget, prefetch=prefetch, reader="threads")
    assert st["mode"] == "streaming"
    assert st["lru_slots_per_layer"] == lru
    assert toks == reference["tokens"]
    assert np.array_equal(logits, reference["logits"])  # bit-identical, not approximately
    if lru == 0:
        assert st["hits_lru"] == 0 or prefetch != "off"  # nothing cached: every expert is read
        assert st["bytes_read"] > 0
    if prefetch == "off":
        assert st["prefetch_issued"] == 0


@pytest.mark.parametrize("reader", ["threads", "buffered", "uring"])
def test_reader_backends_do_not_change_output(reference: dict[str, Any], reader: str) -> None:
    budget = budget_for_lru(DEMO, 2)
    try:
        toks, logits, st = _run(DEMO, ram_budget=budget, reader=reader)
    except ReadError as exc:
        if reader == "uring":
            pytest.skip(f"io_uring is not available here: {exc}")
        raise
    assert st["reader"] == reader
    assert toks == reference["tokens"]
    assert np.array_equal(logits, reference["logits"])


@pytest.mark.parametrize("piece", [None, 4096])
def test_lookahead_prefetch_is_used(
    reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch, piece: int | None
) -> None:
    """Lookahead reads are used and change nothing, also when each goes to the disk in many
    pieces (some stopped part-way, some joined by their step)."""
    if piece is not None:
        monkeypatch.setattr("runtime.experts.LOOKAHEAD_PIECE", piece)
    toks, logits, st = _run(
        DEMO, ram_budget=budget_for_lru(DEMO, 4), prefetch=True, reader="threads"
    )
    assert toks == reference["tokens"]
    assert np.array_equal(logits, reference["logits"])
    assert st["prefetch_issued"] > 0
    assert st["prefetch_used"] > 0
    assert st["prefetch_used"] + st["prefetch_wasted"] <= st["prefetch_issued"]


@pytest.mark.parametrize("repin", [False, True])
def test_learned_pinning_and_repin_do_not_change_output(
    reference: dict[str, Any], tmp_path: Path, repin: bool
) -> None:
    """Learn routing counts into `.coli_usage`, reopen with a pinned set chosen from them (and
    live re-pin between turns): same tokens, same logits, and the pinned tier is really used."""
    state = tmp_path / "state"
    budget = budget_for_lru(DEMO, 3) + 20 * 80 * 1024
    opts: dict[str, Any] = {"state_dir": state, "reader": "threads", "pin_min_selections": 10}
    with colibri.open_model(DEMO, ram_budget=budget, **opts) as m:
        assert m.generate(PROMPT, max_new_tokens=24) == reference["tokens"]
    usage = state / ".coli_usage"
    assert usage.exists()
    # Invert the learned history (hot experts become cold) so the pinned set starts wrong and a
    # live re-pin has real swaps to make.
    counts = load_usage(usage, 5, 16, ENGINE_ID)
    assert counts is not None and counts.total > 0
    inverted = UsageCounts(5, 16)
    for layer in range(1, 5):
        row = counts.counts[layer]
        inverted.counts[layer] = np.where(row > 0, 1, 6)
    save_usage(usage, inverted, ENGINE_ID)
    with colibri.open_model(DEMO, ram_budget=budget, repin=repin, **opts) as m:
        st0 = m.stats()["experts"]
        assert st0["pinned"] > 0
        for _ in range(3):  # several turns: re-pin runs at each turn end
            assert m.generate(PROMPT, max_new_tokens=24) == reference["tokens"]
        assert np.array_equal(m.forward(PROMPT), reference["logits"])
        st = m.stats()["experts"]
        assert (st["repins"] > 0) == repin
    with colibri.open_model(DEMO, ram_budget=budget, pin=False, **opts) as m:
        assert m.stats()["experts"]["pinned"] == 0
        assert m.generate(PROMPT, max_new_tokens=24) == reference["tokens"]


def test_damaged_usage_file_is_set_aside_not_trusted(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / ".coli_usage").write_text("-1 99 99\ngarbage\n")
    with colibri.open_model(DEMO, ram_budget="64MiB", state_dir=state, reader="threads") as m:
        assert m.stats()["experts"]["pinned"] == 0
        m.generate(PROMPT, max_new_tokens=2)
    assert any(p.name.startswith(".coli_usage.bad") for p in state.iterdir())
    text = (state / ".coli_usage").read_text()  # rewritten at turn end from fresh counts
    assert text.startswith("-1 ")


def test_budget_too_small_for_dense_is_a_clear_error() -> None:
    with pytest.raises(ColibriError, match="too small"):
        with colibri.open_model(DEMO, ram_budget="1MiB"):
            pass


@pytest.mark.anyio
async def test_async_engine_streams_under_asyncio_and_trio(reference: dict[str, Any]) -> None:
    budget = budget_for_lru(DEMO, 1)
    async with colibri.Engine.open(DEMO, ram_budget=budget) as engine:
        toks = [
            ev.token_id
            async for ev in engine.generate(PROMPT, max_new_tokens=24)
            if isinstance(ev, TokenEvent)
        ]
    assert toks == reference["tokens"]


def test_read_error_is_clear_and_engine_keeps_serving(
    reference: dict[str, Any], tmp_path: Path
) -> None:
    """Damage the model's expert shard under a running engine (a real OS-level short read), then
    restore it: the failed request raises ReadError, the next one is correct."""
    model = tmp_path / "model"
    shutil.copytree(DEMO, model)
    shard = model / "out-00000.safetensors"
    good = shard.read_bytes()
    c = Container.open(model)
    cut = c.expert_extents()[16]  # layer 2, expert 0: everything after it goes
    assert cut.path.name == shard.name
    with colibri.open_model(model, ram_budget=budget_for_lru(model, 0), reader="threads") as m:
        with open(shard, "r+b") as fh:  # cut the file inside the expert region
            fh.truncate(cut.start)
        with pytest.raises(ReadError):
            m.generate(PROMPT, max_new_tokens=4)
        shard.write_bytes(good)
        os.sync()
        assert m.generate(PROMPT, max_new_tokens=24) == reference["tokens"]
        assert m.stats()["experts"]["read_errors"] >= 1


def test_time_breakdown_accounts_for_the_forwards() -> None:
    """stats()["time"] splits the forwards' wall time: parts are non-negative, sum to no more
    than compute_seconds, read waits appear only when experts stream, and each generation's
    DoneEvent carries its own share."""
    opts = dict(learn=False, pin=False, reader="threads")

    async def run(budget: str | None) -> tuple[dict[str, Any], dict[str, float]]:
        async with colibri.Engine.open(
            DEMO, ram_budget=budget, options=colibri.EngineOptions(**opts)
        ) as eng:
            done = None
            async for ev in eng.generate(PROMPT, max_new_tokens=8):
                if not isinstance(ev, TokenEvent):
                    done = ev
            assert done is not None
            return eng.stats(), done.stats["time"]

    for budget in (None, budget_for_lru(DEMO, 2)):
        st, turn = anyio.run(run, budget)
        t = st["time"]
        assert set(t) == set(turn)
        assert all(v >= 0 for v in t.values()) and t["expert_compute_s"] > 0
        assert t["dense_compute_s"] > 0
        assert sum(t.values()) <= st["compute_seconds"] + 1e-6
        assert all(turn[k] <= t[k] + 1e-9 for k in t)
        waits = t["read_wait_demand_s"] + t["read_wait_lookahead_s"]
        if budget is None:
            assert waits == 0.0  # resident: nothing to wait for
        else:
            assert st["experts"]["misses"] > 0 and waits > 0
            assert waits == pytest.approx(st["experts"]["compute_stall_s"])


@pytest.mark.parametrize("threads", [1, 2])
def test_the_streaming_timeline_records_reads_computations_and_steps(
    reference: dict[str, Any], threads: int
) -> None:
    """``ExpertStore.trace`` (tools/bench/stream_timeline.py): one "read" per expert read, one
    "step" per MoE layer per forward, one "compute" per expert a step asked for, each interval
    inside the turn, and the same tokens as without it (serial steps and steps on the pool)."""
    budget = budget_for_lru(DEMO, 1)
    opts = dict(learn=False, pin=False, prefetch="off", reader="threads", threads=threads)
    with colibri.open_model(DEMO, ram_budget=budget, **opts) as m:
        store = m.engine._store
        assert store is not None and store.trace is None
        if threads > 1:  # every step on the pool (map_arrivals), tiny as the demo's are
            m.engine._scheduler.ctx.compute.parallel_min_macs = 0
        m.generate(PROMPT[:2], max_new_tokens=1)
        before = m.stats()["experts"]["experts_read"]
        early_before = m.stats()["compute"]["early_experts"]
        trace: list[Any] = []
        store.trace = trace
        t0 = time.perf_counter()
        toks = m.generate(PROMPT, max_new_tokens=24, draft="off")  # one forward per token
        t1 = time.perf_counter()
        store.trace = None
        read = m.stats()["experts"]["experts_read"] - before
        # an expert begun before its down projection landed is computed in two stretches
        early = m.stats()["compute"]["early_experts"] - early_before
        assert (m.stats()["compute"]["parallel_steps"] > 0) == (threads > 1)
    assert toks == reference["tokens"]
    kinds = {k: [e for e in trace if e.kind == k] for k in ("read", "piece", "compute", "step")}
    assert len(kinds["read"]) == read > 0 and not kinds["piece"]
    # per streamed MoE layer one step per forward: the prompt's prefill (one chunk), then one
    # decode step per further token
    per_layer = Counter(e.layer for e in kinds["step"])
    assert per_layer and set(per_layer) <= set(Container.open(DEMO).expert_layers())
    assert set(per_layer.values()) == {len(toks)}
    assert len(kinds["compute"]) == sum(e.expert for e in kinds["step"]) + early
    assert all(t0 <= e.t0 <= e.t1 <= t1 for e in trace)
    for e in kinds["compute"]:  # each computation inside a step of its layer
        assert any(s.layer == e.layer and s.t0 <= e.t0 <= e.t1 <= s.t1 for s in kinds["step"])


@pytest.mark.parametrize("lru", [0, 2])
def test_experts_begun_before_their_down_projection_landed_change_nothing(
    reference: dict[str, Any], lru: int
) -> None:
    """Steps on the pool (two threads): a step's last read, alone on the device, comes in two
    stages, and its expert's gate and up projections are computed while its down projection
    is still being read. Tokens and logits stay bit-identical, and it did happen."""
    opts = dict(learn=False, pin=False, prefetch="off", reader="threads", threads=2)
    with colibri.open_model(DEMO, ram_budget=budget_for_lru(DEMO, lru), **opts) as m:
        m.engine._scheduler.ctx.compute.parallel_min_macs = 0  # tiny as the demo's steps are
        toks = m.generate(PROMPT, max_new_tokens=24, draft="off")
        logits = m.forward(PROMPT)
        st = m.stats()
    assert toks == reference["tokens"]
    assert np.array_equal(logits, reference["logits"])
    assert st["experts"]["early_arrivals"] > 0
    assert 0 < st["compute"]["early_experts"] <= st["experts"]["early_arrivals"]

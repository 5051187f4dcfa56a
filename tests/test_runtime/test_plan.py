"""`coli plan` (runtime/planner.py) against what `Engine.open` really allocates, and its
projected hit rate against the hit rate measured in a run with that plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _demo import demo_model

import colibri
from colibri._engine import ENGINE_ID
from runtime.budget import resident_nbytes
from runtime.planner import make_plan
from storage.container import Container
from storage.errors import ColibriError
from storage.usage import USAGE_FILE, UsageCounts, save_usage

ROOT = Path(__file__).resolve().parents[2]
DEMO = demo_model()


pytestmark = pytest.mark.usefixtures("private_home")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GLM-5 expert geometry (19 MB experts), 2 MoE layers x 32 experts, top-4."""
    out = tmp_path_factory.mktemp("synth") / "model"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_synthetic.py"), "--out", str(out),
         "--moe-layers", "2", "--experts", "32", "--top-k", "4"],
        check=True, capture_output=True,
    )  # fmt: skip
    return out


def _engine_facts(path: Path, budget: int | None, **opts: Any) -> dict[str, Any]:
    with colibri.open_model(path, ram_budget=budget, **opts) as m:
        e = m.stats()["experts"]
        return {
            "experts": e,
            "dense": resident_nbytes(m.engine._model.weights),
            "prefill_chunk": m.stats()["compute"]["prefill_chunk"],
        }


def _assert_same_layout(plan: Any, e: dict[str, Any]) -> None:
    assert e["mode"] == plan.mode == "streaming"
    assert e["lru_slots_per_layer"] == plan.lru_slots_per_layer
    assert e["pinned"] == plan.pinned
    assert e["transient_slots"] == plan.transient_slots
    assert e["slots_bytes"] == plan.experts_slots_bytes


def test_demo_plan_matches_engine_open(tmp_path: Path) -> None:
    c = Container.open(DEMO)
    auto = make_plan(c, None)
    assert auto.mode == "resident" and auto.projected_hit_rate == 1.0
    facts = _engine_facts(DEMO, None, learn=False)
    assert facts["experts"]["mode"] == "resident"
    # The dense estimate from the headers is the loaded arrays' size, to the byte.
    assert auto.dense_bytes == facts["dense"]
    # the prefill chunk the engine takes, whose activations the plan shows outside the budget
    assert auto.prefill_chunk == facts["prefill_chunk"] and auto.prefill_activation_bytes > 0
    assert any(line.startswith("outside budget ") for line in auto.render_lines())
    for extra_slots in (0, 7, 30):
        budget = auto.min_ram_bytes + extra_slots * auto.slot_bytes
        plan = make_plan(c, budget)
        got = _engine_facts(DEMO, budget, learn=False, state_dir=tmp_path)
        e = got["experts"]
        _assert_same_layout(plan, e)
        assert plan.prefill_chunk == got["prefill_chunk"]
        layers = plan.moe_layers
        # a cache slot in every layer: the main layers' size, the MTP layer's its own
        row = (layers - plan.mtp_layers) * plan.slot_bytes + plan.mtp_layers * plan.mtp_slot_bytes
        assert plan.lru_slots_per_layer == min(16, extra_slots * auto.slot_bytes // row)
        want = plan.lru_slots_per_layer * layers / (16 * layers)
        assert plan.projected_hit_rate == pytest.approx(want)


def test_pinned_experts_planned_like_the_engine(tmp_path: Path) -> None:
    """With a `.coli_usage` history the engine pins the hottest experts: the plan pins as many."""
    c = Container.open(DEMO)
    usage = UsageCounts(c.arch.total_layers, c.arch.n_routed_experts)
    rng = np.random.default_rng(0)
    for layer in c.expert_layers():
        usage.add(layer, rng.zipf(1.5, 3000) % c.arch.n_routed_experts)
    save_usage(tmp_path / USAGE_FILE, usage, ENGINE_ID)
    base = make_plan(c, None)
    budget = base.min_ram_bytes + 24 * base.slot_bytes
    plan = make_plan(c, budget, usage_counts=usage.counts)
    assert plan.pinned > 0
    e = _engine_facts(DEMO, budget, state_dir=tmp_path, repin=False)["experts"]
    _assert_same_layout(plan, e)


def test_budget_below_the_dense_part_is_refused_by_both() -> None:
    c = Container.open(DEMO)
    base = make_plan(c, None)
    small = base.dense_bytes // 2
    with pytest.raises(ColibriError, match="minimum is"):
        make_plan(c, small)
    with pytest.raises(ColibriError, match="too small"):
        _engine_facts(DEMO, small, learn=False)


def test_synthetic_plan_and_projected_hit_rate_within_10_points(synthetic: Path) -> None:
    c = Container.open(synthetic)
    base = make_plan(c, None, available=1 << 30)  # as if RAM were short: a streaming plan
    assert base.mode == "streaming"
    budget = base.min_ram_bytes + 24 * base.slot_bytes  # 12 of 32 experts per layer
    plan = make_plan(c, budget)
    assert plan.lru_slots_per_layer == 12 and plan.projected_hit_rate == pytest.approx(12 / 32)
    assert plan.bottleneck in ("disk misses", "compute", "memory") and plan.why
    # Workload with varied routing (the projection assumes uniform routing): independent
    # one-token contexts of random tokens, sampled at temperature 1. One long generation from
    # this random-weight model routes most tokens to a few experts (its attention adds a
    # component common to every position), which an LRU serves far better than uniform.
    rng = np.random.default_rng(0)
    with colibri.open_model(synthetic, ram_budget=budget, learn=False) as m:
        for i in range(64):
            tok = int(rng.integers(0, c.arch.vocab_size))
            m.generate([tok], max_new_tokens=1, temperature=1.0, seed=i)
        e = m.stats()["experts"]
        dense = resident_nbytes(m.engine._model.weights)
    _assert_same_layout(plan, e)
    assert plan.dense_bytes == dense
    measured = e["hit_rate"]
    print(f"projected {plan.projected_hit_rate:.3f}, measured {measured:.3f}")
    assert abs(measured - plan.projected_hit_rate) <= 0.10


def test_a_plan_that_takes_more_than_is_available_warns() -> None:
    """A given budget whose plan allocates more than MemAvailable is not refused (the machine
    may free memory) but warned about, in the plan and in `coli plan`; a budget bigger than
    the model needs but whose plan fits is not."""
    c = Container.open(demo_model())
    full = make_plan(c, 64 << 30, available=1 << 40)
    assert full.warnings == []
    takes = full.dense_bytes + full.kv_reserve_bytes + full.experts_slots_bytes
    tight = make_plan(c, 64 << 30, available=takes - 1)
    assert len(tight.warnings) == 1 and "more than the" in tight.warnings[0]
    assert any(line.startswith("warning ") for line in tight.render_lines())
    assert tight.suggested["ram"] == f"{-(-full.full_residency_ram_bytes // 2**20)}MiB"


def test_cache_slots_never_outnumber_the_unpinned_experts() -> None:
    """A budget past full residency with a routing history that pins every expert used to
    get a full set of cache slots per layer beside them (twice the experts' memory, the
    slots never used)."""
    from runtime.experts import plan_layout
    from storage.container import Container

    c = Container.open(demo_model())
    layers, n_e = c.expert_layers(), c.arch.n_routed_experts
    every = [(layer, e) for layer in layers for e in range(n_e)]
    big = 1 << 40
    assert plan_layout(c, big, top_k=c.arch.top_k).lru_slots_per_layer == n_e
    assert plan_layout(c, big, top_k=c.arch.top_k, pinned=every).lru_slots_per_layer == 0
    # the layer with the fewest pinned sets the count: here 3 pinned in every layer but one
    some = [(layer, e) for layer in layers[1:] for e in range(n_e)] + [
        (layers[0], e) for e in range(3)
    ]
    got = plan_layout(c, big, top_k=c.arch.top_k, pinned=some)
    assert got.lru_slots_per_layer == n_e - 3 and len(got.pinned) == len(some)


def test_the_prefill_chunk_never_exceeds_the_context() -> None:
    """A streaming plan took 4096-token chunks for a 1,024-token model: no prompt fills one,
    and the plan's 'outside budget' activations were 4x what a prompt can take."""
    from runtime.planner import choose_prefill_chunk

    big = choose_prefill_chunk(256, 4, streaming=True, ram_budget=64 << 30)
    assert big > 1024
    assert choose_prefill_chunk(256, 4, streaming=True, ram_budget=64 << 30, context=1024) == 1024
    assert choose_prefill_chunk(256, 4, streaming=False, ram_budget=None, context=300) == 300
    c = Container.open(DEMO)
    ctx = int(c.config["max_position_embeddings"])
    plan = make_plan(c, make_plan(c, None).min_ram_bytes + (1 << 20))
    assert plan.mode == "streaming" and plan.prefill_chunk <= ctx


def test_the_benchmarks_budget_for_a_fraction_caches_that_share(tmp_path: Path) -> None:
    """tools/bench's budget_for reserved KV for 4096 tokens where the engine reserves the
    context (1024 on the demo model): ~16 MB more for the cache, every expert resident at any
    --fraction, and `coli bench stream` on the demo model measured no streaming at all."""
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    try:
        from _synth import budget_for
    finally:
        sys.path.remove(str(ROOT / "tools" / "bench"))
    c = Container.open(DEMO)
    n = c.arch.n_routed_experts * len(c.expert_layers())
    for fraction in (0.1, 0.5):
        plan = make_plan(c, budget_for(c, DEMO, fraction))
        share = (plan.lru_slots_per_layer * plan.moe_layers + plan.pinned) / n
        assert plan.mode == "streaming" and abs(share - fraction) < 0.08, (fraction, share)

"""``coli mirror plan|stage|verify``: the plan ranks shard files by routing history within a
budget, staging is atomic and resumable (a real kill -9 mid-copy), verify catches a corrupted
byte, and the engine reads the staged partial mirror with bit-identical output."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from test_devices import DEMO, budget_for_lru, expert_shards, reshard, run_model

from colibri._engine import ENGINE_ID
from colibri.cli import main
from storage.container import Container
from storage.mirror import MIRROR_RECORD, plan_mirror, stage_mirror, verify_mirror
from storage.usage import UsageCounts, save_usage

ROOT = Path(__file__).resolve().parents[1]
# Expert groups of the re-sharded model (4 experts per shard): (layer, first expert) -> rank.
HOT = [(2, 8), (1, 0), (3, 12)]


@pytest.fixture(autouse=True)
def _private_state(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A re-sharded demo model and a `.coli_usage` that makes three expert shards hot."""
    root = tmp_path_factory.mktemp("mirror")
    primary = reshard(DEMO, root / "primary")
    c = Container.open(primary)
    counts = UsageCounts(c.arch.total_layers, c.arch.n_routed_experts)
    for layer in c.expert_layers():
        counts.counts[layer] = 1  # everything a little
    for rank, (layer, first) in enumerate(HOT):
        counts.counts[layer, first : first + 4] = 1000 * (len(HOT) - rank)
    state = root / "state"
    state.mkdir()
    save_usage(state / ".coli_usage", counts, ENGINE_ID)
    hot_files = [c.expert(layer, first).path.name for layer, first in HOT]
    return {
        "primary": primary,
        "usage": state / ".coli_usage",
        "state": state,
        "hot": hot_files,
        "shard_size": (primary / hot_files[0]).stat().st_size,
        "root": root,
    }


def _plan(m: dict[str, Any], to: Path, budget: int | None) -> Any:
    return plan_mirror(m["primary"], to, budget=budget, usage_path=m["usage"], engine_id=ENGINE_ID)


def test_plan_ranks_by_usage_and_respects_the_budget(model: dict[str, Any], tmp_path: Path) -> None:
    size = model["shard_size"]
    plan = _plan(model, tmp_path / "m", 2 * size + size // 2)
    assert [f.file for f in plan.files] == model["hot"][:2]  # hottest first, as many as fit
    assert plan.nbytes <= plan.budget
    assert plan.usage_found and plan.experts_covered == 8
    doc = plan.to_json()
    assert doc["selection_coverage"] == pytest.approx((3000 * 4 + 2000 * 4) / plan.selections_total)
    assert all(f["status"] == "missing" for f in doc["files"])
    assert {f["file"] for f in doc["left_out"]} == set(expert_shards(model["primary"])) - set(
        model["hot"][:2]
    ) | {"out-mtp-00000.safetensors"}
    assert _plan(model, tmp_path / "m", size - 1).files == ()
    every = _plan(model, tmp_path / "m", 1 << 40)  # the rest follows, in file order
    assert [f.file for f in every.files][:3] == model["hot"]
    assert len(every.files) == len(expert_shards(model["primary"])) + 1 and not every.left_out
    # Without a history the plan still fills the budget (file order).
    cold = plan_mirror(model["primary"], tmp_path / "m", budget=2 * size, usage_path=None)
    assert not cold.usage_found and len(cold.files) == 2
    # The CLI prints the same plan as JSON.
    res = CliRunner().invoke(
        main,
        ["mirror", "plan", "--model", str(model["primary"]), "--to", str(tmp_path / "m"),
         "--budget", str(2 * size + size // 2), "--state-dir", str(model["state"])],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert [f["file"] for f in json.loads(res.output)["files"]] == model["hot"][:2]


def _tree(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name.endswith(".safetensors")}


def test_stage_is_atomic_and_resumable_after_kill_9(model: dict[str, Any], tmp_path: Path) -> None:
    to = tmp_path / "mirror"
    budget = 3 * model["shard_size"]
    script = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from storage.mirror import plan_mirror, stage_mirror
        plan = plan_mirror({str(model["primary"])!r}, {str(to)!r}, budget={budget},
                           usage_path={str(model["usage"])!r}, engine_id={ENGINE_ID!r})
        second = plan.files[1].file
        def progress(name, done, total):
            if name == second and done * 2 >= total:
                os.kill(os.getpid(), signal.SIGKILL)  # a real crash mid-copy
        stage_mirror(plan, chunk_bytes=16384, progress=progress)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    first, second, third = model["hot"]
    names = {p.name for p in to.iterdir()}
    assert first in names and second not in names and third not in names  # nothing torn
    assert f".{second}.part" in names
    assert 0 < (to / f".{second}.part").stat().st_size < model["shard_size"]

    plan = _plan(model, to, budget)
    report = stage_mirror(plan, chunk_bytes=16384)
    assert report.verified == [first]
    assert report.copied == [second, third] and report.resumed == [second]
    assert verify_mirror(model["primary"], to).ok
    clean = tmp_path / "clean"
    stage_mirror(_plan(model, clean, budget))
    assert _tree(to) == _tree(clean)  # identical verified result
    assert {n: (model["primary"] / n).read_bytes() for n in _tree(to)} == _tree(to)
    assert not [p for p in to.iterdir() if p.name.endswith(".part")]
    record = json.loads((to / MIRROR_RECORD).read_text())
    assert sorted(record["files"]) == sorted([first, second, third])
    again = stage_mirror(plan)  # a rerun copies nothing
    assert again.copied == [] and again.verified == [first, second, third]


def test_verify_catches_a_corrupted_byte(model: dict[str, Any], tmp_path: Path) -> None:
    to = tmp_path / "mirror"
    plan = _plan(model, to, model["shard_size"])
    stage_mirror(plan)
    victim = to / plan.files[0].file
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # a data byte: size and header still match
    victim.write_bytes(bytes(raw))
    report = verify_mirror(model["primary"], to)
    assert not report.ok
    bad = [f for f in report.files if f["problem"]]
    assert [f["file"] for f in bad] == [victim.name] and "sha256" in bad[0]["problem"]
    res = CliRunner().invoke(
        main, ["mirror", "verify", "--model", str(model["primary"]), "--to", str(to)]
    )
    assert res.exit_code == 1 and json.loads(res.output)["ok"] is False
    fixed = stage_mirror(plan)  # staging again replaces the damaged copy
    assert fixed.replaced == [victim.name] and verify_mirror(model["primary"], to).ok


def test_engine_reads_the_staged_partial_mirror(model: dict[str, Any], tmp_path: Path) -> None:
    to = tmp_path / "mirror"
    res = CliRunner().invoke(
        main,
        ["mirror", "stage", "--model", str(model["primary"]), "--to", str(to),
         "--budget", str(2 * model["shard_size"]), "--state-dir", str(model["state"])],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in to.glob("*.safetensors")) == sorted(model["hot"][:2])
    budget = budget_for_lru(model["primary"], 0)
    ref_toks, ref_logits, _ = run_model(model["primary"], ram_budget=budget)
    toks, logits, st = run_model(
        model["primary"], ram_budget=budget, mirror=[to], disk_weights="0,1", disk_adapt=False
    )
    assert toks == ref_toks and np.array_equal(logits, ref_logits)
    prim, mir = st["devices"]
    assert mir["files"] == 2 and mir["bytes"] > 0 and prim["bytes"] > 0
    assert st["placement"]["failovers"] == 0

"""``coli mirror plan|stage|verify``: the plan ranks shard files by routing history within a
budget, staging is atomic and resumable (a real kill -9 mid-copy), verify catches a corrupted
byte, and the engine reads the staged partial mirror with bit-identical output; all of it also
from a model whose shards are spread over several directories (``--model-dir``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from structlog.testing import capture_logs
from test_devices import DEMO, budget_for_lru, expert_shards, partial_copy, reshard, run_model
from test_shards import spread

from colibri._engine import ENGINE_ID
from colibri.cli import main
from storage.container import Container
from storage.errors import ColibriError
from storage.manifest import sha256_file
from storage.multidisk.identity import compare_copy_file, open_copies
from storage.multidisk.staging import MIRROR_RECORD, plan_mirror, stage_mirror, verify_mirror
from storage.reader import filesystem_type
from storage.safetensors import read_header
from storage.usage import UsageCounts, save_usage

ROOT = Path(__file__).resolve().parents[2]
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
    assert [f["file"] for f in json.loads(res.stdout)["files"]] == model["hot"][:2]


def _tree(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name.endswith(".safetensors")}


def test_stage_is_atomic_and_resumable_after_kill_9(model: dict[str, Any], tmp_path: Path) -> None:
    to = tmp_path / "mirror"
    budget = 3 * model["shard_size"]
    script = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from storage.multidisk.staging import plan_mirror, stage_mirror
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
    assert res.exit_code == 1 and json.loads(res.stdout)["ok"] is False
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


def test_stage_and_verify_from_shards_spread_over_model_dirs(
    model: dict[str, Any], tmp_path: Path
) -> None:
    """The model's shards spread over three directories (``--model-dir``), none holding them
    all: plan, stage and verify find each source file where it lives, and the engine reading
    the split model with that mirror gives the single-directory output bit for bit."""
    primary = model["primary"]
    experts = expert_shards(primary)
    rest = sorted(p.name for p in primary.glob("*.safetensors") if p.name not in experts)
    dirs = spread(primary, tmp_path / "split", [rest, experts[0::2], experts[1::2]])
    home, others = dirs[0], dirs[1:]
    assert not any((home / n).exists() for n in model["hot"])
    to = tmp_path / "mirror"
    size = model["shard_size"]
    base = ["--model", str(home), "--model-dir", str(others[0]), "--model-dir", str(others[1])]
    res = CliRunner().invoke(
        main,
        ["mirror", "plan", *base, "--to", str(to), "--budget", str(2 * size),
         "--state-dir", str(model["state"])],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [f["file"] for f in doc["files"]] == model["hot"][:2]
    assert doc["model_dirs"] == [str(d) for d in others]
    for f in doc["files"]:
        src = Path(f["source"])
        assert src.parent in others and src.name == f["file"] and f["status"] == "missing"

    res = CliRunner().invoke(
        main,
        ["mirror", "stage", *base, "--to", str(to), "--budget", str(2 * size),
         "--state-dir", str(model["state"])],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in to.glob("*.safetensors")) == sorted(model["hot"][:2])
    assert {n: (primary / n).read_bytes() for n in _tree(to)} == _tree(to)
    record = json.loads((to / MIRROR_RECORD).read_text())
    assert record["model_dirs"] == [str(d.resolve()) for d in others]

    res = CliRunner().invoke(main, ["mirror", "verify", *base, "--to", str(to)])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["files"]
    assert [r["problem"] for r in rows] == [None, None]
    assert all(Path(r["source"]).parent in others and r["sha256"] for r in rows)
    # Without the directories that hold them the mirror's files are no shards of the model.
    res = CliRunner().invoke(main, ["mirror", "verify", "--model", str(home), "--to", str(to)])
    assert res.exit_code == 1
    assert {r["problem"] for r in json.loads(res.stdout)["files"]} == {"not a shard of the model"}
    # A corrupted byte in the staged copy is caught against the file in its model dir.
    victim = to / model["hot"][0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    victim.write_bytes(bytes(raw))
    bad = verify_mirror(home, to, model_dirs=others)
    assert [r["file"] for r in bad.files if r["problem"]] == [victim.name]
    stage_mirror(plan_mirror(home, to, budget=2 * size, usage_path=model["usage"],
                             engine_id=ENGINE_ID, model_dirs=others))  # fmt: skip
    assert verify_mirror(home, to, model_dirs=others).ok
    # The mirror may not be one of the model's own directories.
    with pytest.raises(ColibriError, match="one of the model's dirs"):
        stage_mirror(plan_mirror(home, others[1], budget=2 * size, model_dirs=others))

    budget = budget_for_lru(primary, 0)
    ref_toks, ref_logits, _ = run_model(primary, ram_budget=budget)
    toks, logits, st = run_model(
        home, model_dirs=others, ram_budget=budget, mirror=[to], disk_weights="0,1",
        disk_adapt=False,
    )  # fmt: skip
    assert toks == ref_toks and np.array_equal(logits, ref_logits)
    prim, mir = st["devices"]
    assert mir["files"] == 2 and mir["bytes"] > 0 and prim["bytes"] > 0
    assert st["placement"]["failovers"] == 0


def test_plan_stage_and_verify_refuse_a_target_that_is_no_mirror_of_this_model(
    model: dict[str, Any], tmp_path: Path
) -> None:
    """--to the model directory itself, a regular file, or another model's mirror: each is
    refused by plan, stage and verify alike (plan and verify used to accept the model's own
    directory, and staging into another model's mirror mixed the two)."""
    primary = model["primary"]
    with pytest.raises(ColibriError, match="the model directory itself"):
        plan_mirror(primary, primary, budget=1 << 30)
    with pytest.raises(ColibriError, match="the model directory itself"):
        verify_mirror(primary, primary)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ColibriError, match="is not a directory"):
        plan_mirror(primary, afile, budget=1 << 30)
    other = tmp_path / "other-mirror"
    stage_mirror(plan_mirror(DEMO, other, budget=model["shard_size"]))
    record = json.loads((other / MIRROR_RECORD).read_text())
    assert record["model"] == str(Path(DEMO).resolve())
    with pytest.raises(ColibriError, match="a mirror of another model"):
        plan_mirror(primary, other, budget=1 << 30)
    with pytest.raises(ColibriError, match="a mirror of another model"):
        verify_mirror(primary, other)


def test_restaging_with_a_smaller_budget_removes_what_the_plan_leaves_out(
    model: dict[str, Any], tmp_path: Path
) -> None:
    """Stage three files, then stage again with room for one: the mirror holds that one file
    (the others, and an unfinished copy of one of them, are removed before anything is
    copied), its record lists only it, it verifies, and a file colibri did not copy stays."""
    to = tmp_path / "mirror"
    size = model["shard_size"]
    first, second, third = model["hot"]
    stage_mirror(_plan(model, to, 3 * size))
    (to / f".{third}.part").write_bytes(b"x" * 100)  # as a crash of an earlier stage leaves
    (to / "notes.txt").write_text("mine")
    report = stage_mirror(_plan(model, to, size + size // 2))
    assert report.removed == sorted([second, third]) and report.bytes_removed == 2 * size
    assert report.verified == [first] and report.copied == []
    assert sorted(_tree(to)) == [first]
    assert not (to / f".{third}.part").exists() and (to / "notes.txt").read_text() == "mine"
    record = json.loads((to / MIRROR_RECORD).read_text())
    assert sorted(record["files"]) == [first]
    assert verify_mirror(model["primary"], to).ok
    # growing the budget again copies them back
    again = stage_mirror(_plan(model, to, 3 * size))
    assert again.removed == [] and again.copied == [second, third]


# --------------------------------------------------------------------------- audit fixes
def _reconvert_in_place(primary: Path, name: str, *, manifest: bool) -> None:
    """What converting again from other weights does to shard ``name``: the same tensors, so
    the same size and header bytes, with other expert bytes (the packed int4 blobs), and, when
    the model has one, a manifest whose sha256 says so."""
    head = read_header(primary / name)
    raw = bytearray((primary / name).read_bytes())
    for t in head.tensors.values():
        if t.name.endswith(".weight") and "experts" in t.name:
            raw[t.start : t.end] = bytes(b ^ 0x5A for b in raw[t.start : t.end])
    (primary / name).write_bytes(bytes(raw))
    if manifest:
        doc = json.loads((primary / "colibri-manifest.json").read_text())
        for s in doc["shards"]:
            if s["file"] == name:
                s["sha256"] = sha256_file(primary / name)
        (primary / "colibri-manifest.json").write_text(json.dumps(doc, indent=1))


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_a_mirror_staged_from_other_weights_is_refused(
    model: dict[str, Any], tmp_path: Path, manifest: bool
) -> None:
    """The model converted again in place (same sizes and headers: only the expert bytes
    differ) after its mirror was staged: the engine refuses the stale mirror files (by the
    mirror record's sha256 against the manifest, else the source file's stamp) and reads the
    primary, with the output of the model as it is now; `coli mirror plan` calls them
    "differs" and a stage replaces them."""
    primary = reshard(DEMO, tmp_path / "primary")
    if not manifest:
        (primary / "colibri-manifest.json").unlink()
    to = tmp_path / "mirror"
    plan = plan_mirror(primary, to, budget=1 << 40, usage_path=model["usage"], engine_id=ENGINE_ID)
    stage_mirror(plan)
    victim = model["hot"][0]
    _reconvert_in_place(primary, victim, manifest=manifest)
    assert compare_copy_file(primary / victim, to / victim) is None  # what the old check saw
    c = Container.open(primary)
    shards = [s.path for s in c.shards]
    copies = open_copies(primary, shards, [to], c.shard_checksums())
    why = copies[1].skipped[victim]
    assert ("other weights" in why) if manifest else ("rewritten" in why), why
    assert primary / victim not in copies[1].files
    assert len(copies[1].files) == len(plan.files) - 1

    budget = budget_for_lru(primary, 0)
    ref_toks, ref_logits, _ = run_model(primary, ram_budget=budget)
    toks, logits, _ = run_model(
        primary, ram_budget=budget, mirror=[to], disk_weights="0,1", disk_adapt=False
    )
    assert toks == ref_toks and np.array_equal(logits, ref_logits)
    status = {
        f["file"]: f["status"] for f in plan_mirror(primary, to, budget=1 << 40).to_json()["files"]
    }
    assert status[victim] == "differs" and {s for n, s in status.items() if n != victim} == {
        "present"
    }
    again = stage_mirror(plan_mirror(primary, to, budget=1 << 40))
    assert again.replaced == [victim] and verify_mirror(primary, to).ok
    copies = open_copies(primary, shards, [to], c.shard_checksums())
    assert len(copies[1].files) == len(plan.files)


def test_a_mirror_file_replaced_after_staging_is_refused(
    model: dict[str, Any], tmp_path: Path
) -> None:
    """Another model's file of the same name, size and header copied over a staged mirror
    file was read as the model's experts, without a word: logits changed with placement.
    The record keeps the staged copy's own inode and change time: the engine refuses the
    replaced file and reads the primary (bit-identical output); a stage re-checks it."""
    to = tmp_path / "mirror"
    plan = _plan(model, to, 1 << 40)
    stage_mirror(plan)
    victim = model["hot"][0]
    other = Path(shutil.copytree(model["primary"], tmp_path / "other"))
    _reconvert_in_place(other, victim, manifest=False)
    shutil.copy2(other / victim, to / f".{victim}.new")
    os.replace(to / f".{victim}.new", to / victim)  # same name, size and header
    assert compare_copy_file(model["primary"] / victim, to / victim) is None
    c = Container.open(model["primary"])
    shards = [sh.path for sh in c.shards]
    copies = open_copies(model["primary"], shards, [to], c.shard_checksums())
    assert "changed after it was staged" in copies[1].skipped[victim]
    assert model["primary"] / victim not in copies[1].files
    budget = budget_for_lru(model["primary"], 0)
    ref_toks, ref_logits, _ = run_model(model["primary"], ram_budget=budget)
    toks, logits, _ = run_model(
        model["primary"], ram_budget=budget, mirror=[to], disk_weights="0,1", disk_adapt=False
    )
    assert toks == ref_toks and np.array_equal(logits, ref_logits)
    again = stage_mirror(_plan(model, to, 1 << 40))
    assert again.replaced == [victim]
    copies = open_copies(model["primary"], shards, [to], c.shard_checksums())
    assert len(copies[1].files) == len(plan.files)


def test_staging_never_replaces_files_colibri_did_not_stage(
    model: dict[str, Any], tmp_path: Path
) -> None:
    """`coli mirror stage --to` another model's directory replaced that model's shard files of
    the same names (a warning, exit 0: the other model was damaged). A model's directory is
    refused; a file colibri did not stage is never replaced; both are left as they were."""
    other = Path(shutil.copytree(model["primary"], tmp_path / "other"))
    _reconvert_in_place(other, model["hot"][0], manifest=True)
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    with pytest.raises(ColibriError, match="is a model's directory, not a mirror"):
        stage_mirror(_plan(model, other, 1 << 40))
    bare = tmp_path / "bare"  # the other model's shard alone, no config or manifest
    bare.mkdir()
    shutil.copy2(other / model["hot"][0], bare / model["hot"][0])
    with pytest.raises(ColibriError, match="colibri did not stage it"):
        stage_mirror(_plan(model, bare, 1 << 40))
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    assert (bare / model["hot"][0]).read_bytes() == before[model["hot"][0]]


def test_a_mirror_on_the_models_own_drive_is_warned_about(
    model: dict[str, Any], tmp_path: Path
) -> None:
    """A mirror directory on the primary's device (an unmounted second SSD is a plain
    directory) is used but named in a warning, at plan and at open."""
    to = partial_copy(model["primary"], tmp_path / "mirror", model["hot"][:1])
    with capture_logs() as logs:
        plan_mirror(model["primary"], to, budget=1 << 40)
        open_copies(
            model["primary"], [s.path for s in Container.open(model["primary"]).shards], [to]
        )
    said = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert any("own drive" in e for e in said), said
    assert sum("own drive" in e for e in said) == 2


@pytest.fixture
def small_drive(tmp_path: Path, model: dict[str, Any]) -> Any:
    """A tmpfs of 2.2 shard files (root only: skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounts a small tmpfs (needs root)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    size = (model["shard_size"] * 22 // 10 + 4095) // 4096 * 4096
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_stage_killed_on_a_nearly_full_drive_resumes_with_the_default_budget(
    model: dict[str, Any], small_drive: Path
) -> None:
    """kill -9 mid-copy on a drive the plan fills: the rerun's default budget counts the
    unfinished copy's bytes (it is resumed), so the rerun finishes what the first began
    instead of planning nothing and leaving the .part forever."""
    to = small_drive / "m"
    script = textwrap.dedent(
        f"""
        import os, signal
        from storage.multidisk.staging import plan_mirror, stage_mirror
        plan = plan_mirror({str(model["primary"])!r}, {str(to)!r},
                           usage_path={str(model["usage"])!r}, engine_id={ENGINE_ID!r})
        assert len(plan.files) == 2, plan.files
        second = plan.files[1].file
        def progress(name, done, total):
            if name == second and done * 2 >= total:
                os.kill(os.getpid(), signal.SIGKILL)
        stage_mirror(plan, chunk_bytes=16384, progress=progress)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    first, second = model["hot"][:2]
    assert (to / f".{second}.part").exists()
    plan = plan_mirror(model["primary"], to, usage_path=model["usage"], engine_id=ENGINE_ID)
    assert [f.file for f in plan.files] == [first, second]
    report = stage_mirror(plan, chunk_bytes=16384)
    assert report.verified == [first] and report.resumed == [second]
    assert verify_mirror(model["primary"], to).ok and not list(to.glob(".*.part"))


def test_restaging_a_damaged_copy_keeps_the_intact_one(
    model: dict[str, Any], small_drive: Path
) -> None:
    """The documented repair (stage again) of one truncated mirror file on a drive the mirror
    fills: the damaged copy's bytes count towards the default budget, so the good file stays
    and only the damaged one is copied again."""
    to = small_drive / "m"
    plan = plan_mirror(model["primary"], to, usage_path=model["usage"], engine_id=ENGINE_ID)
    first, second = [f.file for f in plan.files]
    stage_mirror(plan)
    with open(to / second, "r+b") as fh:
        fh.truncate(model["shard_size"] // 3)
    again = stage_mirror(
        plan_mirror(model["primary"], to, usage_path=model["usage"], engine_id=ENGINE_ID)
    )
    assert again.removed == [] and again.verified == [first] and again.replaced == [second]
    assert verify_mirror(model["primary"], to).ok


def test_a_drive_filling_mid_stage_names_the_file_and_what_was_kept(
    model: dict[str, Any], small_drive: Path
) -> None:
    """ENOSPC while copying: a ColibriError naming the file, what was copied and kept, and
    that a rerun resumes, not a bare "No space left on device"."""
    to = small_drive / "m"
    plan = plan_mirror(model["primary"], to, budget=model["shard_size"])
    filler = small_drive / "filler"

    def progress(name: str, done: int, total: int) -> None:
        if not filler.exists():  # another program takes the rest of the drive
            with open(filler, "wb") as fh:
                try:
                    while True:
                        fh.write(b"\0" * 65536)
                except OSError:
                    pass

    with pytest.raises(ColibriError, match=r"filled up while copying .*a rerun resumes"):
        stage_mirror(plan, chunk_bytes=16384, progress=progress)
    filler.unlink()
    assert stage_mirror(plan, chunk_bytes=16384).resumed == [plan.files[0].file]


def test_the_staged_copy_is_re_read_from_the_drive(tmp_path: Path) -> None:
    """`sha256_file(uncached=True)` (the stage's read-back and verify) drops the file's pages
    first, so the hash reads the drive, not the pages the copy just wrote."""
    if filesystem_type(tmp_path) in {"tmpfs", "ramfs"}:
        pytest.skip("the temp dir is in RAM: nothing to read back from a drive")
    p = tmp_path / "f"
    with open(p, "wb") as fh:
        fh.write(os.urandom(8 << 20))
        fh.flush()
        os.fsync(fh.fileno())

    def read_bytes() -> int:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
        pytest.skip("no read_bytes in /proc/self/io")

    sha256_file(p)  # the pages are cached now
    a = read_bytes()
    cached = sha256_file(p)
    b = read_bytes()
    uncached = sha256_file(p, uncached=True)
    c = read_bytes()
    assert cached == uncached
    assert b - a < 1 << 20 and c - b >= 8 << 20, (b - a, c - b)


def test_one_mirror_listed_twice_is_one_copy(model: dict[str, Any], tmp_path: Path) -> None:
    """`--mirror M --mirror /abs/M/` made two copies of one directory: that drive took two
    shares of the reads, without a word."""
    to = tmp_path / "mirror"
    stage_mirror(_plan(model, to, 1 << 40))
    c = Container.open(model["primary"])
    shards = [sh.path for sh in c.shards]
    with capture_logs() as logs:
        copies = open_copies(model["primary"], shards, [to, Path(f"{to.resolve()}/")])
    assert copies[1].files and not copies[2].files
    assert "same directory as mirror 1" in copies[2].skipped["*"]
    assert any("same directory as mirror 1" in str(e.get("reason")) for e in logs), logs

"""Shards spread over several directories (``--model-dir``, ``COLI_MODEL_DIRS``): no directory
holds the whole model, yet the output is bit-identical to the single-directory original, each
expert is read from the directory that holds its shard, a missing shard is one clear error naming
the file and every directory searched, and a shard found twice must be an identical copy.

Everything runs on real copies of the tiny test model (tests/data/tiny-glm) through the real
reader; the resharded variant (several expert shards) comes from test_devices' helper."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from _demo import TINY
from test_devices import budget_for_lru, expert_shards, reshard, run_model

import colibri
from colibri._config import EngineOptions, env_defaults
from storage.container import Container, find_shards, model_home
from storage.errors import ColibriError, ContainerError

SIDE = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "colibri-manifest.json",
)
PROMPT = [5, 17, 99, 300, 12, 44, 8, 250, 31]


def spread(src: Path, root: Path, groups: list[list[str]]) -> list[Path]:
    """Copy ``src`` into ``len(groups)`` directories: the side files into the first, shard
    ``groups[i]`` into directory i. Returns the directories."""
    dirs = []
    for i, names in enumerate(groups):
        d = root / f"disk{i}"
        d.mkdir(parents=True)
        for n in names:
            shutil.copy2(src / n, d / n)
        dirs.append(d)
    for n in SIDE:
        if (src / n).exists():
            shutil.copy2(src / n, dirs[0] / n)
    return dirs


@pytest.fixture(autouse=True)
def _private_state(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny model resharded (one dense shard, several expert shards, one MTP shard), and
    the same files spread over three directories: no directory holds every shard."""
    root = tmp_path_factory.mktemp("shards")
    single = reshard(TINY, root / "single")
    experts = expert_shards(single)
    rest = sorted(p.name for p in single.glob("*.safetensors") if p.name not in experts)
    dense = [n for n in rest if "mtp" not in n]
    mtp = [n for n in rest if "mtp" in n]  # the MTP layer's experts live there
    dirs = spread(single, root / "split", [dense, experts[0::2], experts[1::2] + mtp])
    return {"single": single, "dirs": dirs, "budget": budget_for_lru(single, 0)}


@pytest.fixture(scope="module")
def reference(layout: dict[str, Any]) -> dict[str, Any]:
    toks, logits, st = run_model(layout["single"], ram_budget=layout["budget"])
    assert st["mode"] == "streaming" and st["lru_slots_per_layer"] == 0
    return {"tokens": toks, "logits": logits}


# --------------------------------------------------------------------------- output
def test_plain_split_matches_the_original_bit_for_bit(tmp_path: Path) -> None:
    """The tiny model as shipped (main shard, MTP shard) on two directories, experts resident
    in RAM: the same greedy tokens and the same logits, bit for bit."""
    dirs = spread(TINY, tmp_path, [["out-mtp-00000.safetensors"], ["out-00000.safetensors"]])
    with colibri.open_model(TINY, learn=False) as m:
        want_toks = m.generate(PROMPT, max_new_tokens=16)
        want_logits = m.forward(PROMPT)
    with colibri.open_model(dirs[0], model_dirs=dirs[1:], learn=False) as m:
        assert m.container.dirs == tuple(dirs)
        assert {s.path.parent for s in m.container.shards} == set(dirs)
        assert m.generate(PROMPT, max_new_tokens=16) == want_toks
        assert np.array_equal(m.forward(PROMPT), want_logits)


def test_split_streaming_matches_and_reads_from_the_holding_dir(
    layout: dict[str, Any], reference: dict[str, Any]
) -> None:
    dirs = layout["dirs"]
    c = Container.open(dirs[0], shard_dirs=dirs[1:])
    holders = {x.path.parent for x in c.expert_extents()}
    assert holders == {dirs[1], dirs[2]}  # every expert read goes to the dir holding it
    for x in c.expert_extents():
        assert x.path.is_file() and x.path.parent != dirs[0]
    toks, logits, st = run_model(dirs[0], model_dirs=dirs[1:], ram_budget=layout["budget"])
    assert toks == reference["tokens"]
    assert np.array_equal(logits, reference["logits"])
    assert st["bytes_read"] > 0 and st["read_errors"] == 0


def test_model_dirs_alone_and_from_the_environment(
    layout: dict[str, Any], reference: dict[str, Any]
) -> None:
    """No --model: the first directory holding config.json is the home (whatever its place in
    the list); COLI_MODEL_DIRS is the same list joined by os.pathsep."""
    dirs = layout["dirs"]
    shuffled = (dirs[2], dirs[0], dirs[1])
    env = {"COLI_MODEL_DIRS": os.pathsep.join(str(d) for d in shuffled)}
    opts = EngineOptions(**env_defaults(env))  # type: ignore[arg-type]
    assert opts.model_dirs == shuffled and opts.model is None
    assert opts.resolved_model() == dirs[0] == model_home(shuffled)
    toks, logits, _ = run_model(None, model_dirs=shuffled, ram_budget=layout["budget"])  # type: ignore[arg-type]
    assert toks == reference["tokens"]
    assert np.array_equal(logits, reference["logits"])


def test_mirror_on_top_of_a_split_layout(
    layout: dict[str, Any], reference: dict[str, Any], tmp_path: Path
) -> None:
    """A full mirror of the expert shards next to a split primary: reads spread over both,
    output unchanged."""
    dirs = layout["dirs"]
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for d in dirs[1:]:
        for p in d.glob("*.safetensors"):
            shutil.copy2(p, mirror / p.name)
    toks, logits, st = run_model(
        dirs[0], model_dirs=dirs[1:], mirror=[mirror], disk_weights="1,1",
        ram_budget=layout["budget"],
    )  # fmt: skip
    assert toks == reference["tokens"]
    assert np.array_equal(logits, reference["logits"])
    prim, mir = st["devices"]
    assert prim["bytes"] > 0 and mir["bytes"] > 0
    assert mir["files"] == len(expert_shards(layout["single"])) + 1  # + the MTP shard


# --------------------------------------------------------------------------- errors
def test_missing_shard_names_the_file_and_the_dirs(layout: dict[str, Any], tmp_path: Path) -> None:
    dirs = [Path(shutil.copytree(d, tmp_path / d.name)) for d in layout["dirs"]]
    gone = sorted(dirs[2].glob("*.safetensors"))[0]
    gone.unlink()
    with pytest.raises(ContainerError) as err:
        Container.open(dirs[0], shard_dirs=dirs[1:])
    msg = str(err.value)
    assert gone.name in msg and all(str(d) in msg for d in dirs), msg
    assert isinstance(err.value, ColibriError)
    with pytest.raises(ColibriError, match=gone.name):
        colibri.open_model(dirs[0], model_dirs=dirs[1:], learn=False).__enter__()
    # coli doctor's lenient open lists the problem instead of raising it
    c = Container.open(dirs[0], strict=False, shard_dirs=dirs[1:])
    assert any(gone.name in str(p) for p in c.problems)
    # without the directory that holds the rest, every shard of it is named
    with pytest.raises(ContainerError, match="none of the model directories searched"):
        Container.open(dirs[0], shard_dirs=[dirs[1]])


def test_missing_model_dir_is_an_error(layout: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ContainerError, match="does not exist"):
        Container.open(layout["dirs"][0], shard_dirs=[*layout["dirs"][1:], tmp_path / "nope"])


def test_duplicate_shard_must_be_an_identical_copy(
    layout: dict[str, Any], reference: dict[str, Any], tmp_path: Path
) -> None:
    dirs = [Path(shutil.copytree(d, tmp_path / d.name)) for d in layout["dirs"]]
    dup = sorted(dirs[1].glob("*.safetensors"))[0]
    # An identical copy in a later directory: silently the same shard, no warning.
    shutil.copy2(dup, dirs[2] / dup.name)
    with structlog.testing.capture_logs() as logs:
        paths, problems = find_shards(dirs)
    assert not problems and not [e for e in logs if e["log_level"] == "warning"]
    assert dup in paths and dirs[2] / dup.name not in paths
    # A different file under the same name: refused with one warning, the first one is used.
    with open(dirs[2] / dup.name, "ab") as fh:
        fh.write(b"\0" * 4096)
    with structlog.testing.capture_logs() as logs:
        c = Container.open(dirs[0], shard_dirs=dirs[1:])
    warned = [e for e in logs if e["log_level"] == "warning"]
    assert len(warned) == 1 and warned[0]["event"] == "shard copy refused", logs
    assert warned[0]["file"] == str(dirs[2] / dup.name) and "size" in warned[0]["reason"]
    assert dup in [s.path for s in c.shards]
    toks, logits, _ = run_model(dirs[0], model_dirs=dirs[1:], ram_budget=layout["budget"])
    assert toks == reference["tokens"]
    assert np.array_equal(logits, reference["logits"])


# --------------------------------------------------------------------------- the command
def _coli(*args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    return subprocess.run(
        [sys.executable, "-m", "colibri.cli", *args],
        capture_output=True,
        text=True,
        env=base,
        timeout=300,
    )


def test_coli_run_with_model_dirs(layout: dict[str, Any], tmp_path: Path) -> None:
    dirs = layout["dirs"]
    want = _coli("run", "--model", str(layout["single"]), "--raw", "Hello", "-n", "8")
    assert want.returncode == 0, want.stderr
    flags = [a for d in dirs[1:] for a in ("--model-dir", str(d))]
    got = _coli("run", "--model-dir", str(dirs[0]), *flags, "--raw", "Hello", "-n", "8")
    assert got.returncode == 0, got.stderr
    assert got.stdout == want.stdout
    bad = _coli("run", "--model", str(dirs[0]), "--model-dir", str(dirs[1]), "Hello", "-n", "2")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and str(dirs[1]) in errors[0], bad.stderr


def test_plan_info_and_doctor_take_model_dirs(layout: dict[str, Any]) -> None:
    """A model spread over drives could be run but not planned, shown or checked: `coli plan
    --model-dir` and `coli info --model-dir` were "no such option", and `coli doctor` (which
    the missing-shard hint names) failed the experts of a valid layout."""
    dirs = layout["dirs"]
    flags = ["--model", str(dirs[0])] + [a for d in dirs[1:] for a in ("--model-dir", str(d))]
    plan = _coli("plan", *flags, "--ram", "64MiB", "--json")
    want = _coli("plan", "--model", str(layout["single"]), "--ram", "64MiB", "--json")
    assert plan.returncode == 0 and want.returncode == 0, plan.stderr + want.stderr
    got, ref = json.loads(plan.stdout), json.loads(want.stdout)
    for key in ("lru_slots_per_layer", "pinned", "transient_slots", "expert_bytes", "dense_bytes"):
        assert got[key] == ref[key], key
    info = _coli("info", *flags, "--json")
    assert info.returncode == 0, info.stderr
    doctor = _coli("doctor", *flags, "--json")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    checks = {c["name"]: c["status"] for c in json.loads(doctor.stdout)["checks"]}
    assert checks["experts"] == "pass" and checks["shards"] == "pass", checks

"""Several SSDs: mirrors (full and partial) never change output, reads spread by weight, mismatched
copy files are refused, a failing copy fails over to the primary, weights adapt to a slowed
device (a real cgroup-v1 blkio throttle on a loop device when root allows, plus the pure EWMA /
hysteresis functions), placement is deterministic.

Every run reads real files through the real reader; the demo model is re-sharded (4 experts per
shard file) so partial mirrors can hold some expert shards and not others."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from _demo import budget_for_lru, demo_model

import colibri
from storage.aligned import ALIGN, aligned_empty
from storage.container import Container
from storage.errors import ColibriError, ReadError
from storage.manifest import Manifest, sha256_file
from storage.multidisk.identity import compare_copy_file, device_of, open_copies
from storage.multidisk.placement import (
    Placement,
    adapt_weights,
    ewma,
    parse_weights,
    rendezvous_order,
    stripe_pieces,
)
from storage.reader import ReadRequest, required_size
from storage.safetensors import PAD_PREFIX, TensorSpec, read_header, write_safetensors

DEMO = demo_model()
PROMPT = [5, 17, 99, 300, 12, 44, 8, 250, 31]
ROOT = Path(__file__).resolve().parents[2]
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.\w+\.weight(\.qs)?$")
_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


# --------------------------------------------------------------------------- model helpers
def reshard(src: Path, dst: Path, experts_per_shard: int = 4) -> Path:
    """Copy the demo model with its main shard split: dense tensors in ``out-00000``, then
    ``experts_per_shard`` experts of one layer per shard (4 KiB-aligned blobs, scales beside),
    plus a fresh ``colibri-manifest.json``. Same tensors, same bytes: same output."""
    dst.mkdir(parents=True)
    for name in _SIDE_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    shutil.copy2(src / "out-mtp-00000.safetensors", dst / "out-mtp-00000.safetensors")
    head = read_header(src / "out-00000.safetensors")
    data = (src / "out-00000.safetensors").read_bytes()
    groups: dict[Any, list[Any]] = {}
    for t in sorted(head.tensors.values(), key=lambda t: t.start):
        if t.name.startswith(PAD_PREFIX):
            continue
        m = _EXPERT.match(t.name)
        key = None if m is None else (int(m.group(1)), int(m.group(2)) // experts_per_shard)
        groups.setdefault(key, []).append(t)
    for k, key in enumerate(sorted(groups, key=lambda g: (-1, -1) if g is None else g)):
        specs, chunks, aligned = [], [], set()
        for t in groups[key]:
            m = _EXPERT.match(t.name)
            first = m is not None and not m.group(3) and (m.group(1), m.group(2)) not in aligned
            if first and m is not None:
                aligned.add((m.group(1), m.group(2)))
            specs.append(TensorSpec(t.name, t.dtype, t.shape, ALIGN if first else 1))
            chunks.append(data[t.start : t.end])
        write_safetensors(dst / f"out-{k:05d}.safetensors", specs, chunks, header_align=ALIGN)
    _write_manifest(src, dst)
    return dst


def _write_manifest(src: Path, dst: Path) -> None:
    doc = json.loads((src / "colibri-manifest.json").read_text())
    c = Container.open(dst)
    doc["shards"] = [
        {
            "file": s.path.name,
            "kind": "mtp" if "mtp" in s.path.name else "main",
            "size": s.file_size,
            "sha256": sha256_file(s.path),
            "tensors": sum(1 for n in s.tensors if not n.startswith(PAD_PREFIX)),
        }
        for s in c.shards
    ]
    doc["experts"] = []
    for x in c.expert_extents():
        qs = [s for s in x.scales.values() if s is not None]
        doc["experts"].append(
            {
                "layer": x.layer,
                "expert": x.expert,
                "shard": x.path.name,
                "start": x.start,
                "end": x.end,
                "qs_start": min(s.start for s in qs) if qs else None,
                "qs_end": max(s.end for s in qs) if qs else None,
            }
        )
    Manifest.from_json(doc).save(dst)


def expert_shards(model: Path) -> list[str]:
    """Main shard files holding routed experts, in name order."""
    c = Container.open(model)
    return sorted({x.path.name for x in c.expert_extents() if "mtp" not in x.path.name})


def partial_copy(model: Path, dst: Path, names: list[str]) -> Path:
    """A partial mirror: only the shard files ``names`` (nothing else)."""
    dst.mkdir(parents=True)
    for n in names:
        shutil.copy2(model / n, dst / n)
    return dst


def run_model(path: Path, **opts: Any) -> tuple[list[int], np.ndarray, dict[str, Any]]:
    """Greedy tokens, forward logits and the expert stats of one open."""
    opts.setdefault("reader", "threads")
    opts.setdefault("learn", False)
    with colibri.open_model(path, **opts) as m:
        toks = m.generate(PROMPT, max_new_tokens=24)
        logits = m.forward(PROMPT)
        return toks, logits, m.stats()["experts"]


def share(devices: list[dict[str, Any]], index: int) -> float:
    total = sum(d["bytes"] for d in devices)
    return devices[index]["bytes"] / total if total else 0.0


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def _private_state(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test keeps its state (usage, probe cache) in its own HOME."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("devices")
    primary = reshard(DEMO, root / "primary")
    shards = expert_shards(primary)
    return {
        "root": root,
        "primary": primary,
        "full": Path(shutil.copytree(primary, root / "full")),
        "partial": partial_copy(primary, root / "partial", shards[::2]),
        "partial_names": shards[::2],
        "budget": budget_for_lru(primary, 0),
    }


@pytest.fixture(scope="module")
def reference(models: dict[str, Any]) -> dict[str, Any]:
    """The single-directory streaming run every mirror layout must reproduce bit for bit."""
    toks, logits, st = run_model(models["primary"], ram_budget=models["budget"])
    assert st["mode"] == "streaming" and st["lru_slots_per_layer"] == 0
    assert [d["role"] for d in st["devices"]] == ["primary"]
    assert st["devices"][0]["bytes"] == st["bytes_read"]
    return {"tokens": toks, "logits": logits}


# --------------------------------------------------------------------------- output invariance
def test_resharded_model_matches_the_demo(reference: dict[str, Any]) -> None:
    with colibri.open_model(DEMO, learn=False) as m:
        assert m.generate(PROMPT, max_new_tokens=24) == reference["tokens"]
        assert np.array_equal(m.forward(PROMPT), reference["logits"])


@pytest.mark.parametrize("kind", ["full", "partial"])
@pytest.mark.parametrize("weights", ["1,0", "1,1", "3,1", "0,1"])
def test_mirrors_do_not_change_output(
    models: dict[str, Any], reference: dict[str, Any], kind: str, weights: str
) -> None:
    toks, logits, st = run_model(
        models["primary"],
        ram_budget=models["budget"],
        mirror=[models[kind]],
        disk_weights=weights,
        disk_adapt=False,
    )
    assert toks == reference["tokens"]
    assert np.array_equal(logits, reference["logits"])  # bit-identical
    devs = st["devices"]
    assert [d["role"] for d in devs] == ["primary", "mirror"]
    assert sum(d["bytes"] for d in devs) == st["bytes_read"]
    assert sum(d["reads"] for d in devs) == st["reads"]
    held = len(Container.open(models["primary"]).shards) if kind == "full" else 0
    assert devs[1]["files"] == (held or len(models["partial_names"]))
    assert st["placement"]["failovers"] == 0
    mirror_share = share(devs, 1)
    if weights == "1,0":
        assert devs[1]["bytes"] == 0
    elif weights == "0,1" and kind == "full":
        assert devs[0]["bytes"] == 0  # every read from the mirror
    elif weights == "0,1":  # the primary serves exactly what the partial mirror lacks
        assert devs[0]["bytes"] > 0 and devs[1]["bytes"] > 0
    elif kind == "full":  # hash bucketing over the experts read: a loose ratio
        want = 0.5 if weights == "1,1" else 0.25
        assert abs(mirror_share - want) < 0.17, (weights, mirror_share)
    else:
        assert 0 < mirror_share < 0.75


def test_partial_mirror_serves_only_what_it_holds(models: dict[str, Any]) -> None:
    """With weight 0 on the primary, an expert goes to the primary exactly when its shard is
    not on the partial mirror."""
    primary, partial = models["primary"], models["partial"]
    c = Container.open(primary)
    reps = open_copies(primary, [s.path for s in c.shards], [partial])
    p = Placement(reps, (0.0, 1.0))
    held = set(models["partial_names"])
    for x in c.expert_extents():
        chosen = p.choose(x.layer, x.expert, x)
        if x.path.name in held:
            assert chosen == partial / x.path.name
        else:
            assert chosen == x.path


def test_striped_reads_do_not_change_output(
    models: dict[str, Any], reference: dict[str, Any]
) -> None:
    toks, logits, st = run_model(
        models["primary"],
        ram_budget=models["budget"],
        mirror=[models["full"]],
        disk_weights="1,1",
        disk_adapt=False,
        stripe_min_bytes="16KiB",
    )
    assert toks == reference["tokens"]
    assert np.array_equal(logits, reference["logits"])
    assert st["placement"]["striped_reads"] > 0
    assert all(d["bytes"] > 0 for d in st["devices"])


def test_stripe_pieces_cover_the_extent_on_aligned_cuts() -> None:
    for offset, length in [(8192, 36864), (4096 * 3 + 100, 100_000), (0, 5000)]:
        req = ReadRequest(Path("x"), offset, length)
        buf = aligned_empty(required_size(req))
        pieces = stripe_pieces(req, buf, [3.0, 1.0, 2.0])
        assert pieces[0][1].offset == offset
        assert pieces[-1][1].offset + pieces[-1][1].length == offset + length
        for (_, a, ba), (_, b, bb) in pairwise(pieces):
            assert a.offset + a.length == b.offset and b.offset % ALIGN == 0
            # each piece lands right after the previous one in the caller's buffer
            assert ba.ctypes.data + ba.nbytes == bb.ctypes.data
            assert bb.ctypes.data % ALIGN == 0
        assert pieces[-1][2].ctypes.data + pieces[-1][2].nbytes <= buf.ctypes.data + buf.nbytes


# --------------------------------------------------------------------------- refusal
def test_mismatched_replica_files_are_refused(
    models: dict[str, Any], reference: dict[str, Any], tmp_path: Path
) -> None:
    primary = models["primary"]
    names = expert_shards(primary)
    bad = partial_copy(primary, tmp_path / "bad", names[:2])
    with open(bad / names[0], "ab") as fh:  # one byte longer
        fh.write(b"\0")
    raw = bytearray((bad / names[1]).read_bytes())
    raw[20] ^= 0x01  # a flipped header byte, same size
    (bad / names[1]).write_bytes(bytes(raw))
    assert "size" in (compare_copy_file(primary / names[0], bad / names[0]) or "")
    assert "header" in (compare_copy_file(primary / names[1], bad / names[1]) or "")
    with structlog.testing.capture_logs() as logs:
        toks, logits, st = run_model(
            primary, ram_budget=models["budget"], mirror=[bad], disk_weights="0,1"
        )
    refused = [e for e in logs if e["event"] == "mirror file refused"]
    assert sorted(Path(e["file"]).name for e in refused) == sorted(names[:2])  # one each
    assert toks == reference["tokens"] and np.array_equal(logits, reference["logits"])
    mirror = st["devices"][1]
    assert mirror["files"] == 0 and mirror["bytes"] == 0 and mirror["reads"] == 0
    assert "size" in mirror["skipped"][names[0]] and "header" in mirror["skipped"][names[1]]


def test_declared_weights_must_match_the_copies(models: dict[str, Any]) -> None:
    with pytest.raises(ColibriError, match="disk weights"):
        run_model(
            models["primary"], ram_budget=models["budget"], mirror=[models["full"]],
            disk_weights="1,1,1",
        )  # fmt: skip
    for bad in ("", "a,b", "-1,2", "0,0"):
        with pytest.raises(ColibriError):
            parse_weights(bad)
    assert parse_weights("2:1") == parse_weights("2,1") == (2.0, 1.0)


# --------------------------------------------------------------------------- failover
def test_truncated_mirror_fails_over_to_the_primary(
    models: dict[str, Any], reference: dict[str, Any], tmp_path: Path
) -> None:
    """Cut a mirror shard while the engine runs (real short reads): the reads fail over to the
    primary, the output is unchanged, the failover is counted and warned once, and the mirror
    is demoted (it serves nothing afterwards)."""
    primary = models["primary"]
    mirror = Path(shutil.copytree(primary, tmp_path / "mirror"))
    names = expert_shards(primary)
    with structlog.testing.capture_logs() as logs:
        with colibri.open_model(
            primary, ram_budget=models["budget"], mirror=[mirror], disk_weights="0,1",
            reader="threads", learn=False,
        ) as m:  # fmt: skip
            for n in names:  # every expert shard loses its experts: the header stays
                h = read_header(mirror / n)
                with open(mirror / n, "r+b") as fh:
                    fh.truncate(h.data_start)
            assert m.generate(PROMPT, max_new_tokens=24) == reference["tokens"]
            st = m.stats()["experts"]
            assert np.array_equal(m.forward(PROMPT), reference["logits"])
            st2 = m.stats()["experts"]
    warned = [e for e in logs if e["event"].startswith("read failed on a copy")]
    assert len(warned) == 1 and warned[0]["log_level"] == "warning"
    prim, mir = st["devices"]
    assert mir["failovers"] >= 1 and mir["demoted"] and prim["served_failovers"] >= 1
    assert st["placement"]["failovers"] == mir["failovers"] and st["read_errors"] == 0
    assert mir["weight"] == 0.0
    assert st2["devices"][1]["bytes"] == mir["bytes"]  # demoted: nothing more from it
    assert st2["devices"][1]["failovers"] == mir["failovers"]


def test_a_demoted_copy_can_be_enabled_again(
    models: dict[str, Any], reference: dict[str, Any], tmp_path: Path
) -> None:
    """A mirror demoted by real short reads serves nothing; once its files are whole again,
    ``enable_replica`` (by directory, or by index) gives it back its declared weight and it
    serves reads again; the output never changes. Repaired by renaming new files into place
    (what staging does), the copy was demoted again at once: the engine read the damaged
    files it still held open."""
    primary = models["primary"]
    mirror = Path(shutil.copytree(primary, tmp_path / "mirror"))
    names = expert_shards(primary)
    saved = {n: (mirror / n).read_bytes() for n in names}
    with colibri.open_model(
        primary, ram_budget=models["budget"], mirror=[mirror], disk_weights="0,1",
        reader="threads", learn=False, disk_adapt=False,
    ) as m:  # fmt: skip
        for n in names:
            with open(mirror / n, "r+b") as fh:
                fh.truncate(read_header(mirror / n).data_start)
        assert m.generate(PROMPT, max_new_tokens=24) == reference["tokens"]
        demoted = m.stats()["experts"]["devices"][1]
        assert demoted["demoted"] and demoted["weight"] == 0.0
        assert m.generate(PROMPT, max_new_tokens=24) == reference["tokens"]
        assert m.stats()["experts"]["devices"][1]["bytes"] == demoted["bytes"]  # unused
        for n in names:  # repaired as `coli mirror stage` does: new files renamed into place
            (mirror / f".{n}.part").write_bytes(saved[n])
            os.replace(mirror / f".{n}.part", mirror / n)
        got = m.enable_replica(mirror)
        assert got["index"] == 1 and not got["demoted"] and got["weight"] == 1.0
        assert m.enable_replica(1)["weight"] == 1.0  # by index; enabling twice is harmless
        assert m.generate(PROMPT, max_new_tokens=24) == reference["tokens"]
        assert np.array_equal(m.forward(PROMPT), reference["logits"])
        after = m.stats()["experts"]["devices"]
        with pytest.raises(ColibriError, match="no copy 5"):
            m.enable_replica(5)
        with pytest.raises(ColibriError, match="none of the model's copies"):
            m.enable_replica(tmp_path / "elsewhere")
    assert after[1]["bytes"] > demoted["bytes"] and not after[1]["demoted"]
    assert after[1]["failovers"] == demoted["failovers"]  # no new failure
    with colibri.open_model(primary, learn=False) as m:  # resident: nothing to enable
        with pytest.raises(ColibriError, match="resident"):
            m.enable_replica(0)


def test_read_error_only_when_every_copy_failed(
    models: dict[str, Any], reference: dict[str, Any], tmp_path: Path
) -> None:
    primary = Path(shutil.copytree(models["primary"], tmp_path / "primary"))
    mirror = Path(shutil.copytree(primary, tmp_path / "mirror"))
    names = expert_shards(primary)
    saved = {n: (primary / n).read_bytes() for n in names}
    with colibri.open_model(
        primary, ram_budget=models["budget"], mirror=[mirror], disk_weights="1,1",
        reader="threads", learn=False,
    ) as m:  # fmt: skip
        for d in (primary, mirror):
            for n in names:
                with open(d / n, "r+b") as fh:
                    fh.truncate(read_header(d / n).data_start)
        with pytest.raises(ReadError, match="every copy failed"):
            m.generate(PROMPT, max_new_tokens=4)
        for d in (primary, mirror):
            for n in names:
                (d / n).write_bytes(saved[n])
        os.sync()
        # Both copies are demoted now; they are still tried as a last resort.
        assert m.generate(PROMPT, max_new_tokens=24) == reference["tokens"]
        st = m.stats()["experts"]
    assert st["read_errors"] >= 1 and st["devices"][1]["demoted"]


# --------------------------------------------------------------------------- determinism
def test_mapping_is_deterministic_and_weighted(models: dict[str, Any]) -> None:
    primary, full = models["primary"], models["full"]
    c = Container.open(primary)
    files = [s.path for s in c.shards]
    a = Placement(open_copies(primary, files, [full]), (3.0, 1.0))
    b = Placement(open_copies(primary, files, [full]), (3.0, 1.0))
    x = c.expert_extents()[0]
    keys = [(layer, e) for layer in range(64) for e in range(256)]
    ca = [a.order(layer, e, [x.path])[0] for layer, e in keys]
    assert ca == [b.order(layer, e, [x.path])[0] for layer, e in keys]
    assert abs(ca.count(1) / len(keys) - 0.25) < 0.02  # share = weight share
    # A weight change only moves experts towards the copy that gained weight.
    moved = [rendezvous_order(la, e, (3.0, 2.0), (0, 1))[0] for la, e in keys]
    assert all(new == 1 for old, new in zip(ca, moved, strict=True) if old != new)
    assert moved.count(1) > ca.count(1)


def test_same_weights_same_reads_across_opens(models: dict[str, Any]) -> None:
    """The copy that serves each expert is a function of the weights: two opens read the same
    bytes from each copy (with speculative drafting off: ``--draft auto`` adapts to measured
    timings, so the number of verify steps, and of expert lookups, can differ run to run)."""
    opts = {
        "ram_budget": models["budget"],
        "draft": "off",
        "mirror": [models["partial"]],
        "disk_weights": "1,1",
        "disk_adapt": False,
        "prefetch": False,
    }
    per_copy = []
    for _ in range(2):
        _, _, st = run_model(models["primary"], **opts)
        per_copy.append([(d["bytes"], d["reads"]) for d in st["devices"]])
    assert per_copy[0] == per_copy[1]


def test_device_identity_and_probe_cache(models: dict[str, Any]) -> None:
    primary = models["primary"]
    dev = device_of(primary)
    assert dev.st_dev == os.stat(primary).st_dev
    if Path("/proc/self/mountinfo").exists():
        assert dev.mount and dev.name
    state = models["root"] / "state-probe"
    _, _, st = run_model(
        primary, ram_budget=models["budget"], mirror=[models["full"]], state_dir=state
    )
    assert st["placement"]["weight_source"] == "probed"
    assert all(d["base_weight"] > 0 for d in st["devices"])
    cache = json.loads((state / ".coli_devices.json").read_text())
    entry = next(iter(cache["devices"].values()))
    assert entry["st_dev"] == dev.st_dev and entry["bytes_per_s"] > 0
    # A changed device id means a new probe: fake an old id and see it replaced.
    for v in cache["devices"].values():
        v["st_dev"] = -1
    (state / ".coli_devices.json").write_text(json.dumps(cache))
    run_model(primary, ram_budget=models["budget"], mirror=[models["full"]], state_dir=state)
    again = json.loads((state / ".coli_devices.json").read_text())
    assert all(v["st_dev"] == dev.st_dev for v in again["devices"].values())


# --------------------------------------------------------------------------- adaptation
def test_ewma_and_hysteresis_pure() -> None:
    """Measured-style samples (bytes/s per read) through the EWMA and the re-bucket rule."""
    rng = np.random.default_rng(0)
    est: list[float | None] = [None, None]
    weights = (1.0, 1.0)
    for _ in range(50):  # two equal drives with +-10% noise: the mapping never changes
        for i in (0, 1):
            est[i] = ewma(est[i], 2.0e9 * (1 + 0.1 * rng.standard_normal()))
        assert adapt_weights(weights, est) is None
    for _ in range(30):  # drive 1 is throttled to a quarter
        est[0] = ewma(est[0], 2.0e9 * (1 + 0.05 * rng.standard_normal()))
        est[1] = ewma(est[1], 0.5e9 * (1 + 0.05 * rng.standard_normal()))
    new = adapt_weights(weights, est)
    assert new is not None and new[0] / new[1] == pytest.approx(4.0, rel=0.15)
    assert sum(new) == pytest.approx(2.0)
    assert adapt_weights(new, est) is None  # adopted: stable again
    # A copy without an estimate or weight keeps its weight; a dead-slow one keeps a floor.
    kept = adapt_weights((1.0, 1.0, 0.0, 2.0), (1e9, 1e3, 5e9, None))
    assert kept is not None and kept[2] == 0.0 and kept[3] == 2.0
    assert kept[1] == pytest.approx(0.05 / 1.05 * 2.0, rel=1e-6)
    assert adapt_weights((1.0,), (1e9,)) is None


def _cgroup_loop_available() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if not Path("/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device").exists():
        return "no cgroup v1 blkio throttle"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    return None


@pytest.fixture
def throttled_mirror(models: dict[str, Any], tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A full mirror on an ext4 loop device, and a blkio cgroup limiting its reads."""
    why = _cgroup_loop_available()
    if why is not None:
        pytest.skip(f"cgroup/loop throttling unavailable: {why}")
    img, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    cg = Path(f"/sys/fs/cgroup/blkio/colibri-test-{os.getpid()}")
    mnt.mkdir()
    with open(img, "wb") as fh:
        fh.truncate(48 << 20)
    loop = ""
    mounted = False
    try:
        loop = subprocess.run(
            ["losetup", "-f", "--show", str(img)], check=True, capture_output=True, text=True
        ).stdout.strip()
        subprocess.run(["mkfs.ext4", "-q", loop], check=True, capture_output=True)
        subprocess.run(["mount", loop, str(mnt)], check=True, capture_output=True)
        mounted = True
        shutil.copytree(models["primary"], mnt / "model")
        os.sync()
        majmin = Path(f"/sys/block/{Path(loop).name}/dev").read_text().strip()
        cg.mkdir()
        (cg / "blkio.throttle.read_bps_device").write_text(f"{majmin} {2 << 20}\n")
        yield mnt / "model", cg
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cgroup/loop throttling unavailable: {exc}")
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False)
        if loop:
            subprocess.run(["losetup", "-d", loop], check=False)
        if cg.exists():
            cg.rmdir()


@pytest.mark.root
def test_weights_adapt_to_a_throttled_device(
    models: dict[str, Any], reference: dict[str, Any], throttled_mirror: tuple[Path, Path]
) -> None:
    """The engine runs in a subprocess inside a blkio cgroup that throttles the mirror's loop
    device to 2 MiB/s; declared 1:1, the mirror's weight must drop, output stays identical."""
    mirror, cg = throttled_mirror
    script = textwrap.dedent(
        f"""
        import json, sys
        import colibri
        opts = dict(ram_budget={models["budget"]}, mirror=[{str(mirror)!r}], disk_weights="1,1",
                    reader="threads", learn=False, state_dir={str(models["root"] / "st-thr")!r})
        with colibri.open_model({str(models["primary"])!r}, **opts) as m:
            toks = m.generate({PROMPT!r}, max_new_tokens=24)
            st = m.stats()["experts"]
        print(json.dumps({{"tokens": toks, "devices": st["devices"],
                          "placement": st["placement"]}}))
        """
    )

    # The shell joins the cgroup, then becomes the Python process (threads inherit it).
    enter = f'echo $$ > {cg / "cgroup.procs"} && exec "$0" -c "$1"'
    out = subprocess.run(
        ["sh", "-c", enter, sys.executable, script],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["tokens"] == reference["tokens"]
    prim, mir = res["devices"]
    assert res["placement"]["adaptations"] >= 1
    assert mir["weight"] < 0.5 * prim["weight"], (prim["weight"], mir["weight"])
    # The throttled mirror measures well below the primary. Not a fixed 3x: on a loaded CI
    # machine the primary itself measured only 24-28 MB/s while reads of the throttled mirror
    # came out at 9-11 MB/s (the throttle lets short bursts through).
    assert prim["throughput_bytes_per_s"] > 2 * mir["throughput_bytes_per_s"], (prim, mir)
    assert mir["bytes"] < prim["bytes"]


def test_one_drive_counts_its_busy_time_and_throughput() -> None:
    """Without a mirror the drive's series are measured too: busy seconds (wall time with a read
    in flight, never more than the summed read seconds) and a throughput estimate once a window
    of reads closed (both stayed 0 / null on a single copy)."""
    opts = dict(ram_budget=budget_for_lru(DEMO, 1), reader="threads", learn=False)
    with colibri.open_model(DEMO, **opts) as m:
        m.generate(PROMPT, max_new_tokens=16)
        (dev,) = m.stats()["experts"]["devices"]
    assert dev["reads"] >= 16 and dev["bytes"] > 0
    assert 0.0 < dev["busy_seconds"] <= dev["seconds"] + 1e-6, dev
    assert dev["throughput_bytes_per_s"] is not None and dev["throughput_bytes_per_s"] > 0, dev

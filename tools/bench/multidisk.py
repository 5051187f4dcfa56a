"""Several SSDs: streaming expert reads over two throttled drives, by placement policy.

Builds two loop devices on image files (ext4, ``losetup --direct-io=on``), puts a full copy of a
synthetic GLM-5-geometry model on the first (the primary) and its expert shards on the second
(a ``--mirror``), limits their read bandwidth differently with cgroup v1
``blkio.throttle.read_bps_device`` (this process joins a new blkio cgroup), and streams
expert-shaped O_DIRECT reads (an expert's blob plus its scales, exactly the requests the expert
store issues) through the engine's real reader (``storage.reader``) and placement
(``storage.multidisk`` / ``storage.multidisk.placement``), with ``--depth`` experts in flight, for:

* ``primary``: the primary alone (no mirror);
* ``equal``: declared weights 1,1;
* ``probed``: weights probed at open (expert-sized O_DIRECT reads per device), no adaptation;
* ``adaptive``: wrong declared weights (inverted: 1,2) that run-time adaptation must fix
  (throughput of the whole run, and of its second half once adapted);
* ``striped``: probed weights, every expert read split over both drives (``--stripe-min``).

The figure is probed-weight throughput / (sum of the two limits); the issue aims at >= 0.85, and
probed > equal when the limits differ 2:1. Needs root, cgroup v1 blkio, losetup and mkfs.ext4;
otherwise it prints why and a JSON line with ``"skipped"``. Everything it creates (mounts, loop
devices, cgroup, images) is removed at the end.

    flock /tmp/colibri-bench.lock python tools/bench/multidisk.py [--limits 200,100] \\
        [--bytes 2GiB] [--depth 8] [--model /var/tmp/colibri-multidisk-synth]

The synthetic model (1 MoE layer x 256 experts, 5.1 GiB) is built on first use (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402

from runtime.experts import _scale_requests, slot_sizes  # noqa: E402
from storage.aligned import aligned_empty  # noqa: E402
from storage.container import Container  # noqa: E402
from storage.multidisk.identity import open_copies  # noqa: E402
from storage.multidisk.placement import Placement  # noqa: E402
from storage.multidisk.probing import open_placement  # noqa: E402
from storage.reader import Reader, ReadRequest, open_reader, required_size  # noqa: E402

CGROUP_ROOT = Path("/sys/fs/cgroup/blkio")
MB = 1_000_000


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def unavailable() -> str | None:
    """Why the benchmark cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (loop devices, mounts and blkio cgroups)"
    if not (CGROUP_ROOT / "blkio.throttle.read_bps_device").exists():
        return f"no cgroup v1 blkio throttle at {CGROUP_ROOT}"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    return None


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


class Disks:
    """Two loop devices on image files, mounted, and the blkio cgroup throttling them."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.loops: list[str] = []
        self.mounts: list[Path] = []
        self.cgroup: Path | None = None

    def add(self, name: str, size: int) -> Path:
        img, mnt = self.work / f"{name}.img", self.work / f"mnt-{name}"
        with open(img, "wb") as fh:
            fh.truncate(size)
        loop = _run("losetup", "-f", "--show", "--direct-io=on", str(img))
        self.loops.append(loop)
        _run("mkfs.ext4", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", loop)
        mnt.mkdir()
        _run("mount", loop, str(mnt))
        self.mounts.append(mnt)
        return mnt

    def majmin(self, loop: str) -> str:
        return Path(f"/sys/block/{Path(loop).name}/dev").read_text().strip()

    def throttle(self, limits_bps: Sequence[int]) -> None:
        """Join a new blkio cgroup whose read limit on loop device i is ``limits_bps[i]``."""
        self.cgroup = CGROUP_ROOT / f"colibri-multidisk-{os.getpid()}"
        self.cgroup.mkdir()
        for loop, bps in zip(self.loops, limits_bps, strict=True):
            (self.cgroup / "blkio.throttle.read_bps_device").write_text(
                f"{self.majmin(loop)} {bps}\n"
            )
        (self.cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def close(self) -> None:
        if self.cgroup is not None and self.cgroup.exists():
            (CGROUP_ROOT / "cgroup.procs").write_text(f"{os.getpid()}\n")
            self.cgroup.rmdir()
        for mnt in reversed(self.mounts):
            subprocess.run(["umount", str(mnt)], check=False)
        for loop in reversed(self.loops):
            subprocess.run(["losetup", "-d", loop], check=False)


@contextmanager
def two_disks(work: Path) -> Iterator[Disks]:
    d = Disks(work)
    try:
        yield d
    finally:
        d.close()


# --------------------------------------------------------------------------- streaming
async def stream(
    c: Container,
    reader: Reader,
    placement: Placement,
    keys: Sequence[tuple[int, int]],
    depth: int,
) -> dict[str, Any]:
    """Read every key's expert (blob + scales, as the expert store does) with ``depth`` experts
    in flight; bytes/s overall and over the second half."""
    blob_bytes, scale_bytes = slot_sizes(c)
    free = [
        (aligned_empty(blob_bytes), aligned_empty(max(scale_bytes, 4096))) for _ in range(depth)
    ]
    done: list[tuple[float, int]] = []
    t0 = time.perf_counter()

    async def one(key: tuple[int, int]) -> None:
        blob, scales = free.pop()
        try:
            x = c.expert(*key)
            reqs = [ReadRequest(x.path, x.start, x.nbytes), *_scale_requests(x)]
            bufs = [blob]
            off = 0
            for r in reqs[1:]:
                bufs.append(scales[off : off + required_size(r)])
                off += required_size(r)
            await placement.read_many(reader, key, reqs, bufs)
            done.append((time.perf_counter(), sum(r.length for r in reqs)))
        finally:
            free.append((blob, scales))

    limiter = anyio.Semaphore(depth)

    async def gated(key: tuple[int, int]) -> None:
        try:
            await one(key)
        finally:
            limiter.release()

    async with anyio.create_task_group() as tg:
        for key in keys:
            await limiter.acquire()  # keep `depth` experts in flight, issued in key order
            tg.start_soon(gated, key)
    t1 = time.perf_counter()
    total = sum(n for _, n in done)
    half = len(done) // 2
    t_half = done[half - 1][0] if half else t0
    late = sum(n for _, n in done[half:])
    return {
        "bytes": total,
        "seconds": t1 - t0,
        "mb_per_s": total / (t1 - t0) / MB,
        "second_half_mb_per_s": late / max(t1 - t_half, 1e-9) / MB,
    }


async def run_mode(
    mode: str,
    model: Path,
    mirror: Path,
    keys: Sequence[tuple[int, int]],
    a: argparse.Namespace,
    state: Path,
) -> dict[str, Any]:
    c = Container.open(model)
    drop_caches()
    reader = await open_reader(a.reader, probe_path=c.expert_extents()[0].path)
    try:
        files = [s.path for s in c.shards]
        if mode == "primary":
            placement = Placement(open_copies(model, files, []), (1.0,), source="single")
        elif mode == "equal":
            placement = Placement(open_copies(model, files, [mirror]), (1.0, 1.0), adapt=False)
        elif mode == "adaptive":
            placement = Placement(open_copies(model, files, [mirror]), a.wrong_weights, adapt=True)
        else:  # probed, striped: probe at open (a fresh cache: this run measures the drives)
            cache = state / mode
            placement = await open_placement(
                c,
                [mirror],
                adapt=False,
                stripe_min_bytes=a.stripe_min if mode == "striped" else 0,
                state_dir=cache,
                direct=reader.direct,
            )
        w0 = placement.weights
        res = await stream(c, reader, placement, keys, a.depth)
        devs = placement.stats()
        res.update(
            {
                "mode": mode,
                "reader": reader.name,
                "weights_start": [round(w, 3) for w in w0],
                "weights_end": [round(w, 3) for w in placement.weights],
                "share": [round(d["bytes"] / max(1, res["bytes"]), 3) for d in devs],
                "device_mb_per_s": [
                    round(d["bytes"] / d["busy_seconds"] / MB, 1) if d["busy_seconds"] else None
                    for d in devs
                ],
                "adaptations": placement.adaptations,
                "striped_reads": placement.striped_reads,
            }
        )
        return res
    finally:
        await reader.aclose()


DEFAULT_MODEL = Path("/var/tmp/colibri-multidisk-synth")


def ensure_model(path: Path) -> None:
    """The synthetic model, built on first use at its default place only: a mistyped
    --model wrote 5 GiB of shards wherever it pointed."""
    if (path / "config.json").exists():
        return
    if path != DEFAULT_MODEL:
        raise SystemExit(
            f"{path} holds no model (no config.json); the synthetic model is built only at its "
            f"default place ({DEFAULT_MODEL}): leave --model out, or run "
            f"tools/make_synthetic.py --out {path} --moe-layers 1 --experts 256 first"
        )
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "make_synthetic.py"),
            "--out",
            str(path),
            "--moe-layers",
            "1",
            "--experts",
            "256",
        ],
        check=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--work", type=Path, default=Path("/var/tmp"), help="where the images go")
    ap.add_argument("--limits", default="200,100", help="MB/s read limits: primary,mirror")
    ap.add_argument(
        "--bytes",
        default="all",
        help="expert bytes streamed per mode, e.g. 2GB; 'all': every expert once, in random "
        "order (then each copy's share is exactly its share of the model's experts)",
    )
    ap.add_argument("--depth", type=int, default=8, help="experts in flight")
    ap.add_argument("--reader", default="auto", choices=["auto", "uring", "threads"])
    ap.add_argument("--stripe-min", type=int, default=1 << 20, help="bytes; striped mode")
    ap.add_argument(
        "--modes", default="primary,equal,probed,adaptive,striped", help="comma-separated"
    )
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    a.wrong_weights = (1.0, 2.0)  # inverted on purpose: the fast primary gets the small share
    from colibri._config import parse_bytes

    why = unavailable()
    if why is not None:
        print(f"multidisk benchmark skipped: {why}")
        print(json.dumps({"figure": None, "figure_reason": why, "skipped": why}))
        return 0
    limits = [int(float(x) * MB) for x in a.limits.split(",")]
    budget = 0 if a.bytes == "all" else parse_bytes(a.bytes) or 0
    ensure_model(a.model)
    src = Container.open(a.model)
    expert_files = sorted({x.path.name for x in src.expert_extents()})
    size = sum((a.model / n).stat().st_size for n in expert_files)
    all_files = [p for p in a.model.iterdir() if p.is_file()]
    full = sum(p.stat().st_size for p in all_files)

    # Random experts, each at most once per pass (what a long decode with a small cache does).
    keys_all = [(x.layer, x.expert) for x in src.expert_extents()]
    rng = random.Random(a.seed)
    keys: list[tuple[int, int]] = []
    per = src.expert_nbytes
    if not budget:
        rng.shuffle(keys_all)
        keys = list(keys_all)
    while len(keys) * per < budget:
        rng.shuffle(keys_all)
        keys.extend(keys_all[: max(1, (budget - len(keys) * per) // per + 1)])

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=a.work, prefix="colibri-multidisk-") as tmp:
        work = Path(tmp)
        with two_disks(work) as disks:
            t_setup = time.perf_counter()
            primary_mnt = disks.add("a", full + (512 << 20))
            mirror_mnt = disks.add("b", size + (512 << 20))
            model, mirror = primary_mnt / "model", mirror_mnt / "model"
            shutil.copytree(a.model, model)
            mirror.mkdir()
            for n in expert_files:
                shutil.copyfile(a.model / n, mirror / n)
            drop_caches()
            setup_s = time.perf_counter() - t_setup
            disks.throttle(limits)
            state = work / "state"
            for mode in a.modes.split(","):
                r = anyio.run(run_mode, mode, model, mirror, keys, a, state)
                results.append(r)
                half = r["second_half_mb_per_s"]
                print(
                    f"{mode:9s} {r['mb_per_s']:7.1f} MB/s  (2nd half {half:6.1f})"
                    f"  share {r['share']}  weights {r['weights_start']} -> {r['weights_end']}"
                    f"  device MB/s {r['device_mb_per_s']}",
                    flush=True,
                )
    by = {r["mode"]: r for r in results}
    cap = sum(limits) / MB
    out: dict[str, Any] = {
        "figure": round(by["probed"]["mb_per_s"] / cap, 3) if "probed" in by else None,
        "limits_mb_per_s": [x / MB for x in limits],
        "sum_of_limits_mb_per_s": cap,
        "mb_per_s": {m: round(r["mb_per_s"], 1) for m, r in by.items()},
        "fraction_of_sum": {m: round(r["mb_per_s"] / cap, 3) for m, r in by.items()},
        "adaptive_second_half_mb_per_s": (
            round(by["adaptive"]["second_half_mb_per_s"], 1) if "adaptive" in by else None
        ),
        "probed_beats_equal": (
            by["probed"]["mb_per_s"] > by["equal"]["mb_per_s"]
            if "probed" in by and "equal" in by
            else None
        ),
        "bytes_per_mode": by[next(iter(by))]["bytes"] if by else 0,
        "experts_per_mode": len(keys),
        "expert_bytes": per,
        "depth": a.depth,
        "setup_seconds": round(setup_s, 1),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.release()}",
        "modes": results,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``coli bench storage``: expert-shaped random reads through each reader backend vs fio.

Each pass reads ``reads`` random extents of ``block`` bytes (one expert: taken from the
container's manifest when a model directory is given, else 19 MiB) from a cold cache, with
``queue_depth`` reads in flight, through one backend. Backends and fio run interleaved
(pass 1 of every backend, then pass 2, ...) because a virtual disk's bandwidth swings minute to
minute; the medians are reported. ``figure`` is the best backend's median GB/s divided by fio's
median GB/s for the same block size, queue depth and O_DIRECT (None, with a reason, without fio).

A pass must last ``min_pass_s`` (0.2 s by default): fio reports its runtime in whole
milliseconds, so a pass of a few ms (a small model's 48 KiB experts) swung fio's GB/s by 10-60%
from run to run. When the first round's shortest pass (any backend's, or fio's runtime) is
shorter, that round is thrown away and every pass, fio's included, reads more extents (one
plan, the same for all); ``reads`` is then a minimum and ``reads_per_pass`` says what was read.

Every round begins with a warm-up: one untimed pass over the round's extents (through the first
backend), so that every timed pass finds them in the same state. On a virtual disk the host
keeps a cache of its own that dropping the guest's page cache does not reach, and the first
pass over a round's extents ran at 0.3-2.0 GB/s where the passes after it read 1.4-2.6 on a
2-vCPU guest; with five contenders and three rounds fio never went first, so that cost fell on
the backends alone. ``warm_up=False`` (``--no-warm-up``) times the cold first pass too.

    python -m storage.bench FILE_OR_MODEL_DIR [--reads 200] [--qd 1] [--repeats 3] [--min-pass 0.2]

prints one line per pass and the JSON result as the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from storage.aligned import ALIGN, aligned_empty, huge_backed_bytes, hugepage_support, round_up
from storage.errors import ColibriError
from storage.manifest import read_manifest
from storage.reader import (
    _MEMORY_FS,
    Reader,
    ReaderKind,
    ReadRequest,
    aligned_extent,
    filesystem_type,
    open_reader,
    required_size,
)

__all__ = ["DEFAULT_BLOCK", "MIN_PASS_S", "bench_storage", "main", "make_test_file"]

DEFAULT_BLOCK = 19 * 1024 * 1024
ALL_BACKENDS = ("uring", "uring-fixed", "threads", "buffered")

# fio 3.x's JSON times a job only in whole ms ("runtime", "job_runtime"; its "lat_ns" /
# "clat_ns" are per-read latencies, whose sum is not the pass's length at a depth above 1 nor
# counts the time between reads), so its GB/s is off by up to 1 ms / runtime. Rather than
# estimate a pass from latencies, passes are made long: at MIN_PASS_S the whole-ms error is
# at most 0.5%, and a pass of a few ms is short against a virtual disk's jitter anyway.
MIN_PASS_S = 0.2
QUANT_WARN = 0.02  # a kept fio pass whose whole-ms error can exceed this is reported
MAX_READS = 200_000  # the most reads one pass is grown to
MAX_PROBES = 4  # rounds thrown away while growing a pass


def make_test_file(path: str | os.PathLike[str], nbytes: int) -> Path:
    """Write ``nbytes`` of incompressible data to ``path`` (for benchmarking without a model)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    chunk = 64 << 20
    rng = np.random.default_rng(0)
    with open(p, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(chunk, left)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return p


def _targets(target: Path, block: int | None) -> tuple[list[tuple[Path, int, int]], int, str]:
    """(candidate extents (path, offset, length), block, where they came from)."""
    if not target.exists():
        raise ColibriError(f"{target} does not exist; pass a model directory or a big file")
    if target.is_dir():
        man = read_manifest(target)
        if man is not None and man.experts:
            ext = [(target / e.shard, e.start, e.end - e.start) for e in man.experts]
            size = block or max(n for _, _, n in ext)
            if block is None:
                return ext, size, f"{len(ext)} expert extents from the manifest"
        elif block is None:
            # a model without a manifest (the public container, a synthetic one) has its
            # experts in the shard headers: random offsets over every file read the small
            # non-expert shards again and again (the buffered backend from the page cache)
            found = _header_experts(target)
            if found:
                size = max(n for _, _, n in found)
                return found, size, f"{len(found)} expert extents from the shard headers"
        files = sorted(p for p in target.iterdir() if p.suffix == ".safetensors")
        if not files:
            raise ColibriError(
                f"{target}: no manifest experts and no .safetensors files to read; pass a model "
                "directory or a big file"
            )
    else:
        files = [target]
    size = block or DEFAULT_BLOCK
    ext = []
    for f in files:
        n = f.stat().st_size
        if n >= size:
            ext.append((f, n, size))  # (path, file size, block): offsets drawn per read
    if not ext:
        raise ColibriError(
            f"no file under {target} holds one {size}-byte block; pass a smaller --block or a "
            "bigger file"
        )
    return ext, size, "random 4 KiB-aligned offsets"


def _header_experts(target: Path) -> list[tuple[Path, int, int]]:
    """Every routed expert's blob extent as the container's headers place it ([] when the
    directory does not open as a model)."""
    from storage.container import Container

    try:
        c = Container.open(target)
    except (ColibriError, OSError):
        return []
    return [(x.path, x.start, x.end - x.start) for x in c.expert_extents()]


def _lengths(ext: list[tuple[Path, int, int]]) -> dict[str, int]:
    """Smallest, median and largest length of the reads drawn from ``ext``."""
    sizes = sorted(n for _, _, n in ext)
    return {"min": sizes[0], "median": sizes[len(sizes) // 2], "max": sizes[-1]}


def _plan(
    ext: list[tuple[Path, int, int]], source: str, reads: int, seed: int
) -> list[ReadRequest]:
    rng = np.random.default_rng(seed)
    out = []
    # random offsets: a file drawn by its size (uniformly, a small file's few blocks were read
    # again and again, from the page cache for the buffered backend, as one "cold" pass)
    weights = None
    if source.startswith("random"):
        sizes = np.array([a - b + ALIGN for _, a, b in ext], dtype=np.float64)
        weights = sizes / sizes.sum()
    for _ in range(reads):
        path, a, b = ext[int(rng.choice(len(ext), p=weights))]
        if source.startswith("random"):
            off = int(rng.integers(0, (a - b) // ALIGN + 1)) * ALIGN
            out.append(ReadRequest(path, off, b))
        else:
            out.append(ReadRequest(path, a, b))
    return out


def _drop_caches(files: Sequence[Path], as_root: bool) -> str:
    """Make the next reads come from the device; returns how."""
    if as_root:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "dropped (echo 3 > /proc/sys/vm/drop_caches)"
        except OSError:
            pass
    for p in files:
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:
            return "not dropped (no root, fadvise failed)"
    return "posix_fadvise DONTNEED per file (not root: other cached data stays)"


async def _one_pass(reader: Reader, reqs: Sequence[ReadRequest], bufs: Sequence[Any]) -> float:
    """Seconds for all ``reqs`` with ``len(bufs)`` reads in flight."""
    todo = iter(reqs)

    async def worker(buf: Any) -> None:
        for req in todo:
            await reader.read_into(req, buf)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for b in bufs:
            tg.start_soon(worker, b)
    return time.perf_counter() - t0


def _fio_engine() -> str:
    try:
        out = subprocess.run(["fio", "--enghelp"], capture_output=True, text=True, timeout=30)
        names = out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError):
        return "psync"
    for eng in ("io_uring", "libaio"):
        if eng in names:
            return eng
    return "psync"


# fio's buffers come from malloc, without transparent huge pages; numpy's get them (and ours
# are 2 MiB aligned), which on a virtio disk made fio look 25-40% slower than Python on the same
# extents. glibc's tunable gives fio huge pages too, so the baseline is fair.
FIO_ENV = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def _fio(reqs: Sequence[ReadRequest], qd: int, engine: str, workdir: Path) -> dict[str, Any]:
    """fio replaying exactly ``reqs`` (their aligned supersets) with O_DIRECT at depth ``qd``."""
    log = workdir / "colibri.iolog"
    files = sorted({r.path for r in reqs})
    with open(log, "w", encoding="utf-8") as f:
        f.write("fio version 2 iolog\n")
        for p in files:
            f.write(f"{p} add\n")
        for p in files:
            f.write(f"{p} open\n")
        for r in reqs:
            off, _, span = aligned_extent(r)
            f.write(f"{r.path} read {off} {span}\n")
        for p in files:
            f.write(f"{p} close\n")
    cmd = [
        "fio", "--name=colibri", f"--read_iolog={log}", "--replay_no_stall=1", "--direct=1",
        f"--ioengine={engine}", f"--iodepth={qd}", "--iomem_align=2097152",
        "--output-format=json",
    ]  # fmt: skip
    t0 = time.perf_counter()
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, **FIO_ENV}
    )
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"fio failed ({res.returncode}): {res.stderr.strip()[-300:]}")
    job = json.loads(res.stdout[res.stdout.index("{") :])["jobs"][0]
    rd = job["read"]
    cpu = (float(job.get("usr_cpu", 0.0)) + float(job.get("sys_cpu", 0.0))) / 100.0
    # The bytes of every read it replayed over its runtime: replaying an iolog at depth N,
    # fio leaves the last N - 1 reads out of io_bytes / bw_bytes (not out of total_ios or the
    # runtime), which put the baseline 3% low at depth 4, 30% at 32, and at 0 with --qd >=
    # --reads (a figure of 3.2 where the true one was ~1).
    want = sum(aligned_extent(r)[2] for r in reqs)
    ios, runtime_ms = int(rd.get("total_ios", 0)), float(rd.get("runtime", 0))
    if ios != len(reqs):
        raise RuntimeError(f"fio replayed {ios} of the {len(reqs)} reads")
    # runtime_ms is whole ms; a 0 ms pass has no GB/s (the caller grows the pass or refuses it)
    gbps = want / (runtime_ms / 1e3) / 1e9 if runtime_ms > 0 else 0.0
    return {"gbps": gbps, "bytes": want, "wall_s": wall, "cpu": cpu, "runtime_ms": runtime_ms}


def quantization(runtime_ms: float) -> float:
    """The most a pass's GB/s can be off when its runtime is counted in whole ms (1 ms of it)."""
    return 1.0 if runtime_ms <= 0 else 1.0 / runtime_ms


def grown_reads(reads: int, shortest_s: float, min_pass_s: float) -> int:
    """Reads for a pass of ``min_pass_s`` when ``reads`` of them took ``shortest_s``, half as
    many again (a read costs less in a longer pass: fio's went from 145 to 95 us on the demo):
    at most 1000 times as many (a 0 ms pass counts as half a ms), never fewer than
    ``reads + 1``, never more than ``MAX_READS``."""
    factor = min(1000.0, 1.5 * min_pass_s / max(shortest_s, 5e-4))
    return min(MAX_READS, max(reads + 1, math.ceil(reads * factor)))


def _machine(target: Path) -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "fs": filesystem_type(target),
        "python": platform.python_version(),
    }


async def bench_storage(
    model_dir_or_file: str | os.PathLike[str],
    *,
    backends: Sequence[str] = ALL_BACKENDS,
    reads: int = 200,
    block: int | None = None,
    queue_depth: int = 1,
    repeats: int = 3,
    drop_caches: bool | None = None,
    fio: bool = True,
    seed: int = 0,
    log: Any = None,
    huge: bool = True,
    min_pass_s: float = MIN_PASS_S,
    warm_up: bool = True,
) -> dict[str, Any]:
    """Benchmark reader backends (and fio) on expert-shaped cold random reads; see module doc.

    ``backends`` may name ``uring``, ``uring-fixed`` (io_uring with registered buffers),
    ``threads`` and ``buffered``. ``drop_caches`` defaults to True when running as root (else
    per-file ``posix_fadvise(DONTNEED)``). ``log`` is called with one line per pass.
    ``reads`` is a minimum: while the first round's shortest pass lasts under ``min_pass_s``
    (0: never), that round is dropped and every pass reads more (``reads_per_pass``).
    ``warm_up``: an untimed pass over each round's extents before its timed ones (see the
    module docstring).
    """
    target = Path(model_dir_or_file)
    if min_pass_s < 0 or not math.isfinite(min_pass_s):
        raise ColibriError(f"--min-pass must be 0 or more seconds, got {min_pass_s}")
    if block is not None and (block <= 0 or block % ALIGN):
        # an O_DIRECT read moves whole 4 KiB pages: a backend would be credited fewer bytes
        # than it (and fio, replaying the aligned spans) moved, and the ratio compare unlike work
        raise ColibriError(f"--block must be a positive multiple of 4 KiB, got {block} bytes")
    ext, size, source = _targets(target, block)
    files = sorted({p for p, _, _ in ext})
    as_root = os.geteuid() == 0
    dropping = as_root if drop_caches is None else drop_caches
    say = log or (lambda _msg: None)

    readers: dict[str, Reader] = {}
    skipped: dict[str, str] = {}
    # the buffers the expert store uses: 2 MiB-aligned and advised for huge pages (``huge``)
    support = hugepage_support()
    bufs = [
        aligned_empty(round_up(size, ALIGN) + ALIGN, huge=huge and support.advise)
        for _ in range(queue_depth)
    ]
    for name in backends:
        kind: ReaderKind = "uring" if name == "uring-fixed" else name  # type: ignore[assignment]
        try:
            r = await open_reader(kind, probe_path=files[0], queue_depth=max(queue_depth, 1))
        except Exception as exc:  # report, do not abort the whole benchmark
            skipped[name] = str(exc)
            continue
        if name == "uring-fixed" and not r.register_buffers(bufs):
            skipped[name] = f"fixed buffers refused: {r.reason}"
            await r.aclose()
            continue
        readers[name] = r

    fio_path = shutil.which("fio") if fio else None
    fio_reason = "" if fio_path else ("fio not installed (apt-get install fio)" if fio else "off")
    engine = _fio_engine() if fio_path else ""
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in readers}
    fio_runs: list[dict[str, Any]] = []
    cache_how = "not dropped"
    in_memory = filesystem_type(files[0]) in _MEMORY_FS
    if in_memory:
        cache_how = f"in memory ({filesystem_type(files[0])}: every read is a RAM copy)"
    reads_used = reads
    distinct = 0
    probes: list[dict[str, Any]] = []  # rounds thrown away because a pass was too short
    warm_runs: list[float] = []  # GB/s of each round's untimed first pass
    # before every pass (the warm-up's too); not root: per-file fadvise, unless told not to
    # drop (--no-drop-caches)
    drops = not in_memory and (dropping or (drop_caches is None and not as_root))
    try:
        rep = 0
        while rep < repeats:
            reqs = _plan(ext, source, reads_used, seed + rep)
            distinct = len({(r.path, r.offset) for r in reqs})
            for req in reqs:
                if required_size(req) > bufs[0].nbytes:
                    raise ValueError(f"extent {req} larger than the block {size}")
            names = [*readers, "fio"]
            k = rep % len(names)  # rotate so no backend always goes first
            got: dict[str, dict[str, float]] = {}
            fio_got: dict[str, Any] | None = None
            gb = sum(q.length for q in reqs) / 1e9  # every pass of the round reads these
            warm_gbps: float | None = None
            if warm_up and readers:
                # untimed: the round's extents once, so every timed pass finds them alike
                first = next(iter(readers))
                if drops:
                    cache_how = await anyio.to_thread.run_sync(_drop_caches, files, dropping)
                warm_gbps = gb / await _one_pass(readers[first], reqs, bufs)
                say(f"warm-up {rep + 1} {first:12s} {warm_gbps:6.2f} GB/s  (not timed)")
            for name in names[k:] + names[:k]:
                if drops:
                    cache_how = await anyio.to_thread.run_sync(_drop_caches, files, dropping)
                if name != "fio":
                    c0 = time.process_time()
                    wall = await _one_pass(readers[name], reqs, bufs)
                    cpu = (time.process_time() - c0) / wall
                    got[name] = {"gbps": gb / wall, "wall_s": wall, "cpu": cpu}
                    say(
                        f"pass {rep + 1} {name:12s} {gb / wall:6.2f} GB/s  cpu {cpu:5.0%}  "
                        f"{wall:6.3f} s"
                    )
                    continue
                if not fio_path:
                    continue
                try:
                    with tempfile.TemporaryDirectory(prefix="colibri-fio-") as tmp:
                        fio_got = await anyio.to_thread.run_sync(
                            _fio, reqs, queue_depth, engine, Path(tmp)
                        )
                except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:
                    fio_reason = str(exc)
                    fio_path = None
                else:
                    say(
                        f"pass {rep + 1} {'fio ' + engine:12s} {fio_got['gbps']:6.2f} GB/s  "
                        f"{'':9s}  {fio_got['runtime_ms'] / 1e3:6.3f} s"
                    )
            # fio's pass by its runtime (whole ms), the backends' by the clock
            lengths = [g["wall_s"] for g in got.values()]
            if fio_got is not None:
                lengths.append(fio_got["runtime_ms"] / 1e3)
            shortest = min(lengths, default=None)
            if (
                rep == 0
                and shortest is not None
                and shortest < min_pass_s
                and reads_used < MAX_READS
                and len(probes) < MAX_PROBES
            ):
                # too short to time honestly: throw the round away and read more, every
                # contender the same plan (fio replays it), so all move the same bytes
                grown = grown_reads(reads_used, shortest, min_pass_s)
                probes.append({"reads": reads_used, "shortest_pass_s": shortest})
                say(
                    f"extending: the shortest pass of {reads_used} reads took "
                    f"{shortest * 1e3:.1f} ms (< {min_pass_s:g} s); again with {grown} reads"
                )
                reads_used = grown
                continue
            if fio_got is not None and fio_got["runtime_ms"] <= 0:
                fio_reason = (
                    "fio's pass was too short to time (it counts whole ms): more --reads, or "
                    "a longer --min-pass"
                )
                fio_path = None
                fio_got = None
            for name, g in got.items():
                runs[name].append(g)
            if fio_got is not None:
                fio_runs.append(fio_got)
            if warm_gbps is not None:
                warm_runs.append(warm_gbps)
            rep += 1
    finally:
        reasons = {n: r.reason for n, r in readers.items()}
        directs = {n: r.direct for n, r in readers.items()}
        for r in readers.values():
            await r.aclose()

    out_backends: dict[str, Any] = {}
    for name, rs in runs.items():
        out_backends[name] = {
            "gbps_median": statistics.median(x["gbps"] for x in rs),
            "gbps_runs": [round(x["gbps"], 3) for x in rs],
            "cpu_median": statistics.median(x["cpu"] for x in rs),
            "pass_s_median": statistics.median(x["wall_s"] for x in rs),
            "direct": directs[name],
            "reason": reasons[name],
        }
    # fio reads with O_DIRECT: only a backend that does too is compared with it (a page-cache
    # backend serves repeated extents and readahead from RAM and would set the figure)
    direct_backends = [n for n in out_backends if out_backends[n]["direct"]]
    best = max(direct_backends, key=lambda n: out_backends[n]["gbps_median"], default=None)
    fio_out: dict[str, Any] | None = None
    figure: float | None = None
    # the most fio's whole-ms runtimes can move its GB/s (1 ms of its shortest pass)
    q = max((quantization(x["runtime_ms"]) for x in fio_runs), default=0.0)
    fio_failed = fio_reason  # a pass that failed after others ran
    if fio_runs and len(fio_runs) < repeats:
        fio_reason = (
            f"fio ran {len(fio_runs)} of {repeats} passes ({fio_failed or 'it stopped'}): the "
            "ratio would compare unlike passes"
        )
    elif fio_runs:
        fio_med = statistics.median(x["gbps"] for x in fio_runs)
        fio_out = {
            "engine": engine,
            "env": FIO_ENV,
            "extents": "the same extents as the backends (iolog replay), O_DIRECT",
            "gbps_median": fio_med,
            "gbps_runs": [round(x["gbps"], 3) for x in fio_runs],
            "cpu_median": statistics.median(x["cpu"] for x in fio_runs),
            # fio's own runtime per pass, whole ms; its GB/s can be off by 1 ms of it at most
            "runtime_ms_runs": [x["runtime_ms"] for x in fio_runs],
            "quantization_max": q,
        }
        if best is not None and fio_med > 0:
            figure = out_backends[best]["gbps_median"] / fio_med
            fio_reason = ""
        elif best is None:
            fio_reason = "no backend read with O_DIRECT, as fio does"
    if fio_runs and fio_out is None:
        fio_out = {
            "engine": engine,
            "gbps_runs": [round(x["gbps"], 3) for x in fio_runs],
            "failed": fio_failed or None,
        }
    elif not fio_runs and not fio_reason:
        fio_reason = "fio produced no result"
    lengths = [x["wall_s"] for rs in runs.values() for x in rs]
    lengths += [x["runtime_ms"] / 1e3 for x in fio_runs]
    warnings = []
    if lengths and min(lengths) < min_pass_s:
        warnings.append(
            f"the shortest pass took {min(lengths):.3f} s, under --min-pass {min_pass_s:g} s "
            + (
                f"(reads stop growing at {MAX_READS})"
                if reads_used >= MAX_READS
                else "(the disk sped up after the first round)"
            )
        )
    if q > QUANT_WARN:
        warnings.append(
            f"fio's shortest pass took {min(x['runtime_ms'] for x in fio_runs):g} ms, timed in "
            f"whole ms: its GB/s may be off by up to {q:.0%} (raise --min-pass or --reads)"
        )
    pass_s = (
        {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)}
        if lengths
        else None
    )
    say(
        f"reads per pass {reads_used}"
        + (f" (asked {reads}, extended to passes of >= {min_pass_s:g} s)" if probes else "")
        + (f"; passes {pass_s['min']:.3f}-{pass_s['max']:.3f} s" if pass_s else "")
        + (f"; fio timed in whole ms: error <= {q:.2%}" if fio_runs else "")
    )
    for w in warnings:
        say(f"warning: {w}")
    return {
        "target": str(target),
        "files": [str(p) for p in files],
        "extents": source,
        "block": size,
        # the reads' lengths: expert extents differ in size (an int8 MTP layer's are about
        # twice a main one's); ``block`` is the largest, the buffer each read goes into
        "read_bytes": _lengths(ext),
        "reads": reads,  # as asked: a minimum, see reads_per_pass
        # the reads of every kept pass, backends' and fio's alike: more than ``reads`` when a
        # pass of ``reads`` lasted under ``min_pass_s`` (``extended`` lists the rounds dropped)
        "reads_per_pass": reads_used,
        "distinct_extents": distinct,  # in the last pass; fio replays the repeats too
        "min_pass_s": min_pass_s,
        "extended": probes,
        "pass_s": pass_s,
        "warnings": warnings,
        "queue_depth": queue_depth,
        "repeats": repeats,
        # an untimed pass over each round's extents before its timed ones (None: not made)
        "warm_up": {
            "backend": next(iter(readers), None),
            "gbps_runs": [round(g, 3) for g in warm_runs],
        }
        if warm_up
        else None,
        "cache": cache_how,
        "machine": _machine(files[0]),
        "backends": out_backends,
        "skipped": skipped,
        "fio": fio_out,
        "best_backend": best,
        "figure": figure,
        "figure_reason": fio_reason or None,
        "hugepages": {
            **support.as_dict(),
            "asked": huge and support.advise,
            "buffer_bytes": sum(int(b.nbytes) for b in bufs),
            "huge_backed_bytes": huge_backed_bytes(bufs),
        },
    }


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m storage.bench``: run :func:`bench_storage`, JSON on the last line."""
    ap = argparse.ArgumentParser(prog="python -m storage.bench", description=__doc__)
    ap.add_argument("target", help="a model directory or any big file")
    ap.add_argument("--backends", default=",".join(ALL_BACKENDS))
    ap.add_argument("--reads", type=int, default=200)
    ap.add_argument("--block", type=_size, default=None, help="bytes per read (e.g. 19MiB)")
    ap.add_argument("--qd", type=int, default=1, help="reads in flight")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--min-pass",
        type=float,
        default=MIN_PASS_S,
        help="seconds a pass must last; shorter, every pass reads more (0: never)",
    )
    ap.add_argument("--no-drop-caches", action="store_true")
    ap.add_argument(
        "--no-warm-up", action="store_true", help="time each round's cold first pass too"
    )
    ap.add_argument("--no-fio", action="store_true")
    ap.add_argument("--no-huge", action="store_true", help="read into ordinary numpy buffers")
    ap.add_argument("--create", type=_size, default=None, help="first write a test file this big")
    args = ap.parse_args(argv)
    target = Path(args.target)
    if args.create and not target.exists():
        print(f"writing {args.create >> 20} MiB test file {target}", file=sys.stderr)
        make_test_file(target, args.create)
    result = anyio.run(
        lambda: bench_storage(
            target,
            backends=[b for b in args.backends.split(",") if b],
            reads=args.reads,
            block=args.block,
            queue_depth=args.qd,
            repeats=args.repeats,
            drop_caches=False if args.no_drop_caches else None,
            fio=not args.no_fio,
            log=lambda m: print(m, file=sys.stderr, flush=True),
            huge=not args.no_huge,
            min_pass_s=args.min_pass,
            warm_up=not args.no_warm_up,
        )
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Bandwidth probes per copy and :func:`open_placement`, which builds the engine's
:class:`~storage.multidisk.placement.Placement` (see :mod:`storage.multidisk`)."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt
import structlog

from storage.aligned import ALIGN, aligned_empty, round_up
from storage.container import Container
from storage.manifest import atomic_write_bytes
from storage.multidisk.identity import (
    DeviceId,
    ModelCopy,
    compare_copy_file,
    device_of,
    header_bytes,
    open_copies,
)
from storage.multidisk.placement import (
    ADAPT_THRESHOLD,
    EWMA_ALPHA,
    Placement,
    adapt_weights,
    ewma,
    parse_weights,
    rendezvous_order,
    stripe_pieces,
)
from storage.reader import direct_io_problem

__all__ = [
    "ADAPT_THRESHOLD",
    "EWMA_ALPHA",
    "PROBE_CACHE_FILE",
    "DeviceId",
    "ModelCopy",
    "Placement",
    "adapt_weights",
    "compare_copy_file",
    "device_of",
    "ewma",
    "header_bytes",
    "open_copies",
    "open_placement",
    "parse_weights",
    "probe_read_bandwidth",
    "probe_weights",
    "rendezvous_order",
    "stripe_pieces",
]

PROBE_CACHE_FILE = ".coli_devices.json"
PROBE_CACHE_VERSION = 2  # 2: a warm-up read, then timed reads for >= PROBE_SECONDS
PROBE_READS = 4  # timed reads at least
PROBE_MAX_READS = 32  # timed reads at most
PROBE_SECONDS = 0.5  # keep reading (up to PROBE_MAX_READS) until this much time was measured
PROBE_DEPTH = 4  # reads in flight while probing (the engine keeps several in flight too)

U8Array = npt.NDArray[np.uint8]

_log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------- probing
def _probe_file(files: Sequence[Path]) -> Path | None:
    best: tuple[int, Path] | None = None
    for p in files:
        try:
            size = p.stat().st_size
        except OSError:
            continue
        if best is None or size > best[0]:
            best = (size, p)
    return None if best is None else best[1]


def probe_read_bandwidth(
    path: Path,
    block: int,
    reads: int = PROBE_READS,
    *,
    direct: bool = True,
    seconds: float = PROBE_SECONDS,
    max_reads: int = PROBE_MAX_READS,
    depth: int = PROBE_DEPTH,
) -> float:
    """Sustained bytes/s of ``block``-sized reads spread over ``path`` (blocking).

    One untimed warm-up read, then at least ``reads`` timed reads with ``depth`` in flight
    (threads), continuing until ``seconds`` were measured or ``max_reads`` were made. Each part
    matters: a drive (or a throttle) that was idle lets a first burst through faster than it
    can sustain; one read at a time leaves the device idle between reads (a loss that grows
    with its speed, so the faster drive was underweighted); a probe of a few reads measured
    noise. At NVMe speeds the probe stays well under ``seconds``; it is cached per device.
    O_DIRECT when ``direct`` and the filesystem allows it (the page cache would measure RAM),
    buffered otherwise. Raises ``OSError`` when the file cannot be read."""
    size = path.stat().st_size
    block = max(ALIGN, min(round_up(block), size - size % ALIGN or ALIGN))
    flags = os.O_RDONLY | os.O_CLOEXEC
    fd = -1
    if direct:
        try:
            fd = os.open(path, flags | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    if fd < 0:
        fd = os.open(path, flags)
    depth = max(1, depth)
    bufs = [aligned_empty(block) for _ in range(depth)]
    span = max(size - block, 0)
    n_max = max(reads, max_reads) + 1
    # Spread over the file in a scattered order (golden-ratio steps), the warm-up first.
    offsets = [int(span * ((k * 0.6180339887) % 1.0)) // ALIGN * ALIGN for k in range(n_max)]
    lock = threading.Lock()
    state = {"next": 1, "done": 0, "bytes": 0}  # next offset index, reads done, bytes read
    end = [0.0]  # when the last timed read finished

    def worker(buf: U8Array, t0: float) -> None:
        while True:
            with lock:
                k = state["next"]
                if k >= n_max or (state["done"] >= reads and time.perf_counter() - t0 >= seconds):
                    return
                state["next"] = k + 1
            n = os.preadv(fd, [buf.data], offsets[k])
            with lock:
                if n <= 0:
                    state["next"] = n_max
                    return
                state["done"] += 1
                state["bytes"] += n
                end[0] = max(end[0], time.perf_counter())

    try:
        os.preadv(fd, [bufs[0].data], offsets[0])  # warm-up: not timed
        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(b, t0), daemon=True) for b in bufs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    total = state["bytes"]
    dt = end[0] - t0
    if total <= 0:
        raise OSError(errno.EIO, f"nothing could be read from {path}")
    return total / max(dt, 1e-9)


def _load_probe_cache(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("version") != PROBE_CACHE_VERSION:
        return {}
    devices = doc.get("devices")
    return dict(devices) if isinstance(devices, dict) else {}


def probe_weights(
    copies: Sequence[ModelCopy],
    block: int,
    *,
    cache_path: Path | None,
    direct: bool = True,
) -> tuple[float, ...]:
    """Per-copy read bandwidth in GB/s, probed once per device and cached (blocking).

    The cache (``.coli_devices.json``) keys each device by :attr:`DeviceId.key` with its mount
    point and keeps the ``st_dev`` and block size it was measured with: a device whose id or the
    block changed is probed again. Copies holding no file weigh 0."""
    cache = _load_probe_cache(cache_path) if cache_path is not None else {}
    changed = False
    out: list[float] = []
    for r in copies:
        target = _probe_file(list(r.files.values()))
        if target is None or r.device is None:
            out.append(0.0)
            continue
        key = f"{r.device.key}|{r.device.mount}"
        hit = cache.get(key)
        if (
            isinstance(hit, dict)
            and hit.get("st_dev") == r.device.st_dev
            and hit.get("block") == block
            and isinstance(hit.get("bytes_per_s"), (int, float))
            and hit["bytes_per_s"] > 0
        ):
            out.append(float(hit["bytes_per_s"]) / 1e9)
            continue
        try:
            bps = probe_read_bandwidth(target, block, direct=direct)
        except OSError as exc:
            _log.warning("disk probe failed", file=str(target), error=str(exc))
            out.append(0.0)
            continue
        cache[key] = {
            "st_dev": r.device.st_dev,
            "name": r.device.name,
            "mount": r.device.mount,
            "block": block,
            "bytes_per_s": bps,
            "probed_at": time.time(),
        }
        changed = True
        _log.info("disk probed", device=r.device.key, file=str(target), gb_per_s=bps / 1e9)
        out.append(bps / 1e9)
    if changed and cache_path is not None:
        doc = {"version": PROBE_CACHE_VERSION, "devices": cache}
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(
                cache_path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
            )
        except OSError as exc:
            _log.info("disk probe cache not saved", path=str(cache_path), error=str(exc))
    if not any(w > 0 for w in out):  # nothing measurable: fall back to the primary alone
        out = [1.0] + [0.0] * (len(out) - 1)
    return tuple(out)


async def open_placement(
    container: Container,
    mirrors: Sequence[Path],
    *,
    weights: Sequence[float] | None = None,
    adapt: bool = True,
    stripe_min_bytes: int = 0,
    state_dir: Path | None = None,
    direct: bool = True,
) -> Placement:
    """The :class:`Placement` for ``container`` and its ``mirrors`` (off the event loop).

    ``weights`` (primary first) are used as declared; otherwise each device is probed with a few
    expert-sized reads (cached in ``state_dir``). ``direct``: the reader uses O_DIRECT, so a
    mirror whose filesystem refuses it is left unused (with a warning)."""
    shard_files = [s.path for s in container.shards]
    sums = container.shard_checksums()
    copies = await anyio.to_thread.run_sync(
        open_copies, container.path, shard_files, list(mirrors), sums
    )
    if direct:
        checked: list[ModelCopy] = [copies[0]]
        for r in copies[1:]:
            sample = next(iter(r.files.values()), None)
            refused = (
                None
                if sample is None
                else await anyio.to_thread.run_sync(direct_io_problem, sample)
            )
            if refused is not None:
                _log.warning(
                    "mirror unused",
                    mirror=str(r.root),
                    reason=f"{refused}; the reader uses O_DIRECT (try --reader buffered)",
                )
                r = ModelCopy(r.index, r.root, r.device, {}, {"*": refused})
            checked.append(r)
        copies = checked
    if len(copies) == 1:
        return Placement(copies, (1.0,), source="single", adapt=False)
    if weights is not None:
        return Placement(
            copies, weights, source="declared", adapt=adapt, stripe_min_bytes=stripe_min_bytes
        )
    block = round_up(max(container.expert_nbytes, ALIGN))
    cache = state_dir / PROBE_CACHE_FILE if state_dir is not None else None
    probed = await anyio.to_thread.run_sync(
        lambda: probe_weights(copies, block, cache_path=cache, direct=direct)
    )
    _log.info("disk weights probed", gb_per_s=[round(w, 3) for w in probed])
    return Placement(
        copies, probed, source="probed", adapt=adapt, stripe_min_bytes=stripe_min_bytes
    )

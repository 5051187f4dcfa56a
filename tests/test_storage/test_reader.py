"""Expert reader backends on real files on a real disk (no mocks of io_uring or the OS).

Every backend available here is run under asyncio and trio. Errors are produced by the real
kernel: extents past EOF, a file truncated under a cached descriptor, a directory, a missing
file, a descriptor closed behind the reader's back.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from storage.aligned import ALIGN, SlabPool, aligned_empty, is_aligned, round_up
from storage.errors import ColibriError, ReadError
from storage.reader import (
    Reader,
    ReadRequest,
    _liburing_usable,
    filesystem_type,
    open_reader,
    required_size,
)

ROOT = Path(__file__).resolve().parents[2]
MEMORY_FS = {"tmpfs", "ramfs"}
FILE_SIZE = 6 * 1024 * 1024 + 123  # deliberately not a multiple of 4 KiB
BACKENDS = ["uring", "threads", "buffered"]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _disk_base() -> Path:
    """A directory on a real block-device filesystem (not tmpfs): O_DIRECT must mean it."""
    for cand in (ROOT / "tests" / ".cache", Path("/var/tmp"), Path(tempfile.gettempdir())):
        try:
            cand.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if filesystem_type(cand) not in MEMORY_FS and os.access(cand, os.W_OK):
            return cand
    pytest.skip("no writable directory on a disk-backed filesystem")


def _tmpfs_base() -> Path | None:
    for cand in (Path("/dev/shm"), Path("/run/shm")):
        if cand.is_dir() and filesystem_type(cand) == "tmpfs" and os.access(cand, os.W_OK):
            return cand
    return None


@pytest.fixture(scope="module")
def disk_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="colibri-reader-", dir=_disk_base()))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def data_file(disk_dir: Path) -> tuple[Path, bytes]:
    data = np.random.default_rng(1234).integers(0, 256, FILE_SIZE, dtype=np.uint8).tobytes()
    p = disk_dir / "shard.bin"
    p.write_bytes(data)
    return p, data


@pytest.fixture
async def reader(
    request: pytest.FixtureRequest, data_file: tuple[Path, bytes], anyio_backend: str
) -> AsyncIterator[Reader]:
    kind = request.param
    try:
        r = await open_reader(kind, probe_path=data_file[0], queue_depth=16)
    except ReadError as exc:  # io_uring blocked (seccomp, io_uring_disabled, old kernel)
        pytest.skip(f"{kind} backend unavailable here: {exc}")
    try:
        yield r
    finally:
        await r.aclose()


def _extents(size: int, n: int, seed: int) -> list[ReadRequest]:
    """Random extents plus the awkward ones: 4 KiB boundaries, EOF, tiny and empty."""
    rng = np.random.default_rng(seed)
    p = Path("x")
    fixed = [
        (0, 1),
        (0, ALIGN),
        (ALIGN - 1, 2),
        (ALIGN, ALIGN),
        (ALIGN + 1, 3 * ALIGN),
        (size - 1, 1),
        (size - 123, 123),
        (size - ALIGN - 5, ALIGN + 5),
        (0, size),
        (17, 0),
    ]
    out = [ReadRequest(p, o, n) for o, n in fixed]
    for _ in range(n):
        off = int(rng.integers(0, size))
        length = int(rng.integers(1, min(size - off, 700_000) + 1))
        out.append(ReadRequest(p, off, length))
    return out


def _on(path: Path, reqs: list[ReadRequest]) -> list[ReadRequest]:
    return [ReadRequest(path, r.offset, r.length) for r in reqs]


# --------------------------------------------------------------------------- aligned buffers
def test_aligned_empty_alignment_and_size() -> None:
    for n in (0, 1, 4095, 4096, 4097, 1 << 20):
        for align in (512, 4096, 65536):
            a = aligned_empty(n, align)
            assert a.dtype == np.uint8 and a.ndim == 1
            assert n == 0 or is_aligned(a, align)
            assert a.nbytes == round_up(n, align)
    with pytest.raises(ValueError):
        aligned_empty(10, 3000)


@pytest.mark.anyio
async def test_slab_pool_waits_and_reuses() -> None:
    pool = SlabPool(10_000, 2)
    assert pool.slab_bytes == 3 * ALIGN and pool.nbytes == 2 * 3 * ALIGN
    assert all(is_aligned(b) for b in pool.buffers)
    a = await pool.acquire()
    b = await pool.acquire()
    assert pool.try_acquire() is None
    got: list[int] = []

    async def waiter() -> None:
        async with pool.slab() as buf:
            got.append(buf.ctypes.data)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.sleep(0.01)
        assert got == []  # still waiting: no slab free
        pool.release(a)
    assert got == [a.ctypes.data]
    pool.release(b)
    assert pool.available == 2
    with pytest.raises(ValueError):
        pool.release(b)
    with pytest.raises(ValueError):
        pool.release(aligned_empty(pool.slab_bytes))


# --------------------------------------------------------------------------- byte-exact reads
@pytest.mark.anyio
@pytest.mark.parametrize("reader", BACKENDS, indirect=True)
async def test_random_extents_byte_exact(reader: Reader, data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    for req in _on(path, _extents(len(data), 40, seed=1)):
        buf = aligned_empty(required_size(req))
        view = await reader.read_into(req, buf)
        assert bytes(view) == data[req.offset : req.offset + req.length], req
        # zero-copy: the view lives inside the caller's buffer
        if req.length:
            assert view.ctypes.data == buf.ctypes.data + req.offset % ALIGN
    assert reader.stats.errors == 0
    assert reader.stats.bytes == sum(r.length for r in _extents(len(data), 40, seed=1))


@pytest.mark.anyio
@pytest.mark.parametrize("reader", BACKENDS, indirect=True)
async def test_read_many_64_in_flight(reader: Reader, data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    reqs = _on(path, _extents(len(data), 54, seed=2))
    assert len(reqs) == 64
    bufs = [aligned_empty(required_size(r)) for r in reqs]
    views = await reader.read_many(reqs, bufs)
    for req, view in zip(reqs, views, strict=True):
        assert bytes(view) == data[req.offset : req.offset + req.length]
    assert reader.stats.reads == 64
    assert reader.stats.in_flight_peak > 1


@pytest.mark.anyio
@pytest.mark.parametrize("reader", BACKENDS, indirect=True)
async def test_many_concurrent_callers(reader: Reader, data_file: tuple[Path, bytes]) -> None:
    """Independent tasks reading at once (exercises the io_uring reaper hand-off)."""
    path, data = data_file
    reqs = _on(path, _extents(len(data), 30, seed=3))
    bad: list[ReadRequest] = []

    async def one(req: ReadRequest, delay: float) -> None:
        await anyio.sleep(delay)
        buf = aligned_empty(required_size(req))
        view = await reader.read_into(req, buf)
        if bytes(view) != data[req.offset : req.offset + req.length]:
            bad.append(req)

    async with anyio.create_task_group() as tg:
        for i, req in enumerate(reqs):
            tg.start_soon(one, req, (i % 5) * 0.001)
    assert bad == []


async def _uring(data_file: tuple[Path, bytes], depth: int) -> Any:
    try:
        return await open_reader("uring", probe_path=data_file[0], queue_depth=depth)
    except ReadError as exc:
        pytest.skip(f"uring backend unavailable here: {exc}")


@pytest.mark.anyio
async def test_uring_read_many_submits_an_experts_reads_at_once(
    data_file: tuple[Path, bytes],
) -> None:
    """An expert's reads (blob pieces, scales) go to the kernel in one io_uring_enter and are
    waited for together; one at a time they took one call each. Empty requests among them
    give empty views in place."""
    path, data = data_file
    r = await _uring(data_file, 16)
    try:
        reqs = [ReadRequest(path, 0, ALIGN)]  # (the first read of a file opens it)
        assert bytes((await r.read_many(reqs, [aligned_empty(ALIGN)]))[0]) == data[:ALIGN]
        reqs = [ReadRequest(path, o, n) for o, n in ((5, 300_000), (400_000, 4096),
                                                      (77, 0), (1_000_003, 123_457))]  # fmt: skip
        bufs = [aligned_empty(required_size(q)) for q in reqs]
        before, reads = r.submissions, r.stats.reads
        views = await r.read_many(reqs, bufs)
        assert r.submissions - before == 1
        for q, v in zip(reqs, views, strict=True):
            assert bytes(v) == data[q.offset : q.offset + q.length]
        assert views[2].size == 0
        assert r.stats.reads - reads == 4 and r.stats.errors == 0
        # the same reads as separate calls: one submission each
        before = r.submissions
        for q, b in zip(reqs, bufs, strict=True):
            if q.length:
                await r.read_into(q, b)
        assert r.submissions - before == 3
    finally:
        await r.aclose()


@pytest.mark.anyio
async def test_uring_read_many_beyond_free_slots_waits_its_turn(
    data_file: tuple[Path, bytes],
) -> None:
    """More reads than the ring has free slots (here: three callers of three reads each on a
    ring of four) go one task per read, waiting for slots; nobody holds part of the slots
    it needs while waiting for the rest, so nobody waits forever."""
    path, data = data_file
    r = await _uring(data_file, 4)
    try:
        await r.read_into(ReadRequest(path, 0, 1), aligned_empty(ALIGN))
        got: list[bool] = []

        async def caller(k: int) -> None:
            reqs = [ReadRequest(path, 700_000 * k + 200_000 * i, 150_000) for i in range(3)]
            views = await r.read_many(reqs, [aligned_empty(required_size(q)) for q in reqs])
            got.append(all(bytes(v) == data[q.offset : q.offset + q.length]
                           for q, v in zip(reqs, views, strict=True)))  # fmt: skip

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for k in range(3):
                    tg.start_soon(caller, k)
        assert got == [True] * 3
        assert r.stats.in_flight_peak <= 4
        six = [ReadRequest(path, 100_000 * i, 4096) for i in range(6)]
        views = await r.read_many(six, [aligned_empty(required_size(q)) for q in six])
        assert [bytes(v) for v in views] == [data[q.offset : q.offset + 4096] for q in six]
    finally:
        await r.aclose()


@pytest.mark.anyio
async def test_uring_read_many_with_failing_reads_waits_for_the_rest(
    data_file: tuple[Path, bytes],
) -> None:
    """Reads past the end of the file among good ones: every read finishes (the good ones'
    bytes are in their buffers), then one ReadError says how many failed and names the first."""
    path, data = data_file
    size = len(data)
    r = await _uring(data_file, 16)
    try:
        await r.read_into(ReadRequest(path, 0, 1), aligned_empty(ALIGN))
        good = ReadRequest(path, 12_345, 500_000)
        past = ReadRequest(path, size - 10, 20)
        past2 = ReadRequest(path, size - 100, 200)
        bufs = [aligned_empty(required_size(q)) for q in (good, past)]
        before = r.submissions
        with pytest.raises(ReadError, match=r"short read: the file ends at byte \d+") as ei:
            await r.read_many([good, past], bufs)
        assert r.submissions - before == 1
        assert f"offset {size - 10}" in str(ei.value)
        head = good.offset % ALIGN
        assert bytes(bufs[0][head : head + good.length]) == data[12_345 : 12_345 + 500_000]
        assert r.stats.errors == 1
        reqs = [past, good, past2]
        with pytest.raises(ReadError, match=f"2 of 3 reads failed; first: .*offset {size - 10}"):
            await r.read_many(reqs, [aligned_empty(required_size(q)) for q in reqs])
        assert r.stats.errors == 3
        ok = [good, ReadRequest(path, 0, 4096)]
        views = await r.read_many(ok, [aligned_empty(required_size(q)) for q in ok])
        assert bytes(views[1]) == data[:4096]
    finally:
        await r.aclose()


@pytest.mark.anyio
async def test_uring_read_many_cancelled_mid_batch_leaves_no_write_behind(
    data_file: tuple[Path, bytes], disk_dir: Path
) -> None:
    """A batch cancelled while its reads are on the device returns only once the kernel is
    done with every buffer: nothing is written into them afterwards."""
    r = await _uring(data_file, 16)
    big = disk_dir / f"batch-{os.getpid()}.bin"
    big.write_bytes(os.urandom(48 << 20))
    try:
        await r.read_into(ReadRequest(big, 0, 1), aligned_empty(ALIGN))
        reqs = [ReadRequest(big, i << 24, 16 << 20) for i in range(3)]
        for delay in (0.0, 0.0005, 0.002, 0.005):
            bufs = [aligned_empty(required_size(q)) for q in reqs]
            with anyio.move_on_after(delay):
                await r.read_many(reqs, bufs)
            for b in bufs:
                b[:] = 0xA5
            await anyio.sleep(0.05)
            assert all((b == 0xA5).all() for b in bufs), f"written after cancel ({delay})"
        views = await r.read_many(reqs, [aligned_empty(required_size(q)) for q in reqs])
        assert bytes(views[2][:64]) == big.read_bytes()[32 << 20 : (32 << 20) + 64]
    finally:
        await r.aclose()
        big.unlink()


# --------------------------------------------------------------------------- EOF and errors
@pytest.mark.anyio
@pytest.mark.parametrize("reader", BACKENDS, indirect=True)
async def test_short_read_at_eof(reader: Reader, data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    size = len(data)
    # The aligned superset runs past EOF; the extent itself ends exactly at EOF: fine.
    req = ReadRequest(path, size - 5000, 5000)
    view = await reader.read_into(req, aligned_empty(required_size(req)))
    assert bytes(view) == data[-5000:]
    # The extent itself runs past EOF: a clear ReadError naming the file and the extent.
    past = ReadRequest(path, size - 10, 20)
    with pytest.raises(ReadError, match=r"short read: the file ends at byte \d+") as ei:
        await reader.read_into(past, aligned_empty(required_size(past)))
    msg = str(ei.value)
    assert str(path) in msg and f"offset {size - 10}" in msg and "20 bytes" in msg
    errors = reader.stats.errors
    # ... and the reader still serves good reads.
    ok = ReadRequest(path, 4096, 100)
    assert bytes(await reader.read_into(ok, aligned_empty(required_size(ok)))) == data[4096:4196]
    assert reader.stats.errors == errors


@pytest.mark.anyio
@pytest.mark.parametrize("reader", BACKENDS, indirect=True)
async def test_injected_errors_leave_reader_usable(
    reader: Reader, data_file: tuple[Path, bytes], disk_dir: Path
) -> None:
    path, data = data_file
    good = ReadRequest(path, 12345, 54321)

    async def check_good() -> None:
        view = await reader.read_into(good, aligned_empty(required_size(good)))
        assert bytes(view) == data[12345 : 12345 + 54321]

    def buf_for(req: ReadRequest) -> np.ndarray:
        return aligned_empty(required_size(req))

    # a directory
    d = ReadRequest(disk_dir, 0, 100)
    with pytest.raises(ReadError, match="Is a directory"):
        await reader.read_into(d, buf_for(d))
    await check_good()

    # a missing file
    m = ReadRequest(disk_dir / "missing.bin", 0, 100)
    with pytest.raises(ReadError, match=r"No such file.*missing\.bin|missing\.bin.*No such file"):
        await reader.read_into(m, buf_for(m))
    await check_good()

    # a file truncated (and deleted) after the reader opened it
    victim = disk_dir / f"victim-{reader.name}-{os.getpid()}.bin"
    victim.write_bytes(data[: 1 << 20])
    v = ReadRequest(victim, 100_000, 200_000)
    assert bytes(await reader.read_into(v, buf_for(v))) == data[100_000:300_000]
    os.truncate(victim, 150_000)
    victim.unlink()
    with pytest.raises(ReadError, match="short read"):
        await reader.read_into(v, buf_for(v))
    await check_good()

    # a descriptor closed behind the reader's back -> EBADF; the next read reopens
    other = disk_dir / f"other-{reader.name}-{os.getpid()}.bin"
    other.write_bytes(data[: 1 << 20])
    o = ReadRequest(other, 0, 4096)
    await reader.read_into(o, buf_for(o))
    fd = reader._files.get(other)  # type: ignore[attr-defined]
    assert fd is not None
    os.close(fd)
    with pytest.raises(ReadError, match="Bad file descriptor"):
        await reader.read_into(o, buf_for(o))
    assert bytes(await reader.read_into(o, buf_for(o))) == data[:4096]
    other.unlink()
    await check_good()
    assert reader.stats.errors == 4


@pytest.mark.anyio
@pytest.mark.parametrize("reader", BACKENDS, indirect=True)
async def test_truncate_while_in_flight(
    reader: Reader, data_file: tuple[Path, bytes], disk_dir: Path
) -> None:
    """Truncating during reads yields data or ReadError, never anything else."""
    _, data = data_file
    victim = disk_dir / f"racing-{reader.name}-{os.getpid()}.bin"
    victim.write_bytes(data)
    reqs = [ReadRequest(victim, i * 400_000, 400_000) for i in range(12)]
    bufs = [aligned_empty(required_size(r)) for r in reqs]
    outcome: list[str] = []

    async def read_all() -> None:
        try:
            views = await reader.read_many(reqs, bufs)
        except ReadError as exc:
            assert "short read" in str(exc) or "failed" in str(exc)
            outcome.append("error")
        else:
            for r, view in zip(reqs, views, strict=True):
                assert bytes(view) == data[r.offset : r.offset + r.length]
            outcome.append("data")

    async with anyio.create_task_group() as tg:
        tg.start_soon(read_all)
        await anyio.sleep(0)
        await anyio.to_thread.run_sync(os.truncate, victim, 1_000_000)
    assert outcome in (["data"], ["error"])
    ok = ReadRequest(victim, 0, 1_000_000)
    assert bytes(await reader.read_into(ok, aligned_empty(required_size(ok)))) == data[:1_000_000]
    victim.unlink()


# --------------------------------------------------------------------------- cancellation
@pytest.mark.anyio
@pytest.mark.parametrize("reader", BACKENDS, indirect=True)
async def test_cancel_never_lets_the_kernel_write_later(
    reader: Reader, data_file: tuple[Path, bytes], disk_dir: Path
) -> None:
    path, data = data_file
    big = disk_dir / f"big-{reader.name}-{os.getpid()}.bin"
    big.write_bytes(os.urandom(32 << 20))  # long enough (~10 ms) to cancel mid-flight
    req = ReadRequest(big, 0, 32 << 20)
    for delay in (0.0, 0.0005, 0.002, 0.005):
        buf = aligned_empty(required_size(req))
        with anyio.move_on_after(delay):
            await reader.read_into(req, buf)
        # Once cancel returns nobody may write into buf: fill it and watch it stay put.
        buf[:] = 0xA5
        await anyio.sleep(0.05)
        assert (buf == 0xA5).all(), f"buffer written after cancel (delay {delay})"
    big.unlink()
    # many reads in flight, cancelled together
    reqs = _on(path, _extents(len(data), 30, seed=4))
    bufs = [aligned_empty(required_size(r)) for r in reqs]
    with anyio.move_on_after(0.001):
        await reader.read_many(reqs, bufs)
    for b in bufs:
        b[:] = 0x5A
    await anyio.sleep(0.05)
    assert all((b == 0x5A).all() for b in bufs)
    # still works afterwards
    views = await reader.read_many(reqs, bufs)
    for r, view in zip(reqs, views, strict=True):
        assert bytes(view) == data[r.offset : r.offset + r.length]


# --------------------------------------------------------------------------- selection, buffers
@pytest.mark.anyio
async def test_auto_picks_direct_on_disk(data_file: tuple[Path, bytes]) -> None:
    r = await open_reader("auto", probe_path=data_file[0].parent)
    try:
        assert r.direct
        assert r.name in ("uring", "threads")
        assert "O_DIRECT works" in r.reason
    finally:
        await r.aclose()


@pytest.mark.anyio
async def test_auto_picks_buffered_on_tmpfs() -> None:
    base = _tmpfs_base()
    if base is None:
        pytest.skip("no tmpfs mounted here")
    d = Path(tempfile.mkdtemp(prefix="colibri-reader-", dir=base))
    try:
        data = np.random.default_rng(5).integers(0, 256, 300_001, dtype=np.uint8).tobytes()
        (d / "s.bin").write_bytes(data)
        r = await open_reader("auto", probe_path=d)
        try:
            assert r.name == "buffered" and not r.direct
            assert "tmpfs" in r.reason
            for req in _on(d / "s.bin", _extents(len(data), 20, seed=6)):
                view = await r.read_into(req, aligned_empty(required_size(req)))
                assert bytes(view) == data[req.offset : req.offset + req.length]
            # buffered reads need no aligned buffer
            req = ReadRequest(d / "s.bin", 10, 100)
            unaligned = np.empty(required_size(req) + 1, np.uint8)[1:]
            assert bytes(await r.read_into(req, unaligned)) == data[10:110]
        finally:
            await r.aclose()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.anyio
@pytest.mark.parametrize("reader", ["uring", "threads"], indirect=True)
async def test_bad_buffers_are_programming_errors(
    reader: Reader, data_file: tuple[Path, bytes]
) -> None:
    req = ReadRequest(data_file[0], 10, 5000)
    with pytest.raises(ValueError, match="aligned"):
        await reader.read_into(req, aligned_empty(required_size(req) + ALIGN)[1:])
    with pytest.raises(ValueError, match="required_size"):
        await reader.read_into(req, aligned_empty(ALIGN))
    with pytest.raises(ValueError, match="uint8"):
        await reader.read_into(req, np.zeros(required_size(req), np.float32))
    assert reader.stats.errors == 0


@pytest.mark.anyio
@pytest.mark.parametrize("reader", ["uring"], indirect=True)
async def test_uring_fixed_buffers(reader: Reader, data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    pool = SlabPool(1 << 20, 4)
    if not reader.register_buffers([pool.region]):
        pytest.skip(f"fixed buffers refused here: {reader.reason}")
    assert "fixed buffers registered" in reader.reason
    assert reader._fixed_index(pool.buffers[1].ctypes.data, pool.slab_bytes) == 0  # type: ignore[attr-defined]
    reqs = _on(path, [r for r in _extents(len(data), 40, seed=7) if required_size(r) <= 1 << 20])

    async def one(req: ReadRequest) -> None:
        async with pool.slab() as buf:
            view = await reader.read_into(req, buf)
            assert bytes(view) == data[req.offset : req.offset + req.length]

    async with anyio.create_task_group() as tg:
        for req in reqs:
            tg.start_soon(one, req)
    # a buffer outside the registered region still works (plain READ)
    req = reqs[0]
    view = await reader.read_into(req, aligned_empty(required_size(req)))
    assert bytes(view) == data[req.offset : req.offset + req.length]


@pytest.mark.anyio
async def test_uring_fixed_buffer_index_over_many_slots(data_file: tuple[Path, bytes]) -> None:
    """Each slot's buffer (registered in no particular address order, as the expert store
    registers its slots) is found for a read inside it, and only inside it; a read that runs
    past its buffer's end, or lies outside every buffer, is a plain read. Reads land right
    either way."""
    path, data = data_file
    r = await _uring(data_file, 16)
    try:
        bufs = [aligned_empty(ALIGN * (1 + i % 3)) for i in range(40)]
        order = np.random.default_rng(5).permutation(len(bufs))
        bufs = [bufs[i] for i in order]
        if not r.register_buffers(bufs):
            pytest.skip(f"fixed buffers refused here: {r.reason}")
        find = r._fixed_index
        for i, b in enumerate(bufs):
            a, n = b.ctypes.data, b.nbytes
            assert find(a, n) == i and find(a + ALIGN // 2, n - ALIGN // 2) == i
            assert find(a + n - 1, 1) == i
            assert find(a, n + 1) is None  # (past its end: buffers are not contiguous)
        outside = aligned_empty(ALIGN)
        assert find(outside.ctypes.data, ALIGN) is None
        reqs = [ReadRequest(path, ALIGN * i + 7, b.nbytes - ALIGN) for i, b in enumerate(bufs)]
        views = await r.read_many(reqs, bufs)
        views += await r.read_many([reqs[0], reqs[1]], [outside, bufs[1]])
        for q, v in zip([*reqs, reqs[0], reqs[1]], views, strict=True):
            assert bytes(v) == data[q.offset : q.offset + q.length]
    finally:
        await r.aclose()


@pytest.mark.anyio
async def test_uring_submission_lets_go_of_the_gil_only_for_plain_reads(
    data_file: tuple[Path, bytes],
) -> None:
    """A submission of reads into registered buffers keeps the GIL (short, nothing to fault
    in); one with a plain read among its requests lets go of it (the kernel may fault the
    buffer's pages in). Both land the right bytes."""
    path, data = data_file
    r = await _uring(data_file, 16)
    try:
        ring = r._ring
        if ring.engine != "syscall":
            pytest.skip("the GIL choice is the syscall engine's")
        fixed = aligned_empty(4 * ALIGN)
        if not r.register_buffers([fixed]):
            pytest.skip(f"fixed buffers refused here: {r.reason}")
        held: list[bool] = []
        real = ring._call

        def call(nr: int, *args: Any, hold_gil: bool = False) -> int:
            held.append(hold_gil)
            got: int = real(nr, *args, hold_gil=hold_gil)
            return got

        ring._call = call
        plain = aligned_empty(4 * ALIGN)
        q1, q2 = ReadRequest(path, 100, 3 * ALIGN), ReadRequest(path, 9 * ALIGN, ALIGN)
        assert bytes(await r.read_into(q1, fixed)) == data[100 : 100 + 3 * ALIGN]
        assert bytes(await r.read_into(q1, plain)) == data[100 : 100 + 3 * ALIGN]
        views = await r.read_many([q1, q2], [fixed, plain])
        assert [bytes(v) for v in views] == [
            data[100 : 100 + 3 * ALIGN],
            data[9 * ALIGN : 10 * ALIGN],
        ]
        assert held == [True, False, False]
        assert bytes(await r.read_into(q2, fixed)) == data[9 * ALIGN : 10 * ALIGN]
        assert held[-1] is True
    finally:
        await r.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_uring_completions_come_through_one_reader_kept_on_the_loop(
    data_file: tuple[Path, bytes], anyio_backend: str
) -> None:
    """Under asyncio the ring's eventfd is watched by one reader callback for the reader's
    life (not added and removed around every wait); reads in flight together, cancelled or
    failing all end right; closing the reader takes the callback off the loop."""
    import asyncio

    path, data = data_file
    r = await _uring(data_file, 16)
    selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    efd = r._efd
    try:
        q = ReadRequest(path, 3, 200_000)
        assert bytes(await r.read_into(q, aligned_empty(required_size(q)))) == data[3:200_003]
        assert efd in selector.get_map()  # (no read in flight: still watched)
        reqs = _on(path, [x for x in _extents(len(data), 12, seed=9)])
        got: list[bool] = []

        async def one(req: ReadRequest) -> None:
            view = await r.read_into(req, aligned_empty(required_size(req)))
            got.append(bytes(view) == data[req.offset : req.offset + req.length])

        async with anyio.create_task_group() as tg:
            for req in reqs:
                tg.start_soon(one, req)
        assert got == [True] * len(reqs)
        big = [ReadRequest(path, 0, len(data)) for _ in range(3)]
        bufs = [aligned_empty(required_size(x)) for x in big]
        with anyio.move_on_after(0.0005):
            await r.read_many(big, bufs)
        assert not r._ops
        with pytest.raises(ReadError, match="short read"):
            await r.read_into(ReadRequest(path, len(data) - 5, 10), aligned_empty(2 * ALIGN))
        assert efd in selector.get_map()
    finally:
        await r.aclose()
    assert efd not in selector.get_map()


_MEMLOCK_CHILD = """
import resource, sys, anyio
resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 << 20, 8 << 20))
sys.path.insert(0, sys.argv[1])
from storage.aligned import aligned_empty
from storage.reader import ReadRequest, open_reader, required_size

async def main() -> None:
    path = sys.argv[2]
    r = await open_reader("uring", probe_path=path)
    buf = aligned_empty(32 << 20)  # well over the 8 MiB RLIMIT_MEMLOCK default
    print("registered", r.register_buffers([buf]))
    print("reason", r.reason)
    req = ReadRequest(path, 5, 100_000)
    view = await r.read_into(req, buf[: required_size(req)])
    with open(path, "rb") as f:
        f.seek(5)
        print("bytes_ok", bytes(view) == f.read(100_000))
    await r.aclose()

anyio.run(main)
"""


def test_uring_fixed_buffers_fall_back_on_memlock(data_file: tuple[Path, bytes]) -> None:
    """Without CAP_IPC_LOCK a registration above RLIMIT_MEMLOCK fails with ENOMEM: plain reads."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and util-linux setpriv to drop CAP_IPC_LOCK in a child")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    cmd = [setpriv, "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock", sys.executable]
    res = subprocess.run(
        [*cmd, "-c", _MEMLOCK_CHILD, str(ROOT), str(data_file[0])],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    if "unavailable" in res.stderr:
        pytest.skip(f"io_uring unavailable: {res.stderr[-300:]}")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "registered False" in res.stdout
    assert "fixed buffers refused" in res.stdout and "RLIMIT_MEMLOCK" in res.stdout
    assert "bytes_ok True" in res.stdout


@pytest.mark.anyio
async def test_liburing_engine_or_clear_reason(data_file: tuple[Path, bytes]) -> None:
    pytest.importorskip("liburing")
    broken = await _liburing_usable(data_file[0])
    if broken is not None:
        pytest.skip(f"liburing engine not usable here: {broken}")
    r = await open_reader("uring", probe_path=data_file[0], uring_engine="liburing")
    try:
        path, data = data_file
        reqs = _on(path, _extents(len(data), 20, seed=8))
        views = await r.read_many(reqs, [aligned_empty(required_size(q)) for q in reqs])
        for q, view in zip(reqs, views, strict=True):
            assert bytes(view) == data[q.offset : q.offset + q.length]
    finally:
        await r.aclose()


@pytest.mark.anyio
async def test_explicit_kinds_report_reason(data_file: tuple[Path, bytes]) -> None:
    for kind in ("threads", "buffered"):
        r = await open_reader(kind, probe_path=data_file[0])
        try:
            assert r.name == kind
            assert r.direct == (kind == "threads")
            assert r.reason
        finally:
            await r.aclose()
    with pytest.raises(ValueError):
        await open_reader("buffered", direct=True)


# --------------------------------------------------------------------------- benchmark smoke
@pytest.mark.anyio
async def test_bench_storage_smoke(data_file: tuple[Path, bytes]) -> None:
    from storage.bench import bench_storage

    res = await bench_storage(
        data_file[0],
        backends=("uring", "threads", "buffered"),
        reads=4,
        block=1 << 20,
        queue_depth=2,
        repeats=1,
        drop_caches=False,
        fio=False,
    )
    assert res["block"] == 1 << 20 and res["reads"] == 4
    assert set(res["backends"]) | set(res["skipped"]) == {"uring", "threads", "buffered"}
    for v in res["backends"].values():
        assert v["gbps_median"] > 0 and v["reason"]
    assert res["figure"] is None and res["figure_reason"] == "off"
    hp = res["hugepages"]  # the buffers (1 MiB reads: under 2 MiB, ordinary ones either way)
    assert hp["buffer_bytes"] >= 2 << 20 and hp["huge_backed_bytes"] is not None


@pytest.mark.anyio
async def test_a_read_that_waited_while_the_reader_closed_is_a_read_error(
    data_file: tuple[Path, bytes],
) -> None:
    """A read that passed its checks, then waited (for its file) while the engine closed the
    reader, fails with ReadError instead of reaching a ring that is gone."""
    try:
        r = await open_reader("uring", probe_path=data_file[0], queue_depth=4)
    except ReadError as exc:
        pytest.skip(f"uring backend unavailable here: {exc}")
    opened = anyio.Event()
    go = anyio.Event()
    real_fd = r._fd  # type: ignore[attr-defined]

    async def slow_fd(req: ReadRequest) -> int:
        opened.set()
        await go.wait()
        fd: int = await real_fd(req)
        return fd

    r._fd = slow_fd  # type: ignore[attr-defined]
    buf = aligned_empty(2 * ALIGN)
    got: list[Exception] = []

    async def read() -> None:
        try:
            await r.read_into(ReadRequest(data_file[0], 0, ALIGN), buf)
        except Exception as exc:  # the test looks at what it was
            got.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await opened.wait()
        await r.aclose()  # the ring is released meanwhile
        go.set()
    assert len(got) == 1 and isinstance(got[0], ReadError), got
    assert "closed" in str(got[0])


@pytest.mark.anyio
async def test_bench_storage_warms_each_round_before_timing_it(
    data_file: tuple[Path, bytes],
) -> None:
    """On a virtual disk the host caches what a round's first pass read (dropping the guest's
    cache does not reach it): the first pass of a round ran at 0.3-2.0 GB/s against 1.4-2.6 for
    the rest, and fio never went first. Every kept round now starts with an untimed pass over
    its extents; --no-warm-up times the cold pass as before."""
    from storage.bench import bench_storage

    lines: list[str] = []
    res = await bench_storage(
        data_file[0],
        backends=("threads", "buffered"),
        reads=4,
        block=1 << 20,
        repeats=3,
        drop_caches=False,
        fio=False,
        min_pass_s=0,
        log=lines.append,
    )
    rounds = [ln for ln in lines if ln.startswith(("warm-up ", "pass "))]
    assert [ln.split()[0] for ln in rounds] == ["warm-up", "pass", "pass"] * 3, rounds
    assert [ln.split()[1] for ln in rounds if ln.startswith("warm-up")] == ["1", "2", "3"]
    assert all("threads" in ln for ln in rounds if ln.startswith("warm-up"))
    assert res["warm_up"]["backend"] == "threads"
    assert len(res["warm_up"]["gbps_runs"]) == 3 and min(res["warm_up"]["gbps_runs"]) > 0
    for v in res["backends"].values():  # the warm-up is not one of the timed passes
        assert len(v["gbps_runs"]) == 3

    lines.clear()
    cold = await bench_storage(
        data_file[0],
        backends=("threads",),
        reads=4,
        block=1 << 20,
        repeats=2,
        drop_caches=False,
        fio=False,
        min_pass_s=0,
        log=lines.append,
        warm_up=False,
    )
    assert cold["warm_up"] is None and not any(ln.startswith("warm-up") for ln in lines)


@pytest.mark.anyio
async def test_bench_storage_refuses_a_block_of_partial_pages(
    data_file: tuple[Path, bytes],
) -> None:
    """A block that is not whole 4 KiB pages credited each backend read with the block while
    O_DIRECT moved (and fio was credited) the aligned span: the figure compared unlike work."""
    from storage.bench import bench_storage

    with pytest.raises(ColibriError, match="multiple of 4 KiB"):
        await bench_storage(data_file[0], block=1000, reads=2, repeats=1, fio=False)


@pytest.mark.anyio
async def test_bench_storage_compares_only_like_reads_with_fio(
    data_file: tuple[Path, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fio reads with O_DIRECT: a page-cache backend (repeated extents and readahead served
    from RAM) set the figure as "best"; and an fio that failed after its first pass left a
    figure of three backend passes over one fio pass, with no reason given."""
    import shutil as sh

    from storage.bench import bench_storage

    real = sh.which("fio")
    if real is None:
        pytest.skip("fio is not installed")
    cached = await bench_storage(
        data_file[0],
        backends=("buffered",),
        reads=4,
        block=1 << 20,
        repeats=1,
        fio=True,
        min_pass_s=0,
    )
    assert cached["best_backend"] is None and cached["figure"] is None
    assert "O_DIRECT" in cached["figure_reason"]
    shim = tmp_path / "bin"
    shim.mkdir()
    calls = tmp_path / "calls"
    (shim / "fio").write_text(  # the real fio for its engine probe and one pass, then failures
        f"#!/bin/sh\necho x >> {calls}\n"
        f"if [ $(wc -l < {calls}) -gt 2 ]; then echo broken >&2; exit 1; fi\n"
        f'exec {real} "$@"\n'
    )
    (shim / "fio").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
    partial = await bench_storage(  # no extension: a probe round would use up the real fio
        data_file[0],
        backends=("threads",),
        reads=4,
        block=1 << 20,
        repeats=3,
        fio=True,
        min_pass_s=0,
    )
    assert partial["figure"] is None, partial
    assert "1 of 3 passes" in partial["figure_reason"]


@pytest.mark.parametrize("qd", [1, 4, 8])
def test_the_fio_baseline_counts_every_read_it_replayed(
    data_file: tuple[Path, bytes], tmp_path: Path, qd: int
) -> None:
    """Replaying an iolog at depth N, fio leaves the last N - 1 reads out of its io_bytes and
    bw_bytes (not out of its runtime): the baseline read 3% low at depth 4, 30% at 32 (the
    figure too high by as much), and 0 (no figure, no reason) with --qd >= --reads."""
    import shutil as sh

    from storage.bench import _fio, _fio_engine
    from storage.reader import ReadRequest

    if sh.which("fio") is None:
        pytest.skip("fio is not installed")
    block = 1 << 20
    reqs = [ReadRequest(data_file[0], k * block, block) for k in (3, 0, 5, 1, 4, 2) * 8]
    got = _fio(reqs, qd, _fio_engine(), tmp_path)
    assert got["bytes"] == 48 * block
    assert got["gbps"] > 0


def test_the_whole_ms_error_and_how_far_a_short_pass_grows() -> None:
    """fio counts a pass's runtime in whole ms: 1 ms of it is the most its GB/s can be off,
    and a pass too short for that is grown towards the minimum (capped, never shrunk)."""
    from storage.bench import MAX_READS, grown_reads, quantization

    assert quantization(200) == pytest.approx(0.005)
    assert quantization(14) == pytest.approx(1 / 14)  # the demo's pass at 200 reads: ~7%
    assert quantization(0) == 1.0
    # 200 reads in 29 ms, for 0.2 s: x 0.2 / 0.029, half as many again
    assert grown_reads(200, 0.029, 0.2) == math.ceil(200 * 1.5 * 0.2 / 0.029)
    assert abs(grown_reads(200, 0.0, 0.2) - 200 * 600) <= 1  # a 0 ms pass: half a ms
    assert grown_reads(10, 0.0, 10.0) == 10 * 1000  # at most 1000 times as many
    assert grown_reads(5, 0.199, 0.2) >= 6  # always at least one more
    assert grown_reads(10, 1e-6, 1.0) <= MAX_READS and grown_reads(10**6, 1e-3, 1.0) == MAX_READS


@pytest.mark.anyio
async def test_a_pass_shorter_than_the_minimum_is_extended_for_fio_and_the_backends_alike(
    data_file: tuple[Path, bytes],
) -> None:
    """A pass of a few ms swung fio's whole-ms-timed GB/s by 10-60%: the first round of a
    too-short pass is thrown away and every pass, the backends' and fio's, reads more of the
    same plan (fio replaying all of them), and the result says how many and how long."""
    import shutil as sh

    from storage.bench import bench_storage, quantization

    if sh.which("fio") is None:
        pytest.skip("fio is not installed (apt-get install fio): the extension is fio's timing")
    res = await bench_storage(
        data_file[0], backends=("threads",), reads=2, block=64 << 10, repeats=2, min_pass_s=0.05
    )
    assert res["reads"] == 2 and res["min_pass_s"] == 0.05
    assert res["reads_per_pass"] > 2, res  # two 64 KiB reads cannot last 50 ms
    assert res["extended"] and res["extended"][0]["reads"] == 2
    assert res["extended"][0]["shortest_pass_s"] < 0.05
    grown = [x["reads"] for x in res["extended"]] + [res["reads_per_pass"]]
    assert grown == sorted(grown) and len(set(grown)) == len(grown)
    fio = res["fio"]
    assert fio is not None and len(fio["runtime_ms_runs"]) == 2, res["figure_reason"]
    assert res["figure"] is not None and res["figure_reason"] is None
    assert fio["quantization_max"] == quantization(min(fio["runtime_ms_runs"]))
    # every kept pass lasted the minimum, or the result says it did not
    p = res["pass_s"]
    assert p["min"] <= p["median"] <= p["max"]
    assert p["min"] >= 0.05 or res["warnings"], res
    assert p["min"] <= min(fio["runtime_ms_runs"]) / 1e3
    assert p["min"] <= res["backends"]["threads"]["pass_s_median"]
    assert 0 < res["distinct_extents"] <= res["reads_per_pass"]


@pytest.mark.anyio
async def test_a_min_pass_of_0_reads_what_was_asked(data_file: tuple[Path, bytes]) -> None:
    from storage.bench import bench_storage

    res = await bench_storage(
        data_file[0],
        backends=("threads",),
        reads=3,
        block=64 << 10,
        repeats=2,
        drop_caches=False,
        fio=False,
        min_pass_s=0,
    )
    assert res["reads"] == res["reads_per_pass"] == 3 and res["extended"] == []
    assert res["warnings"] == [] and res["pass_s"]["min"] > 0
    with pytest.raises(ColibriError, match="min-pass"):
        await bench_storage(data_file[0], reads=2, repeats=1, fio=False, min_pass_s=-1)


def test_python_m_storage_bench_takes_min_pass(
    data_file: tuple[Path, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    from storage.bench import main

    args = [str(data_file[0]), "--backends", "threads", "--reads", "2", "--repeats", "1",
            "--block", "64KiB", "--no-fio", "--no-drop-caches", "--min-pass", "0"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["min_pass_s"] == 0 and out["reads_per_pass"] == 2


@pytest.mark.anyio
async def test_bench_storage_reads_the_experts_of_a_model_without_a_manifest(
    tmp_path: Path,
) -> None:
    """Without a manifest (the public container, a synthetic model) the bench drew random
    offsets over every shard, uniformly by file: 64% of the reads of a synthetic model fell
    in its small non-expert shards, re-read from the page cache by the buffered backend."""
    import shutil as sh

    from _demo import TINY

    from storage.bench import bench_storage
    from storage.container import Container

    d = Path(sh.copytree(TINY, tmp_path / "m"))
    (d / "colibri-manifest.json").unlink()
    res = await bench_storage(
        d, backends=("threads",), reads=6, repeats=1, drop_caches=False, fio=False
    )
    want = {x.end - x.start for x in Container.open(d).expert_extents()}
    assert res["extents"].endswith("expert extents from the shard headers"), res["extents"]
    assert res["block"] == max(want)
    assert {res["read_bytes"]["min"], res["read_bytes"]["max"]} <= want

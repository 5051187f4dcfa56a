"""Expert reads: one async interface, three backends (io_uring, thread pool, buffered).

A read request names any byte extent of a file. Backends reading with O_DIRECT fetch the
4 KiB-aligned superset of the extent straight into the caller's aligned buffer and hand back the
view ``buf[head : head + length]`` (``head = offset - aligned_offset``): the bytes land in their
final place and are never copied. :func:`required_size` says how big ``buf`` must be.

Backends (:func:`open_reader` picks one and says why in ``reader.reason``):

- ``uring``: an io_uring ring driven from the event loop. Completions signal an eventfd
  registered with the ring, awaited with :func:`anyio.wait_readable` (asyncio and trio alike), so
  thousands of reads in flight cost no threads. The ring is set up with raw Linux syscalls
  (``ctypes``, x86_64) by default: the PyPI ``liburing`` wheel (2026.3.30) is compiled with
  AVX-512 instructions and dies with SIGILL on CPUs without them, so it is only used when asked
  for (``uring_engine="liburing"``) and after a self-test in a child process passes. Registered
  (fixed) buffers are used for reads into buffers passed to :meth:`register_buffers`. The backend
  lives in :mod:`storage.uring_reader`, its two ring engines in :mod:`storage.uring_ring`.
- ``threads``: O_DIRECT ``os.preadv`` on a small thread pool (``anyio.to_thread`` with its own
  ``CapacityLimiter``): for kernels or sandboxes without io_uring (Docker's default seccomp).
- ``buffered``: the same without O_DIRECT, for filesystems that refuse it, and for tmpfs where
  the page cache *is* the storage.

Every OS-level failure is mapped to :class:`~storage.errors.ReadError` in one place
(:func:`_read_error`); a failed read leaves the reader usable. A cancelled read never returns
its buffer to the caller while the kernel may still write into it: the io_uring backend asks the
kernel to cancel and waits (shielded) for the completion; thread reads finish before the
cancellation is delivered.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt
import structlog

from storage.aligned import ALIGN, aligned_empty, round_up
from storage.errors import ReadError
from storage.uring_ring import (
    _liburing_usable,
    _LiburingRing,
    _Ring,
    _SyscallRing,
)

__all__ = [
    "ReadRequest",
    "Reader",
    "ReaderKind",
    "ReaderStats",
    "aligned_extent",
    "direct_io_problem",
    "filesystem_type",
    "open_reader",
    "required_size",
]

ReaderKind = Literal["auto", "uring", "threads", "buffered"]
UringEngine = Literal["auto", "syscall", "liburing"]
U8Array = npt.NDArray[np.uint8]

_log = structlog.get_logger(__name__)

# Filesystems whose files live in RAM: O_DIRECT bypasses nothing there (and some refuse it).
_MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})


# --------------------------------------------------------------------------- requests and stats
@dataclass(frozen=True, slots=True)
class ReadRequest:
    """``length`` bytes of ``path`` starting at byte ``offset`` (any alignment)."""

    path: Path
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.path, Path):
            object.__setattr__(self, "path", Path(self.path))
        if self.offset < 0 or self.length < 0:
            raise ValueError(f"bad extent offset={self.offset} length={self.length}")


def aligned_extent(req: ReadRequest, align: int = ALIGN) -> tuple[int, int, int]:
    """``(aligned_offset, head, span)``: the aligned superset read for ``req``.

    The requested bytes are ``[head, head + length)`` of the ``span`` bytes read from
    ``aligned_offset``.
    """
    aligned = req.offset - req.offset % align
    head = req.offset - aligned
    return aligned, head, round_up(head + req.length, align)


def required_size(req: ReadRequest, align: int = ALIGN) -> int:
    """Bytes the destination buffer of ``req`` must hold (its aligned superset)."""
    return aligned_extent(req, align)[2]


@dataclass
class ReaderStats:
    """Counters since the reader was opened.

    ``busy_seconds`` is wall time with at least one read in flight; ``wait_seconds`` sums the
    time each read call waited (it exceeds wall time when reads overlap).
    """

    reads: int = 0
    bytes: int = 0
    errors: int = 0
    short_reads_resubmitted: int = 0
    busy_seconds: float = 0.0
    wait_seconds: float = 0.0
    in_flight_peak: int = 0

    def as_dict(self) -> dict[str, float]:
        """Plain dict for JSON / metrics."""
        return dict(self.__dict__)


@runtime_checkable
class Reader(Protocol):
    """The async read interface every backend implements."""

    name: str
    """``"uring"``, ``"threads"`` or ``"buffered"``."""
    reason: str
    """Why this backend (and these options) were chosen; for logs and ``coli doctor``."""
    direct: bool
    """True when files are opened with O_DIRECT."""
    stats: ReaderStats

    async def read_into(self, req: ReadRequest, buf: U8Array) -> U8Array:
        """Read ``req`` into ``buf`` (>= :func:`required_size` bytes, 4 KiB-aligned for direct
        readers); return the zero-copy view of ``buf`` holding exactly ``req.length`` bytes."""
        ...

    async def read_many(
        self, reqs: Sequence[ReadRequest], bufs: Sequence[U8Array]
    ) -> list[U8Array]:
        """All reads in flight at once; views in request order. Raises :class:`ReadError`
        (after every read has finished) if any failed."""
        ...

    def register_buffers(self, bufs: Sequence[U8Array]) -> bool:
        """Offer long-lived buffers for faster (fixed) reads; False when not used."""
        ...

    def reopen(self, paths: Iterable[Path]) -> None:
        """Open each of ``paths`` anew at its next read (the file at that path was replaced)."""
        ...

    async def aclose(self) -> None:
        """Wait for reads in flight, then release the ring, threads and file descriptors."""
        ...


# --------------------------------------------------------------------------- the error boundary
def _read_error(
    backend: str, req: ReadRequest, exc: OSError | None = None, detail: str = ""
) -> ReadError:
    """The one place OS-level read failures become :class:`ReadError` (raise it ``from exc``)."""
    what = f"{backend}: reading {req.length} bytes at offset {req.offset} of {req.path} failed"
    if exc is not None:
        code = exc.errno
        text = os.strerror(code) if code else str(exc)
        what += f": [Errno {code}] {text}"
        if code == errno.EINVAL:
            detail = detail or (
                "the filesystem may refuse O_DIRECT or the buffer is misaligned; "
                "try --reader buffered"
            )
        elif code == errno.ENOENT:
            detail = detail or "the file is missing: is the model directory complete?"
        elif code == errno.EISDIR:
            detail = detail or "the path is a directory, not a shard file"
        elif code == errno.EIO:
            detail = detail or "the device reported an I/O error: check the disk (dmesg)"
    if detail:
        what += f" ({detail})"
    return ReadError(what)


def _raise_failed(failed: Sequence[ReadError], n: int) -> None:
    """Raise for a ``read_many`` of ``n`` reads whose ``failed`` ones (in request order) are
    given: the one error as it is, several as one naming how many and the first."""
    if not failed:
        return
    first = failed[0]
    if len(failed) == 1:
        raise first
    raise ReadError(f"{len(failed)} of {n} reads failed; first: {first}") from first


def _short_read_detail(fd: int, req: ReadRequest) -> str:
    try:
        size = os.fstat(fd).st_size
    except OSError:
        size = -1
    return (
        f"short read: the file ends at byte {size} but the extent ends at "
        f"{req.offset + req.length}; the shard is truncated or the extent is wrong "
        "(re-download or re-convert the model)"
    )


def _check_buffer(req: ReadRequest, buf: U8Array, direct: bool) -> None:
    """Programming errors (wrong buffer) are ValueError, not ReadError."""
    if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1:
        raise ValueError("read buffers must be 1-D uint8 numpy arrays")
    if not buf.flags.c_contiguous or not buf.flags.writeable:
        raise ValueError("read buffers must be contiguous and writeable")
    need = required_size(req)
    if buf.nbytes < need:
        raise ValueError(f"buffer of {buf.nbytes} bytes < required_size {need} for {req}")
    if direct and buf.ctypes.data % ALIGN:
        raise ValueError(f"O_DIRECT needs a {ALIGN}-byte aligned buffer (use aligned_empty)")


# --------------------------------------------------------------------------- open files
class _FileCache:
    """path -> fd, opened once (O_DIRECT when asked) and kept until the reader closes."""

    def __init__(self, direct: bool) -> None:
        self.direct = direct
        self._fds: dict[Path, int] = {}
        self._retired: list[int] = []  # (closed with the reader: a read may still use one)

    def get(self, path: Path) -> int | None:
        return self._fds.get(path)

    def open(self, path: Path) -> int:
        """Blocking open (run it in a worker thread); raises OSError."""
        known = self._fds.get(path)
        if known is not None:
            return known
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            # ext4 refuses O_DIRECT on directories with EINVAL; say what it really is.
            if exc.errno == errno.EINVAL and path.is_dir():
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path)) from exc
            raise
        known = self._fds.setdefault(path, fd)
        if known != fd:  # another task opened it meanwhile
            os.close(fd)
        return known

    def forget(self, path: Path, fd: int) -> None:
        """Drop a descriptor the kernel called invalid (EBADF) so the next read reopens.

        It is not closed: its number may already belong to another file."""
        if self._fds.get(path) == fd:
            del self._fds[path]

    def retire(self, paths: Iterable[Path]) -> None:
        """The next read of each of ``paths`` opens the file again (it was replaced: a mirror
        staged anew renames fresh files into place). The old descriptors stay open until the
        reader closes: a read in flight may still use one, and closing it could hand its
        number to another file."""
        for path in paths:
            fd = self._fds.pop(path, None)
            if fd is not None:
                self._retired.append(fd)

    def close_all(self) -> None:
        for fd in [*self._fds.values(), *self._retired]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        self._retired.clear()


# --------------------------------------------------------------------------- shared reader logic
class _ReaderBase:
    """Stats, validation, fd cache and :meth:`read_many` shared by all backends."""

    name: str = "?"

    def __init__(self, direct: bool, reason: str, threads: int) -> None:
        self.direct = direct
        self.reason = reason
        self.stats = ReaderStats()
        self._files = _FileCache(direct)
        self._open_limiter = anyio.CapacityLimiter(threads)
        self._inflight = 0
        self._busy_since = 0.0
        self._closed = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} direct={self.direct}: {self.reason}>"

    async def __aenter__(self) -> _ReaderBase:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _begin(self) -> float:
        now = time.perf_counter()
        if self._inflight == 0:
            self._busy_since = now
        self._inflight += 1
        self.stats.in_flight_peak = max(self.stats.in_flight_peak, self._inflight)
        return now

    def _end(self, t0: float) -> None:
        now = time.perf_counter()
        self._inflight -= 1
        self.stats.wait_seconds += now - t0
        if self._inflight == 0:
            self.stats.busy_seconds += now - self._busy_since

    def _prepare(self, req: ReadRequest, buf: U8Array) -> None:
        if self._closed:
            # A ReadError, not a crash: a read queued before shutdown (a lookahead, a demand
            # read of an aborted step) may start after the engine closed its reader.
            raise ReadError(f"{self.name} reader is closed (the engine is shutting down)")
        _check_buffer(req, buf, self.direct)

    def reopen(self, paths: Iterable[Path]) -> None:
        """Open each of ``paths`` anew at its next read (see :meth:`_FileCache.retire`)."""
        self._files.retire(paths)

    async def _fd(self, req: ReadRequest) -> int:
        fd = self._files.get(req.path)
        if fd is not None:
            return fd
        try:
            return await anyio.to_thread.run_sync(
                self._files.open, req.path, limiter=self._open_limiter
            )
        except OSError as exc:
            self.stats.errors += 1
            raise _read_error(self.name, req, exc) from exc

    async def read_into(self, req: ReadRequest, buf: U8Array) -> U8Array:
        raise NotImplementedError

    async def read_many(
        self, reqs: Sequence[ReadRequest], bufs: Sequence[U8Array]
    ) -> list[U8Array]:
        """All reads in flight at once; waits for every one even when some fail."""
        if len(reqs) != len(bufs):
            raise ValueError(f"{len(reqs)} requests but {len(bufs)} buffers")
        for r, b in zip(reqs, bufs, strict=True):
            self._prepare(r, b)
        if len(reqs) == 1:
            return [await self.read_into(reqs[0], bufs[0])]
        out: list[U8Array | None] = [None] * len(reqs)
        failed: list[tuple[int, ReadError]] = []

        async def one(i: int) -> None:
            try:
                out[i] = await self.read_into(reqs[i], bufs[i])
            except ReadError as exc:
                failed.append((i, exc))

        async with anyio.create_task_group() as tg:
            for i in range(len(reqs)):
                tg.start_soon(one, i)
        failed.sort(key=lambda t: t[0])
        _raise_failed([exc for _, exc in failed], len(reqs))
        return [v for v in out if v is not None]

    def register_buffers(self, bufs: Sequence[U8Array]) -> bool:
        return False

    def _count(self, req: ReadRequest, resubmits: int) -> None:
        self.stats.reads += 1
        self.stats.bytes += req.length
        self.stats.short_reads_resubmitted += resubmits

    async def aclose(self) -> None:
        self._closed = True
        self._files.close_all()


# --------------------------------------------------------------------------- threads / buffered
def _pread_full(fd: int, view: memoryview, offset: int, need: int, direct: bool) -> tuple[int, int]:
    """preadv until ``need`` bytes are in ``view`` or EOF; returns (bytes got, resubmits)."""
    got = 0
    resubmits = 0
    while got < need:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
        if got < need:
            if direct and n % ALIGN:  # O_DIRECT only stops mid-block at end of file
                break
            resubmits += 1
    return got, resubmits


class _ThreadReader(_ReaderBase):
    """``os.preadv`` in worker threads (O_DIRECT for ``threads``, page cache for ``buffered``)."""

    def __init__(self, name: str, direct: bool, reason: str, threads: int) -> None:
        super().__init__(direct, reason, threads)
        self.name = name
        self._limiter = anyio.CapacityLimiter(threads)

    async def read_into(self, req: ReadRequest, buf: U8Array) -> U8Array:
        self._prepare(req, buf)
        aligned, head, span = aligned_extent(req)
        if req.length == 0:
            self._count(req, 0)
            return buf[head:head]
        fd = await self._fd(req)
        need = head + req.length
        view = buf.data[: span if self.direct else need]
        t0 = self._begin()
        try:
            # Not abandoned on cancel: the task waits for the thread, so the buffer is free
            # again by the time a cancellation propagates.
            got, resubmits = await anyio.to_thread.run_sync(
                _pread_full, fd, view, aligned, need, self.direct, limiter=self._limiter
            )
        except OSError as exc:
            self.stats.errors += 1
            if exc.errno == errno.EBADF:
                self._files.forget(req.path, fd)
            raise _read_error(self.name, req, exc) from exc
        finally:
            view.release()
            self._end(t0)
        if got < need:
            self.stats.errors += 1
            raise _read_error(self.name, req, None, _short_read_detail(fd, req))
        self._count(req, resubmits)
        return buf[head : head + req.length]


# --------------------------------------------------------------------------- choosing a backend
def filesystem_type(path: str | os.PathLike[str]) -> str:
    """Filesystem type holding ``path`` (longest matching mount point in /proc/mounts)."""
    try:
        real = os.path.realpath(path)
        best, fstype = "", "unknown"
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
        return fstype
    except OSError:
        return "unknown"


def _probe_file(probe_path: Path | None) -> Path | None:
    """A regular, non-empty file at or under ``probe_path`` to try O_DIRECT on."""
    if probe_path is None:
        return None
    if probe_path.is_file():
        return probe_path
    if probe_path.is_dir():
        try:
            names = sorted(probe_path.iterdir(), key=lambda p: (p.suffix != ".safetensors", p))
        except OSError:
            return None
        for p in names:
            try:
                if p.is_file() and p.stat().st_size > 0:
                    return p
            except OSError:
                continue
    return None


def direct_io_problem(path: Path) -> str | None:
    """None when an O_DIRECT open + aligned read of ``path`` works, else the error text."""
    buf = aligned_empty(ALIGN)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError as exc:
        return f"O_DIRECT open refused ({exc.strerror})"
    try:
        os.preadv(fd, [buf.data], 0)
    except OSError as exc:
        return f"O_DIRECT read refused ({exc.strerror})"
    finally:
        os.close(fd)
    return None


def _open_ring(entries: int, engine: Literal["syscall", "liburing"]) -> _Ring:
    ring: _Ring = _SyscallRing(entries) if engine == "syscall" else _LiburingRing(entries)
    try:  # a NOP round trip proves submit + complete work (seccomp may allow setup only)
        ring.prep_nop(0)
        ring.submit(wait_nr=1)
        if [ud for ud, _ in ring.reap()] != [0]:
            raise OSError(errno.EIO, "io_uring NOP did not complete")
    except BaseException:
        ring.close()
        raise
    return ring


async def open_reader(
    kind: ReaderKind = "auto",
    *,
    direct: bool | None = None,
    probe_path: Path | str | None = None,
    queue_depth: int = 64,
    threads: int = 4,
    uring_engine: UringEngine = "auto",
    fixed_buffers: Sequence[U8Array] = (),
) -> Reader:
    """Open a reader; ``kind="auto"`` picks the best backend that works on ``probe_path``.

    ``probe_path`` (a shard or the model directory) is where O_DIRECT is tried: memory-backed
    filesystems (tmpfs) get ``buffered``, a refused O_DIRECT open or read gets ``buffered``,
    otherwise ``uring`` when an io_uring ring can be set up and completes a NOP, else
    ``threads``. ``direct`` overrides the O_DIRECT decision. An explicit ``kind`` that cannot
    work raises :class:`ReadError` naming why. The choice and the reason are logged and kept in
    ``reader.reason``. ``fixed_buffers`` (e.g. a :class:`~storage.aligned.SlabPool` region)
    are registered with the ring for READ_FIXED when the kernel allows.
    """
    if kind not in ("auto", "uring", "threads", "buffered"):
        raise ValueError(f"unknown reader kind {kind!r}")
    if kind == "buffered" and direct:
        raise ValueError("the buffered reader never uses O_DIRECT")
    if queue_depth < 1 or threads < 1:
        raise ValueError("queue_depth and threads must be >= 1")
    probe = Path(probe_path) if probe_path is not None else None
    why: list[str] = []

    if kind == "buffered":
        direct = False
        why.append("buffered reads requested")
    elif direct is None:
        pfile = _probe_file(probe)
        fstype = filesystem_type(probe) if probe is not None else "unknown"
        if probe is not None and fstype in _MEMORY_FS:
            direct = False
            why.append(f"{probe} is on {fstype} (RAM): O_DIRECT bypasses nothing there")
        elif pfile is not None:
            refused = await anyio.to_thread.run_sync(direct_io_problem, pfile)
            direct = refused is None
            why.append(
                f"O_DIRECT works on {fstype} ({pfile.name})"
                if direct
                else f"{refused} on {fstype} ({pfile})"
            )
        else:
            direct = True
            why.append("O_DIRECT assumed (no file to probe)")
    else:
        why.append(f"O_DIRECT {'on' if direct else 'off'} as requested")

    reader: _ReaderBase
    want_ring = kind == "uring" or (kind == "auto" and direct)
    ring_error = ""
    if want_ring:
        engines: list[Literal["syscall", "liburing"]] = (
            ["liburing"] if uring_engine == "liburing" else ["syscall"]
        )
        for engine in engines:
            if engine == "liburing":
                broken = await _liburing_usable(_probe_file(probe))
                if broken is not None:
                    ring_error = broken
                    continue
            note = f"io_uring ring via {engine} engine, queue depth {queue_depth}"
            try:
                ring = _open_ring(2 * queue_depth, engine)
            except (OSError, ImportError) as exc:
                ring_error = f"io_uring ({engine}) unavailable: {exc}"
                continue
            try:
                from storage.uring_reader import _UringReader  # imports this module

                reader = _UringReader(
                    ring, queue_depth, bool(direct), "; ".join([*why, note]), threads
                )
            except OSError as exc:  # eventfd creation or registration refused
                ring.close()
                ring_error = f"io_uring ({engine}) eventfd unavailable: {exc}"
                continue
            break
        else:
            if kind == "uring":
                raise ReadError(f"{ring_error}; use --reader threads")
            why.append(f"{ring_error} -> threads")
            reader = _ThreadReader("threads", True, "; ".join(why), threads)
    elif kind == "threads" or (kind == "auto" and direct):
        why.append(f"thread pool of {threads}")
        reader = _ThreadReader("threads", bool(direct), "; ".join(why), threads)
    else:
        why.append(f"page-cache reads on a thread pool of {threads}")
        reader = _ThreadReader("buffered", False, "; ".join(why), threads)

    if fixed_buffers:
        reader.register_buffers(fixed_buffers)
    _log.info("storage reader", backend=reader.name, direct=reader.direct, reason=reader.reason)
    return reader

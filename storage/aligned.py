"""Aligned byte buffers for O_DIRECT reads, and a preallocated pool of them.

Large buffers (2 MiB and up: expert slots) can be asked for on transparent huge pages
(:func:`aligned_empty` with ``huge=True``): an anonymous mapping, 2 MiB aligned, with
``madvise(MADV_HUGEPAGE)``. Where the kernel does not allow it (THP ``never``, no ``madvise``)
the buffer is an ordinary one and :func:`hugepage_support` says why; :func:`huge_backed_bytes`
reads from ``/proc/self/smaps`` how much of a set of buffers the kernel really backs with huge
pages (after they were first written).

O_DIRECT (and io_uring fixed buffers) need the destination address, the file offset and the
length to be multiples of the device's logical block size. 4096 covers every disk we meet, so it
is the default everywhere. numpy gives no alignment guarantee, so :func:`aligned_empty`
over-allocates and returns an aligned view; the view keeps the allocation alive through ``.base``.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import numpy as np
import numpy.typing as npt

__all__ = [
    "ALIGN",
    "HUGE_PAGE",
    "HugeArena",
    "HugePageSupport",
    "SlabPool",
    "aligned_empty",
    "huge_backed_bytes",
    "hugepage_support",
    "is_aligned",
    "round_up",
]

ALIGN = 4096
HUGE_PAGE = 2 * 1024 * 1024

U8Array = npt.NDArray[np.uint8]


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def _check_align(align: int) -> None:
    if align <= 0 or align & (align - 1):
        raise ValueError(f"alignment must be a positive power of two, got {align}")


THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True, slots=True)
class HugePageSupport:
    """Whether large buffers can be put on transparent huge pages here, and why not."""

    mode: str  # the kernel's THP setting: always | madvise | never | unavailable
    advise: bool  # MADV_HUGEPAGE can be asked for (mode always/madvise, mmap.madvise present)
    reason: str  # "" when advise, else why not

    def as_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "advise": self.advise, "reason": self.reason}


def hugepage_support(enabled: Path = THP_ENABLED) -> HugePageSupport:
    """Read the kernel's transparent-huge-page setting (the bracketed word of ``enabled``)."""
    try:
        text = enabled.read_text()
    except OSError:
        return HugePageSupport("unavailable", False, f"{enabled} is not readable (no THP)")
    mode = text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()
    if mode == "never":
        return HugePageSupport(mode, False, "transparent huge pages are off (THP 'never')")
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return HugePageSupport(mode, False, "this Python has no mmap.MADV_HUGEPAGE")
    return HugePageSupport(mode, True, "")


def _huge_mapping(n: int) -> U8Array | None:
    """``n`` bytes (a multiple of 4096) on a 2 MiB-aligned anonymous mapping advised for huge
    pages; None when the kernel refuses the advice."""
    mm = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mm, dtype=np.uint8)  # keeps ``mm`` alive through .base
    head = -whole.ctypes.data % HUGE_PAGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, head, n)
    except OSError:
        return None
    return whole[head : head + n]


def huge_backed_bytes(
    buffers: Iterable[npt.NDArray[np.generic]], smaps: Path = Path("/proc/self/smaps")
) -> int | None:
    """Bytes of ``buffers`` the kernel backs with huge pages: per mapping holding any of them,
    its ``AnonHugePages``, at most the bytes of the buffers in it (a numpy buffer may share a
    bigger mapping); None where smaps cannot be read."""
    spans = sorted((int(b.ctypes.data), int(b.nbytes)) for b in buffers if b.nbytes)
    if not spans:
        return 0
    try:
        text = smaps.read_text()
    except OSError:
        return None
    total, k = 0, 0
    lo = hi = -1
    for line in text.splitlines():
        if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
            a, b = line.split(" ", 1)[0].split("-")
            lo, hi = int(a, 16), int(b, 16)
            continue
        if line.startswith("AnonHugePages:") and lo >= 0:
            while k < len(spans) and spans[k][0] < lo:
                k += 1
            ours = 0
            while k < len(spans) and spans[k][0] < hi:  # our buffers in this mapping
                ours += min(spans[k][1], hi - spans[k][0])
                k += 1
            total += min(int(line.split()[1]) * 1024, ours)
    return total


def aligned_empty(nbytes: int, align: int = ALIGN, *, huge: bool = False) -> U8Array:
    """An uninitialised uint8 array whose address is a multiple of ``align``.

    The length is ``nbytes`` rounded up to ``align`` (so the whole array can be the target of an
    O_DIRECT read). The result is a view into a slightly larger numpy allocation.

    Buffers of 2 MiB or more start on a 2 MiB boundary: numpy asks for transparent huge pages
    on large allocations, and a huge-page-aligned buffer turns one 19 MiB O_DIRECT read into a
    few large device requests instead of thousands of 4 KiB segments (measured +20% on a
    virtio disk). The extra head room is virtual memory that is never touched.

    ``huge``: such a buffer gets its own anonymous mapping advised ``MADV_HUGEPAGE`` (the
    caller checked :func:`hugepage_support`); a refused advice falls back to the numpy one.
    """
    _check_align(align)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    n = round_up(nbytes, align)
    if huge and n >= HUGE_PAGE and HUGE_PAGE % align == 0:
        buf = _huge_mapping(round_up(n, ALIGN))
        if buf is not None:
            return buf[:n]
    start = max(align, HUGE_PAGE) if n >= HUGE_PAGE else align
    raw = np.empty(n + start, dtype=np.uint8)
    head = -raw.ctypes.data % start
    return raw[head : head + n]


class HugeArena:
    """Resident weights on transparent huge pages, packed: 64-byte aligned pieces carved in
    order out of anonymous mappings advised ``MADV_HUGEPAGE`` (``chunk`` bytes each; a piece
    over a quarter of a chunk gets a mapping of its own, rounded up to 2 MiB).

    Why: a matrix streamed from DRAM by four read streams (the one-token GEMVs) runs ~6%
    faster on huge pages than on 4 KiB ones (fewer TLB misses; docs/benchmarks.md), while one
    mapping per tensor would round every tensor up to 2 MiB. Here only the last, partly used
    huge page of each mapping is waste; the untouched rest of a mapping is never backed.
    Pieces keep their mapping alive (numpy ``.base``); the arena itself can be dropped.
    Where the kernel does not allow the advice (:func:`hugepage_support`), :meth:`empty`
    returns ordinary numpy arrays (``huge`` False says so).
    """

    PIECE_ALIGN = 64  # one cache line: the kernels' widest vector load

    def __init__(self, chunk: int = 64 * 1024 * 1024, *, support: HugePageSupport | None = None):
        if chunk < HUGE_PAGE or chunk % HUGE_PAGE:
            raise ValueError(f"chunk must be a positive multiple of {HUGE_PAGE}, got {chunk}")
        self.chunk = chunk
        self.support = hugepage_support() if support is None else support
        self.huge = self.support.advise
        self.mapped_bytes = 0  # virtual bytes of the mappings made so far
        self.used_bytes = 0  # bytes handed out in huge-page mappings (padding not counted)
        self._cur: U8Array | None = None
        self._off = 0
        self._lock = threading.Lock()  # loaders may read tensors from several threads

    def empty(self, nbytes: int) -> U8Array:
        """An uninitialised uint8 array of ``nbytes``, 64-byte aligned (thread-safe)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            return self._carve(nbytes)

    def _carve(self, nbytes: int) -> U8Array:
        if not self.huge or nbytes == 0:
            return aligned_empty(nbytes, self.PIECE_ALIGN)[:nbytes]
        if nbytes > self.chunk // 4:  # big: its own mapping (waste < 2 MiB of > chunk / 4)
            own = self._map(round_up(nbytes, HUGE_PAGE))
            if own is not None:
                self.used_bytes += nbytes
                return own[:nbytes]
            return aligned_empty(nbytes, self.PIECE_ALIGN)[:nbytes]
        off = round_up(self._off, self.PIECE_ALIGN)
        if self._cur is None or off + nbytes > self._cur.size:
            cur = self._map(self.chunk)
            if cur is None:
                return aligned_empty(nbytes, self.PIECE_ALIGN)[:nbytes]
            self._cur, off = cur, 0
        self._off = off + nbytes
        self.used_bytes += nbytes
        return self._cur[off : off + nbytes]

    def _map(self, n: int) -> U8Array | None:
        buf = _huge_mapping(n)
        if buf is None:  # the kernel refused the advice: stop asking
            self.huge = False
            return None
        self.mapped_bytes += n
        return buf


def is_aligned(buf: npt.NDArray[np.generic], align: int = ALIGN) -> bool:
    """True when ``buf``'s first byte sits on an ``align`` boundary."""
    return buf.ctypes.data % align == 0


class SlabPool:
    """``count`` aligned slabs of ``slab_bytes`` each, carved from one allocation up front.

    ``acquire`` waits (without blocking the event loop) until a slab is free; nothing is
    allocated per read. The wait primitive is created on first use inside the running event loop
    (asyncio or trio), so a pool can be built anywhere, but it must then stay with that loop.

        async with pool.slab() as buf:
            view = await reader.read_into(req, buf)
    """

    def __init__(self, slab_bytes: int, count: int, align: int = ALIGN) -> None:
        _check_align(align)
        if slab_bytes <= 0 or count <= 0:
            raise ValueError(f"need slab_bytes > 0 and count > 0, got {slab_bytes}, {count}")
        self.align = align
        self.slab_bytes = round_up(slab_bytes, align)
        self.count = count
        self._region = aligned_empty(self.slab_bytes * count, align)
        self._slabs: tuple[U8Array, ...] = tuple(
            self._region[i * self.slab_bytes : (i + 1) * self.slab_bytes] for i in range(count)
        )
        self._free: list[int] = list(range(count - 1, -1, -1))
        self._out: set[int] = set()
        self._sem: anyio.Semaphore | None = None

    @property
    def nbytes(self) -> int:
        """Total bytes held by the pool (all slabs)."""
        return int(self._region.nbytes)

    @property
    def region(self) -> U8Array:
        """The one aligned allocation all slabs live in (e.g. to register it with io_uring)."""
        return self._region

    @property
    def buffers(self) -> tuple[U8Array, ...]:
        """Every slab, in index order."""
        return self._slabs

    @property
    def available(self) -> int:
        """Slabs free right now."""
        return len(self._free)

    def _semaphore(self) -> anyio.Semaphore:
        if self._sem is None:
            self._sem = anyio.Semaphore(len(self._free))
        return self._sem

    async def acquire(self) -> U8Array:
        """Take a free slab, waiting until one is released."""
        await self._semaphore().acquire()
        idx = self._free.pop()
        self._out.add(idx)
        return self._slabs[idx]

    def try_acquire(self) -> U8Array | None:
        """Take a free slab now, or return None when all are in use."""
        sem = self._semaphore()
        try:
            sem.acquire_nowait()
        except anyio.WouldBlock:
            return None
        idx = self._free.pop()
        self._out.add(idx)
        return self._slabs[idx]

    def release(self, buf: U8Array) -> None:
        """Give back a slab obtained from :meth:`acquire` (the exact array, not a slice of it)."""
        delta = buf.ctypes.data - self._region.ctypes.data
        idx, rem = divmod(delta, self.slab_bytes)
        if rem or not 0 <= idx < self.count or buf.nbytes != self.slab_bytes:
            raise ValueError("release() got a buffer that is not one of this pool's slabs")
        if idx not in self._out:
            raise ValueError(f"slab {idx} released twice")
        self._out.remove(idx)
        self._free.append(idx)
        self._semaphore().release()

    @asynccontextmanager
    async def slab(self) -> AsyncIterator[U8Array]:
        """``async with pool.slab() as buf:`` acquire a slab and always give it back."""
        buf = await self.acquire()
        try:
            yield buf
        finally:
            self.release(buf)

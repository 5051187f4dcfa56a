"""Aligned byte buffers for O_DIRECT reads, and a preallocated pool of them.

O_DIRECT (and io_uring fixed buffers) need the destination address, the file offset and the
length to be multiples of the device's logical block size. 4096 covers every disk we meet, so it
is the default everywhere. numpy gives no alignment guarantee, so :func:`aligned_empty`
over-allocates and returns an aligned view; the view keeps the allocation alive through ``.base``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import numpy as np
import numpy.typing as npt

__all__ = ["ALIGN", "HUGE_PAGE", "SlabPool", "aligned_empty", "is_aligned", "round_up"]

ALIGN = 4096
HUGE_PAGE = 2 * 1024 * 1024

U8Array = npt.NDArray[np.uint8]


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def _check_align(align: int) -> None:
    if align <= 0 or align & (align - 1):
        raise ValueError(f"alignment must be a positive power of two, got {align}")


def aligned_empty(nbytes: int, align: int = ALIGN) -> U8Array:
    """An uninitialised uint8 array whose address is a multiple of ``align``.

    The length is ``nbytes`` rounded up to ``align`` (so the whole array can be the target of an
    O_DIRECT read). The result is a view into a slightly larger numpy allocation.

    Buffers of 2 MiB or more start on a 2 MiB boundary: numpy asks for transparent huge pages
    on large allocations, and a huge-page-aligned buffer turns one 19 MiB O_DIRECT read into a
    few large device requests instead of thousands of 4 KiB segments (measured +20% on a
    virtio disk). The extra head room is virtual memory that is never touched.
    """
    _check_align(align)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    n = round_up(nbytes, align)
    start = max(align, HUGE_PAGE) if n >= HUGE_PAGE else align
    raw = np.empty(n + start, dtype=np.uint8)
    head = -raw.ctypes.data % start
    return raw[head : head + n]


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

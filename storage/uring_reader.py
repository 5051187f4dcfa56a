"""The io_uring backend of :mod:`storage.reader`: a ring (:mod:`storage.uring_ring`) driven
from the event loop, completions signalled through an eventfd awaited with
:func:`anyio.wait_readable`, fixed buffers for registered slots, shielded cancellation (a
cancelled read waits for the kernel's completion before its buffer is handed back)."""

from __future__ import annotations

import asyncio
import bisect
import errno
import os
from collections.abc import Sequence

import anyio

from storage.aligned import ALIGN
from storage.errors import ReadError
from storage.reader import (
    ReadRequest,
    U8Array,
    _log,
    _raise_failed,
    _read_error,
    _ReaderBase,
    _short_read_detail,
    aligned_extent,
)
from storage.uring_ring import _MAX_FIXED_BUFFER, _Ring


# --------------------------------------------------------------------------- io_uring reader
class _Op:
    """One request in flight: where it goes, how far it got, who waits for it."""

    __slots__ = (
        "aligned", "buf", "buf_index", "cancelled", "done", "errno", "fd", "got", "head",
        "need", "req", "resubmits", "user_data", "waker", "want",
    )  # fmt: skip

    def __init__(self, req: ReadRequest, buf: U8Array, fd: int, direct: bool, ud: int) -> None:
        self.req = req
        self.fd = fd
        self.buf = buf
        self.user_data = ud
        self.aligned, self.head, span = aligned_extent(req)
        self.need = self.head + req.length
        self.want = span if direct else self.need
        self.got = 0
        self.errno = 0
        self.resubmits = 0
        self.buf_index: int | None = None
        self.cancelled = False
        self.done = False
        self.waker: anyio.Event | None = None


class _UringReader(_ReaderBase):
    """Reads submitted to an io_uring ring; completions reaped on the event loop.

    There is no background task: whichever awaiting read finds nobody reaping becomes the
    reaper (waits on the eventfd, drains the CQ, wakes finished reads) until its own read is
    done, then hands the role to another waiting read.
    """

    name = "uring"

    def __init__(self, ring: _Ring, depth: int, direct: bool, reason: str, threads: int) -> None:
        super().__init__(direct, reason, threads)
        self._ring = ring
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            ring.register_eventfd(self._efd)
        except BaseException:
            os.close(self._efd)
            raise
        self.depth = depth
        self._slots = anyio.Semaphore(depth)
        self._ops: dict[int, _Op] = {}
        self._cancels: set[int] = set()
        self._next_ud = 1
        self._reaping = False
        # registered regions, (start, end, index) sorted by start address, and their starts
        self._fixed_by_addr: list[tuple[int, int, int]] = []
        self._fixed_starts: list[int] = []
        self._fixed_keep: list[U8Array] = []
        self.fixed_buffers = False
        self.submissions = 0  # io_uring_enter calls that handed the kernel requests
        self._watch_loop: asyncio.AbstractEventLoop | None = None  # (see _watching)
        self._refused: OSError | None = None  # a submission the reader callback met failing

    @property
    def engine(self) -> str:
        """Which io_uring engine drives the ring (``syscall`` or ``liburing``)."""
        return self._ring.engine

    # ---- fixed buffers
    def register_buffers(self, bufs: Sequence[U8Array]) -> bool:
        """Register long-lived buffers; reads landing inside them use READ_FIXED.

        Returns False (and says why in ``reason``) when the kernel refuses, e.g. ENOMEM when
        RLIMIT_MEMLOCK is too small for an unprivileged user.
        """
        if self._ops:
            raise RuntimeError("register_buffers() while reads are in flight")
        regions: list[tuple[int, int]] = []
        for b in bufs:
            addr, n = b.ctypes.data, b.nbytes
            for start in range(0, n, _MAX_FIXED_BUFFER):
                regions.append((addr + start, min(_MAX_FIXED_BUFFER, n - start)))
        if self.fixed_buffers:
            self._ring.unregister_buffers()
            self._fixed_keep, self.fixed_buffers = [], False
            self._fixed_by_addr, self._fixed_starts = [], []
        if not regions:
            return False
        try:
            self._ring.register_buffers(regions)
        except OSError as exc:
            memlock = exc.errno == errno.ENOMEM
            hint = " (RLIMIT_MEMLOCK too small: raise `ulimit -l`)" if memlock else ""
            self.reason += f"; fixed buffers refused: {exc.strerror}{hint} -> plain reads"
            _log.info("io_uring fixed buffers refused", error=str(exc))
            return False
        self._fixed_by_addr = sorted((a, a + n, i) for i, (a, n) in enumerate(regions))
        self._fixed_starts = [lo for lo, _, _ in self._fixed_by_addr]
        self._fixed_keep = list(bufs)
        self.fixed_buffers = True
        total = sum(n for _, n in regions)
        self.reason += f"; fixed buffers registered ({len(regions)} regions, {total >> 20} MiB)"
        return True

    def _fixed_index(self, addr: int, n: int) -> int | None:
        # (by address: a scan over every slot's region took ~40 us a read on the event loop)
        j = bisect.bisect_right(self._fixed_starts, addr) - 1
        if j < 0:
            return None
        _, hi, i = self._fixed_by_addr[j]
        return i if addr + n <= hi else None

    # ---- submission and completion
    def _ud(self) -> int:
        ud = self._next_ud
        self._next_ud = (ud + 1) & ((1 << 62) - 1) or 1
        return ud

    def _prep(self, op: _Op) -> None:
        part = op.buf[op.got : op.want]
        if op.buf_index is None and self.fixed_buffers:
            op.buf_index = self._fixed_index(op.buf.ctypes.data, op.want)
        self._ring.prep_read(op.fd, part, op.aligned + op.got, op.user_data, op.buf_index)

    def _flush(self) -> None:
        """Submit queued SQEs; transient kernel refusals are retried by the next flush."""
        while self._ring.unsubmitted:
            try:
                if self._ring.submit() == 0:
                    return
                self.submissions += 1
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                if exc.errno in (errno.EAGAIN, errno.EBUSY):
                    return
                raise

    def _complete(self, ud: int, res: int) -> None:
        if ud in self._cancels:
            self._cancels.discard(ud)
            return
        op = self._ops.get(ud)
        if op is None:
            return
        if res < 0:
            op.errno = -res
        elif res > 0:
            op.got += res
            short = op.got < op.need
            # O_DIRECT stops mid-block only at end of file; 0 bytes is end of file too.
            if short and not op.cancelled and not (self.direct and res % ALIGN):
                op.resubmits += 1
                self._prep(op)
                return
        del self._ops[ud]
        op.done = True
        if op.waker is not None:
            op.waker.set()

    def _reap(self) -> None:
        for ud, res in self._ring.reap():
            self._complete(ud, res)
        self._flush()

    def _drain_eventfd(self) -> None:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass

    def _watching(self) -> bool:
        """Whether completions come through a reader callback kept on this (asyncio) event
        loop: registered once, at the first wait, instead of adding and removing the eventfd
        for every wait (two epoll_ctl calls, each letting go of the GIL and waiting to get it
        back: ~0.2 ms a wait on the event loop while two threads computed experts). Under
        trio, or on a loop other than the first, the awaiting reads take turns reaping."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (not asyncio)
            return False
        if self._watch_loop is not None:
            return self._watch_loop is loop
        if self._reaping or self._closed:  # (a reaper of the other kind is at work)
            return False
        try:
            loop.add_reader(self._efd, self._on_completions)
        except NotImplementedError:  # (a loop without readers)
            return False
        self._watch_loop = loop
        return True

    def _on_completions(self) -> None:
        """The eventfd's reader callback: reap, waking each finished read. A submission the
        kernel refuses for good meanwhile (a resubmitted short read, a cancel) is raised in
        every waiting read, as a reaping read would have raised it."""
        self._drain_eventfd()
        try:
            self._reap()
        except OSError as exc:
            self._refused = exc
            for op in self._ops.values():
                if op.waker is not None:
                    op.waker.set()
        else:
            self._refused = None

    async def _wait(self, op: _Op) -> None:
        """Until ``op`` completes: woken by the loop's reader callback, or (see
        :meth:`_watching`) following the reaper, or being it."""
        if self._watching():
            while not op.done:
                op.waker = anyio.Event()
                try:
                    if self._ring.unsubmitted:  # kernel said "busy": retry until it takes them
                        with anyio.move_on_after(0.001):
                            await op.waker.wait()
                        self._reap()
                    else:
                        await op.waker.wait()
                finally:
                    op.waker = None
                if self._refused is not None and not op.done:
                    raise self._refused
            return
        while not op.done:
            if self._reaping:
                op.waker = anyio.Event()
                try:
                    await op.waker.wait()
                finally:
                    op.waker = None
                continue
            self._reaping = True
            try:
                while not op.done:
                    self._reap()
                    if op.done:
                        break
                    if self._ring.unsubmitted:  # kernel said "busy": poll until it takes them
                        with anyio.move_on_after(0.001):
                            await anyio.wait_readable(self._efd)
                    else:
                        await anyio.wait_readable(self._efd)
                    self._drain_eventfd()
            finally:
                self._reaping = False
                self._hand_off()

    async def _drain_all(self) -> None:
        """Until no read is in flight (aclose racing reads that other tasks still await)."""
        if self._watch_loop is not None:
            while self._ops:
                self._reap()
                if self._ops:
                    await anyio.sleep(0.001)
            return
        while self._ops:
            if self._reaping:
                await anyio.sleep(0.001)
                continue
            self._reaping = True
            try:
                self._reap()
                if self._ops:
                    with anyio.move_on_after(0.01):
                        await anyio.wait_readable(self._efd)
                    self._drain_eventfd()
            finally:
                self._reaping = False
                self._hand_off()

    def _hand_off(self) -> None:
        for other in self._ops.values():
            if other.waker is not None:
                other.waker.set()
                return

    def _cancel(self, op: _Op) -> None:
        op.cancelled = True
        cud = self._ud()
        self._cancels.add(cud)
        self._ring.prep_cancel(op.user_data, cud)
        self._flush()

    async def read_into(self, req: ReadRequest, buf: U8Array) -> U8Array:
        self._prepare(req, buf)
        if req.length == 0:
            head = aligned_extent(req)[1]
            self._count(req, 0)
            return buf[head:head]
        fd = await self._fd(req)
        async with self._slots:
            if self._closed:  # closed while this read waited for its file or a ring slot
                raise ReadError(f"{self.name} reader is closed (the engine is shutting down)")
            op = _Op(req, buf, fd, self.direct, self._ud())
            await self._run_batch([op])
        err = self._outcome(op)
        if err is not None:
            raise err
        return buf[op.head : op.head + req.length]

    async def read_many(
        self, reqs: Sequence[ReadRequest], bufs: Sequence[U8Array]
    ) -> list[U8Array]:
        """All reads in one submission (one ``io_uring_enter``), waited for by this task
        alone, when the ring has a free slot for each and their files are open already (every
        read after a file's first); otherwise one task per read, as every backend does. Waits
        for every read even when some fail; a cancelled batch asks the kernel to stop each
        read still in flight and waits for every completion before it unwinds."""
        if len(reqs) != len(bufs):
            raise ValueError(f"{len(reqs)} requests but {len(bufs)} buffers")
        if len(reqs) < 2:
            return await super().read_many(reqs, bufs)
        for r, b in zip(reqs, bufs, strict=True):
            self._prepare(r, b)
        await anyio.lowlevel.checkpoint_if_cancelled()
        live = [i for i, r in enumerate(reqs) if r.length]
        fds = [self._files.get(reqs[i].path) for i in live]
        n = len(live)
        # (a file not opened yet opens on a worker thread, where it may fail for one read and
        # not the others; a slot each, taken at once below: never a partial hold; room in the
        # submission queue for all of them: never a batch half queued)
        room = self._ring.sq_entries - self._ring.unsubmitted
        if None in fds or self._slots.value < n or room < n:
            return await super().read_many(reqs, bufs)
        for _ in range(n):
            self._slots.acquire_nowait()
        try:
            if self._closed:
                raise ReadError(f"{self.name} reader is closed (the engine is shutting down)")
            ops = [
                _Op(reqs[i], bufs[i], fd, self.direct, self._ud())
                for i, fd in zip(live, fds, strict=True)
                if fd is not None
            ]
            if ops:
                await self._run_batch(ops)
        finally:
            for _ in range(n):
                self._slots.release()
        _raise_failed([err for err in map(self._outcome, ops) if err is not None], len(reqs))
        out: list[U8Array] = []
        done = iter(ops)
        for r, b in zip(reqs, bufs, strict=True):
            if r.length:
                op = next(done)
                out.append(b[op.head : op.head + r.length])
            else:  # (nothing to read: an empty view where its bytes would start)
                head = aligned_extent(r)[1]
                self._count(r, 0)
                out.append(b[head:head])
        return out

    async def _run_batch(self, ops: list[_Op]) -> None:
        """Submit ``ops`` together (one read, or a batch) and wait until every one completed
        (shielded when cancelled: the kernel may be writing into their buffers)."""
        t0s = [self._begin() for _ in ops]
        ended = 0
        try:
            for op in ops:
                self._ops[op.user_data] = op
            try:
                for op in ops:
                    self._prep(op)
                self._flush()
            except OSError as exc:
                for op in ops:
                    self._ops.pop(op.user_data, None)
                self.stats.errors += len(ops)
                raise _read_error(self.name, ops[0].req, exc, "io_uring submission failed") from exc
            try:
                for op in ops:
                    await self._wait(op)
                    self._end(t0s[ended])
                    ended += 1
            except BaseException:
                # Cancelled (or the loop is going down): the kernel may still be writing into
                # the buffers, so ask it to stop each read and wait for the completions, shielded.
                with anyio.CancelScope(shield=True):
                    for op in ops:
                        if not op.done:
                            self._cancel(op)
                    for op in ops:
                        await self._wait(op)
                raise
        finally:
            for t0 in t0s[ended:]:
                self._end(t0)

    def _outcome(self, op: _Op) -> ReadError | None:
        """A finished read's error (counted), or None (its bytes counted)."""
        req = op.req
        if op.errno:
            self.stats.errors += 1
            if op.errno == errno.EBADF:
                self._files.forget(req.path, op.fd)
            err = OSError(op.errno, os.strerror(op.errno))
            got = _read_error(self.name, req, err)
            got.__cause__ = err
            return got
        if op.got < op.need:
            self.stats.errors += 1
            return _read_error(self.name, req, None, _short_read_detail(op.fd, req))
        self._count(req, op.resubmits)
        return None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):
                await self._drain_all()
        finally:
            # released even when the drain was cut (an asyncio task.cancel() goes through the
            # shield): the ring, its eventfd and the files stayed open for the process's life
            # (and a later aclose returned at once)
            if self._watch_loop is not None:
                try:
                    self._watch_loop.remove_reader(self._efd)
                except Exception:  # (the loop is closed: nothing watches it any more)
                    pass
                self._watch_loop = None
            if self.fixed_buffers:
                try:
                    self._ring.unregister_buffers()
                except OSError:
                    pass
            self._ring.close()
            os.close(self._efd)
            self._files.close_all()

"""io_uring ring engines for :mod:`storage.reader`: raw Linux syscalls via ``ctypes`` (default)
or the PyPI ``liburing`` binding (opt-in, after :func:`_liburing_selftest` passed in a child
process: its 2026.3.30 wheel executes AVX-512 instructions and dies with SIGILL without them).

Both offer the same small interface: prepare reads / NOPs / cancels, submit, reap completions,
register an eventfd and (syscall engine) fixed buffers. The reader drives them from the event
loop; nothing here knows about requests, retries or errors beyond the OS return codes.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import mmap
import os
import platform
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from storage.aligned import ALIGN, aligned_empty

U8Array = npt.NDArray[np.uint8]

_NR_IO_URING_SETUP, _NR_IO_URING_ENTER, _NR_IO_URING_REGISTER = 425, 426, 427
_OP_NOP, _OP_READ_FIXED, _OP_ASYNC_CANCEL, _OP_READ = 0, 4, 14, 22
_ENTER_GETEVENTS = 1
_REGISTER_BUFFERS, _UNREGISTER_BUFFERS, _REGISTER_EVENTFD = 0, 1, 4
_FEAT_SINGLE_MMAP = 1
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_SQE = struct.Struct("<BBHiQQIiQHHiQQ")  # struct io_uring_sqe, 64 bytes
_CQE = struct.Struct("<QiI")  # struct io_uring_cqe, 16 bytes
_MAX_FIXED_BUFFER = 1 << 30  # the kernel's per-buffer limit for registration
_U32 = 0xFFFFFFFF


class _SyscallRing:
    """A minimal io_uring (setup, mmap, submit, reap) over raw syscalls via ctypes.

    Only what the reader needs: READ / READ_FIXED / ASYNC_CANCEL / NOP, an eventfd and fixed
    buffers. Shared-ring head/tail words are read and written as aligned 32-bit numpy scalars
    (single loads/stores); x86-64's store ordering publishes an SQE before the tail that names
    it, which is why this engine is limited to x86-64.
    """

    engine = "syscall"

    def __init__(self, entries: int) -> None:
        if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
            raise OSError(errno.ENOSYS, "the raw io_uring engine supports Linux x86-64 only")
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall.restype = ctypes.c_long
        # Submitting reads into registered (fixed) buffers keeps the GIL: the call is short
        # (~0.1 ms for a 19 MiB read), and a thread that lets go of the GIL for it waits to
        # get it back behind every other thread's Python (~0.5 ms a submission, measured on
        # the event loop while two threads computed experts). A plain read may fault its
        # buffer's pages in during the call (tens of ms for fresh memory): that one lets go.
        self._syscall_held = ctypes.PyDLL(None, use_errno=True).syscall
        self._syscall_held.restype = ctypes.c_long
        params = ctypes.create_string_buffer(120)  # struct io_uring_params
        self.fd = self._call(_NR_IO_URING_SETUP, ctypes.c_long(entries), params)
        try:
            self._map(bytes(params.raw))
        except BaseException:
            os.close(self.fd)
            raise

    def _call(self, nr: int, *args: Any, hold_gil: bool = False) -> int:
        call = self._syscall_held if hold_gil else self._syscall
        res = int(call(ctypes.c_long(nr), *args))
        if res < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        return res

    def _map(self, p: bytes) -> None:
        sq_entries, cq_entries, _, _, _, features = struct.unpack_from("<6I", p, 0)
        sq_off = struct.unpack_from("<8I", p, 40)  # head tail mask entries flags dropped array
        cq_off = struct.unpack_from("<8I", p, 80)  # head tail mask entries overflow cqes flags
        self.sq_entries, self.cq_entries = sq_entries, cq_entries
        sq_size = sq_off[6] + sq_entries * 4
        cq_size = cq_off[5] + cq_entries * _CQE.size
        single = bool(features & _FEAT_SINGLE_MMAP)
        if single:
            sq_size = cq_size = max(sq_size, cq_size)
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        self._sq_mm = mmap.mmap(self.fd, sq_size, flags, prot, offset=_OFF_SQ_RING)
        self._cq_mm = (
            self._sq_mm if single else mmap.mmap(self.fd, cq_size, flags, prot, offset=_OFF_CQ_RING)
        )
        self._sqe_mm = mmap.mmap(self.fd, sq_entries * _SQE.size, flags, prot, offset=_OFF_SQES)
        self._sq32: npt.NDArray[np.uint32] = np.frombuffer(self._sq_mm, dtype=np.uint32)
        self._cq32: npt.NDArray[np.uint32] = np.frombuffer(self._cq_mm, dtype=np.uint32)
        self._sq_head_i, self._sq_tail_i = sq_off[0] // 4, sq_off[1] // 4
        self._sq_mask = int(self._sq32[sq_off[2] // 4])
        self._cq_head_i, self._cq_tail_i = cq_off[0] // 4, cq_off[1] // 4
        self._cq_mask = int(self._cq32[cq_off[2] // 4])
        self._cqes_off = cq_off[5]
        array = sq_off[6] // 4
        self._sq32[array : array + sq_entries] = np.arange(sq_entries, dtype=np.uint32)
        self._sq_tail = int(self._sq32[self._sq_tail_i])
        self._unsubmitted = 0
        self._plain_queued = False  # a plain (not fixed-buffer) read is among the unsubmitted

    def _push(self, *fields: int) -> None:
        head = int(self._sq32[self._sq_head_i])
        if (self._sq_tail - head) & _U32 >= self.sq_entries:
            raise OSError(errno.EBUSY, "io_uring submission queue full")
        _SQE.pack_into(self._sqe_mm, (self._sq_tail & self._sq_mask) * _SQE.size, *fields)
        self._sq_tail = (self._sq_tail + 1) & _U32
        self._sq32[self._sq_tail_i] = self._sq_tail  # publish after the SQE bytes
        self._unsubmitted += 1

    def prep_read(
        self, fd: int, buf: U8Array, offset: int, user_data: int, buf_index: int | None
    ) -> None:
        op = _OP_READ if buf_index is None else _OP_READ_FIXED
        self._plain_queued |= buf_index is None
        addr = buf.ctypes.data
        self._push(op, 0, 0, fd, offset, addr, buf.nbytes, 0, user_data, buf_index or 0,
                   0, 0, 0, 0)  # fmt: skip

    def prep_cancel(self, target: int, user_data: int) -> None:
        self._push(_OP_ASYNC_CANCEL, 0, 0, -1, 0, target, 0, 0, user_data, 0, 0, 0, 0, 0)

    def prep_nop(self, user_data: int) -> None:
        self._push(_OP_NOP, 0, 0, -1, 0, 0, 0, 0, user_data, 0, 0, 0, 0, 0)

    @property
    def unsubmitted(self) -> int:
        return self._unsubmitted

    def submit(self, wait_nr: int = 0) -> int:
        """io_uring_enter: hand queued SQEs to the kernel (and optionally wait for CQEs)."""
        flags = _ENTER_GETEVENTS if wait_nr else 0
        n = self._call(
            _NR_IO_URING_ENTER,
            ctypes.c_long(self.fd),
            ctypes.c_long(self._unsubmitted),
            ctypes.c_long(wait_nr),
            ctypes.c_long(flags),
            ctypes.c_void_p(None),
            ctypes.c_long(0),
            hold_gil=not (wait_nr or self._plain_queued),
        )
        self._unsubmitted -= n
        if not self._unsubmitted:
            self._plain_queued = False
        return n

    def reap(self) -> list[tuple[int, int]]:
        """Every completion now in the CQ as (user_data, res)."""
        head = int(self._cq32[self._cq_head_i])
        tail = int(self._cq32[self._cq_tail_i])
        out = []
        while head != tail:
            ud, res, _ = _CQE.unpack_from(self._cq_mm, self._cqes_off + (head & self._cq_mask) * 16)
            out.append((ud, res))
            head = (head + 1) & _U32
        self._cq32[self._cq_head_i] = head  # give the slots back after reading them
        return out

    def _register(self, opcode: int, arg: Any, nr: int) -> int:
        return self._call(
            _NR_IO_URING_REGISTER,
            ctypes.c_long(self.fd),
            ctypes.c_long(opcode),
            arg,
            ctypes.c_long(nr),
        )

    def register_eventfd(self, efd: int) -> None:
        box = ctypes.c_int(efd)
        self._register(_REGISTER_EVENTFD, ctypes.byref(box), 1)

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> None:
        iov = (ctypes.c_uint64 * (2 * len(regions)))()
        for i, (addr, n) in enumerate(regions):
            iov[2 * i], iov[2 * i + 1] = addr, n
        self._register(_REGISTER_BUFFERS, iov, len(regions))

    def unregister_buffers(self) -> None:
        self._register(_UNREGISTER_BUFFERS, ctypes.c_void_p(None), 0)

    def close(self) -> None:
        del self._sq32, self._cq32  # release the buffer exports before unmapping
        for mm in {id(m): m for m in (self._sq_mm, self._cq_mm, self._sqe_mm)}.values():
            mm.close()
        os.close(self.fd)


class _LiburingRing:
    """The same engine interface over the PyPI ``liburing`` binding (readv of an ``Iovec``).

    Opt-in only (``uring_engine="liburing"``), after :func:`_liburing_selftest` passed in a
    child process: the 2026.3.30 wheel executes AVX-512 instructions and kills the process with
    SIGILL on CPUs without them. Fixed buffers are not offered through this engine.
    """

    engine = "liburing"

    def __init__(self, entries: int) -> None:
        self._L: Any = importlib.import_module("liburing")
        self._ring = self._L.Ring()
        self._L.io_uring_queue_init(entries, self._ring)
        self._cqe = self._L.Cqe()
        self._keep: dict[int, tuple[Any, memoryview]] = {}  # user_data -> (Iovec, view)
        self._unsubmitted = 0
        self.sq_entries = entries

    def _sqe(self) -> Any:
        sqe = self._L.io_uring_get_sqe(self._ring)
        if sqe is None:
            raise OSError(errno.EBUSY, "io_uring submission queue full")
        self._unsubmitted += 1
        return sqe

    def prep_read(
        self, fd: int, buf: U8Array, offset: int, user_data: int, buf_index: int | None
    ) -> None:
        view = buf.data
        iov = self._L.Iovec([view])
        sqe = self._sqe()
        self._L.io_uring_prep_readv(sqe, fd, iov, offset)
        self._L.io_uring_sqe_set_data64(sqe, user_data)
        self._keep[user_data] = (iov, view)

    def prep_cancel(self, target: int, user_data: int) -> None:
        sqe = self._sqe()
        self._L.io_uring_prep_cancel64(sqe, target, 0)
        self._L.io_uring_sqe_set_data64(sqe, user_data)

    def prep_nop(self, user_data: int) -> None:
        sqe = self._sqe()
        self._L.io_uring_prep_nop(sqe)
        self._L.io_uring_sqe_set_data64(sqe, user_data)

    @property
    def unsubmitted(self) -> int:
        return self._unsubmitted

    def submit(self, wait_nr: int = 0) -> int:
        if wait_nr:
            n = int(self._L.io_uring_submit_and_wait(self._ring, wait_nr))
        else:
            n = int(self._L.io_uring_submit(self._ring))
        self._unsubmitted = max(0, self._unsubmitted - n)
        return n

    def reap(self) -> list[tuple[int, int]]:
        out = []
        while True:
            try:
                self._L.io_uring_peek_cqe(self._ring, self._cqe)
            except BlockingIOError:
                break
            c = self._cqe[0]
            if c is None:
                break
            ud, res = int(c.user_data), int(c.res or 0)
            self._L.io_uring_cqe_seen(self._ring, c)
            self._keep.pop(ud, None)
            out.append((ud, res))
        return out

    def register_eventfd(self, efd: int) -> None:
        self._L.io_uring_register_eventfd(self._ring, efd)

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> None:
        raise OSError(errno.EOPNOTSUPP, "fixed buffers are not used with the liburing engine")

    def unregister_buffers(self) -> None:
        return None

    def close(self) -> None:
        self._L.io_uring_queue_exit(self._ring)
        self._keep.clear()


_Ring = _SyscallRing | _LiburingRing


def _liburing_selftest(path: str | None) -> int:
    """Child-process check that the liburing engine runs here (0 = works).

    NOP round trip signalled through the eventfd, then (given a file) a readv compared byte
    for byte with a plain read.
    """
    import select

    ring = _LiburingRing(8)
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    ring.register_eventfd(efd)
    ring.prep_nop(7)
    ring.submit()
    if not select.select([efd], [], [], 5.0)[0] or ring.reap() != [(7, 0)]:
        return 2
    if path:
        buf = aligned_empty(ALIGN)
        fd = os.open(path, os.O_RDONLY)
        ring.prep_read(fd, buf, 0, 8, None)
        ring.submit()
        select.select([efd], [], [], 5.0)
        got = ring.reap()
        want = os.pread(fd, ALIGN, 0)
        os.close(fd)
        if len(got) != 1 or got[0][1] != len(want) or bytes(buf[: len(want)]) != want:
            return 3
    ring.close()
    return 0


async def _liburing_usable(probe_file: Path | None) -> str | None:
    """None when the liburing engine passes its self-test in a child process, else why not."""
    root = str(Path(__file__).resolve().parents[1])
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from storage.uring_ring import _liburing_selftest; "
        "raise SystemExit(_liburing_selftest(sys.argv[2] or None))"
    )
    argv = [sys.executable, "-c", code, root, str(probe_file or "")]
    try:
        with anyio.fail_after(60):
            proc = await anyio.run_process(argv, check=False)
    except (OSError, TimeoutError) as exc:
        return f"liburing self-test could not run: {exc}"
    rc = proc.returncode
    if rc == 0:
        return None
    if rc == -4:
        return (
            "liburing binding died with SIGILL (the wheel uses CPU instructions, e.g. AVX-512, "
            "that this CPU lacks)"
        )
    tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
    return f"liburing self-test failed (exit {rc}) {tail[0]}".strip()

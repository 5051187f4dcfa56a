"""A countdown one thread waits on while others finish parts of a job: polled first, then slept.

Why polled: a thread sleeping on a lock wakes through a system call and, on a virtual machine
whose other vCPU went idle, the hypervisor rescheduling it: measured 100-250 us per wake on a
2-vCPU KVM guest, as long as the part of a routed expert being waited for. :meth:`Countdown.wait`
first polls the count in a ``nogil`` loop of atomic loads (:func:`poll_change`: no GIL held, no
``pause``, which a KVM host may take for a spinning lock and deschedule) for at most
``poll_iters`` reads, then sleeps on a condition as usual. The poll is bounded, so a machine
shared with another process loses at most that much of a core per wait, never a time slice.

Shape legend: cell: an int64 array [1] (the count another thread bumps); no other arrays.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import numpy.typing as npt
from numba import njit

from runtime.kernels._intrinsics import load_acquire

__all__ = ["KERNELS", "Countdown", "iterations_per_us", "poll_change"]

I64Array = npt.NDArray[np.int64]
_CALIBRATION_ITERS = 1 << 17


@njit(nogil=True, cache=True)
def poll_change(cell: I64Array, seen: int, iters: int) -> int:  # pragma: no cover - numba
    """``cell[0]`` as soon as it differs from ``seen``, or ``seen`` after ``iters`` reads."""
    for _ in range(iters):
        v = load_acquire(cell, 0)
        if v != seen:
            return v  # type: ignore[no-any-return]
    return seen


#: Every compiled kernel (tests check they were built with ``nogil=True``).
KERNELS = (poll_change,)


def iterations_per_us() -> float:
    """How many :func:`poll_change` reads this CPU makes per microsecond, measured now (the
    fastest of three runs: the poll is a bound on time, so a fast estimate only shortens it)."""
    cell = np.zeros(1, np.int64)
    poll_change(cell, 0, 16)  # compiled (or loaded from the cache) before timing
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        poll_change(cell, 0, _CALIBRATION_ITERS)
        best = min(best, time.perf_counter() - t0)
    return _CALIBRATION_ITERS / max(best * 1e6, 1e-3)


class Countdown:
    """``parts`` parts to finish: :meth:`tick` once per part (also when it failed), :meth:`wait`
    until all ticked. ``failed`` says whether a part raised (its error reaches the caller
    through whoever ran it)."""

    def __init__(self, parts: int, poll_iters: int) -> None:
        if parts < 0:
            raise ValueError(f"parts must be >= 0, got {parts}")
        self.parts = parts
        self.failed = False
        self._poll_iters = max(0, poll_iters)
        self._cell = np.zeros(1, np.int64)  # parts finished
        self._cond = threading.Condition()

    def tick(self, ok: bool = True) -> None:
        with self._cond:
            if not ok:
                self.failed = True
            self._cell[0] += 1
            self._cond.notify_all()

    def wait(self) -> None:
        seen = int(self._cell[0])
        left = self._poll_iters
        while seen < self.parts and left > 0:
            now = int(poll_change(self._cell, seen, left))
            if now == seen:
                break
            seen = now
            left //= 2  # a part landed: poll on for the rest, within the same bound overall
        with self._cond:
            while int(self._cell[0]) < self.parts:
                self._cond.wait()

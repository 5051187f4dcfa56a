"""Waits that hold through a caller's cancellation, however it comes.

anyio's shielded cancel scope defers anyio's own cancellation (``move_on_after``, a task group
cancelled, trio's), but on asyncio a *native* cancellation (``task.cancel()``,
``asyncio.wait_for``, ``asyncio.timeout``: what a service embedding the engine uses) is thrown
into the awaiting coroutine all the same, and ``anyio.to_thread.run_sync`` returns while its
thread still runs. The engine's critical waits (a step still writing into a cache, the one
forward on the compute thread) must not end early: these helpers wait on, keep the
cancellation, and raise it once the wait is over (``Scheduler._on_thread`` does the same
for its thread).

Shape legend: no arrays here.
"""

from __future__ import annotations

import anyio

__all__ = ["settle", "settled"]


async def settle(event: anyio.Event) -> BaseException | None:
    """Wait until ``event`` is set, shielded and through native cancellation too; returns the
    cancellation that arrived meanwhile (None: none did) for the caller to raise when its own
    cleanup is done."""
    pending: BaseException | None = None
    with anyio.CancelScope(shield=True):
        while not event.is_set():
            try:
                await event.wait()
            except anyio.get_cancelled_exc_class() as exc:  # native: the shield let it in
                pending = exc
    return pending


async def settled(event: anyio.Event) -> None:
    """:func:`settle`, raising the cancellation that arrived meanwhile, if any."""
    pending = await settle(event)
    if pending is not None:
        raise pending

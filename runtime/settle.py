"""Waits that hold through a caller's cancellation, however it comes.

anyio's shielded cancel scope defers anyio's own cancellation (``move_on_after``, a task group
cancelled, trio's), but on asyncio a *native* cancellation (``task.cancel()``,
``asyncio.wait_for``, ``asyncio.timeout``: what a service embedding the engine uses) is thrown
into the awaiting coroutine all the same, and ``anyio.to_thread.run_sync`` returns while its
thread still runs. The engine's critical waits (a step still writing into a cache, the one
forward on the compute thread, a model load, the engine's close) must not end early: these
helpers wait on, keep the cancellation, and raise it once the wait is over.

Shape legend: no arrays here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

__all__ = ["run_in_task", "run_settled", "settle", "settled"]

R = TypeVar("R")


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


async def run_settled(
    fn: Callable[..., R], *args: Any, limiter: anyio.CapacityLimiter | None = None
) -> R:
    """``fn(*args)`` on a worker thread (``anyio.to_thread.run_sync``), waited for to its end
    whatever cancels the caller: an asyncio ``task.cancel()`` made ``to_thread.run_sync``
    return while its thread still ran (a model load went on for tens of GB after a timed-out
    open; a forward beside the next one; a limiter freed with its call still running), so the
    thread says when it is done and the cancellation is raised after. A call cancelled before
    its thread took it never runs (a claim handshake decides which came first). Its error is
    raised as it is, unless the caller was cancelled meanwhile: then the cancellation."""
    done = anyio.Event()
    box: list[tuple[bool, Any]] = []
    claim = threading.Lock()
    # queued -> running -> finished (the thread's moves); queued -> dropped and running ->
    # waiting (the caller's, when cancelled): who came first, the claim lock decides
    state = ["queued"]

    def target() -> None:
        with claim:
            if state[0] == "dropped":
                return
            state[0] = "running"
        try:
            box.append((True, fn(*args)))
        except BaseException as exc:
            box.append((False, exc))
        finally:
            with claim:
                waited = state[0] == "waiting"
                state[0] = "finished"
            if waited:  # (only then: a hop to the loop per call, which every step paid)
                try:
                    anyio.from_thread.run_sync(done.set)
                except Exception:  # the event loop is gone: nobody waits any more
                    pass

    # ``limiter`` held here, to the thread's end (to_thread.run_sync's own is given back as a
    # native cancellation unwinds it: the next call started beside the one still running)
    async with limiter if limiter is not None else contextlib.nullcontext():
        try:
            # (a limiter of its own: the process-wide default one, shared by every other
            # to_thread call, blocking reads included, must not hold a forward back)
            await anyio.to_thread.run_sync(target, limiter=anyio.CapacityLimiter(1))
        except anyio.get_cancelled_exc_class():
            with claim:
                if state[0] == "queued":
                    state[0] = "dropped"  # it never runs
                elif state[0] == "running":
                    state[0] = "waiting"  # it says when it is done
            if state[0] == "waiting":
                await settle(done)
            raise
    ok, value = box[0]
    if not ok:
        # a caller cancelled meanwhile (a deadline that also closed what the call used) gets
        # its cancellation, not the error that followed from it
        await anyio.lowlevel.checkpoint_if_cancelled()
        raise value
    return value  # type: ignore[no-any-return]


async def run_in_task(tg: Any, afn: Callable[[], Awaitable[None]]) -> None:
    """``await afn()`` as a shielded task of the task group ``tg``, waited for to its end:
    an asyncio ``task.cancel()`` of the caller (a second one while an engine closes, what
    ``asyncio.run`` does to tasks left over) went through the caller's shield and cut a
    close or a usage save short (the ring, its eventfd and the shards' descriptors leaked,
    a forward kept running with the loop gone). Its error is raised; a cancellation that came
    meanwhile after it. Without a task group that takes tasks (None, or one that has ended)
    it runs here, shielded from anyio's cancellation only."""
    done = anyio.Event()
    failed: list[Exception] = []

    async def run() -> None:
        try:
            with anyio.CancelScope(shield=True):
                await afn()
        except Exception as exc:
            failed.append(exc)
        finally:
            done.set()

    started = False
    if tg is not None:
        try:
            tg.start_soon(run)
            started = True
        except RuntimeError:  # the task group has ended
            pass
    if not started:
        await run()
    pending = await settle(done)
    if failed:
        raise failed[0]
    if pending is not None:
        raise pending

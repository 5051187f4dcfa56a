"""Cancelling ``Engine.open`` while the streaming store starts: what it opened is closed."""

from __future__ import annotations

import os
import time

from _demo import demo_model

import colibri

DEMO = demo_model()


def test_a_cancelled_streaming_open_closes_what_it_opened() -> None:
    """Engine.open cancelled while the streaming store started left its io_uring ring, its
    eventfd and a shard's descriptor open for the process's life."""
    import anyio

    def fds() -> set[str]:
        return {os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{n}")}  # fmt: skip

    async def once(delay: float) -> None:
        with anyio.move_on_after(delay):
            async with colibri.Engine.open(DEMO, ram_budget="16MiB") as engine:
                await engine.forward([1, 2, 3])

    before = fds()
    for k in range(30):
        anyio.run(once, 0.002 * k)
    leaked = {f for f in fds() - before if "io_uring" in f or "eventfd" in f or "safetensors" in f}
    assert not leaked, leaked


def test_a_deadline_around_open_and_a_forward_is_a_cancellation_not_an_error() -> None:
    """The deadline of a move_on_after around Engine.open and a forward cancelled the engine's
    read tasks under the running forward, which then failed with "an expert was not read: the
    engine is closing": a ColibriError out of move_on_after instead of the timeout."""
    import anyio

    async def once(delay: float) -> bool:
        with anyio.move_on_after(delay) as scope:
            async with colibri.Engine.open(DEMO, ram_budget="16MiB") as engine:
                await engine.forward(list(range(1, 40)))
        return scope.cancelled_caught

    # the deadlines spread over twice what the whole takes on this machine now (fixed ones,
    # 0-117 ms, all fell inside it on a busy machine: nothing was left to complete)
    t0 = time.perf_counter()
    assert not anyio.run(once, 600.0)
    whole = time.perf_counter() - t0
    caught = [anyio.run(once, whole * k / 30) for k in range(60)]
    assert any(caught) and not all(caught), (whole, caught)

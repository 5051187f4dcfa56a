"""Cancelling ``Engine.open`` while the streaming store starts: what it opened is closed."""

from __future__ import annotations

import os

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
            try:
                async with colibri.Engine.open(DEMO, ram_budget="16MiB") as engine:
                    await engine.forward([1, 2, 3])
            except colibri.ColibriError as exc:  # (the pinned reads cut: "was not read")
                assert "not read" in str(exc), exc

    before = fds()
    for k in range(30):
        anyio.run(once, 0.002 * k)
    leaked = {f for f in fds() - before if "io_uring" in f or "eventfd" in f or "safetensors" in f}
    assert not leaked, leaked

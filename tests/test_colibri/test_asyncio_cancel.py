"""A service's own asyncio cancellation (``task.cancel()``, ``asyncio.wait_for``), which
anyio's shielded scopes and ``to_thread`` do not hold back: the engine's waits on a running
step hold all the same. Before: a cancelled step's rows landed in a kept cache the next
generation was already filling (wrong tokens), and a timed-out forward kept running beside
the next one (two forwards on one expert store: the engine hung for good)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from _demo import demo_model

import colibri
from colibri import TokenEvent

DEMO = demo_model()
PROMPT = [1, 2, 3, 351, 295, 267, 284, 17, 0, 2, 202, 466, 469, 267, 254, 66, 317, 247, 301]


async def _run(
    engine: colibri.Engine, prompt: list[int], n: int, cache: object = None
) -> list[int]:
    out = []
    async for ev in engine.generate(prompt, max_new_tokens=n, stop_token_ids=[], cache=cache):  # type: ignore[arg-type]
        if isinstance(ev, TokenEvent):
            out.append(ev.token_id)
    return out


@pytest.mark.parametrize("how", ["task.cancel", "wait_for"])
def test_a_natively_cancelled_generation_leaves_a_kept_cache_exact(
    how: str, tmp_path: Path
) -> None:
    async def main() -> tuple[list[int], list[int]]:
        opts = colibri.EngineOptions(learn=False, draft="off", state_dir=tmp_path)
        async with colibri.Engine.open(DEMO, options=opts) as engine:
            cache = engine.new_cache()
            got = []
            async for ev in engine.generate(PROMPT, max_new_tokens=20, stop_token_ids=[],
                                            cache=cache):  # fmt: skip
                if isinstance(ev, TokenEvent):
                    got.append(ev.token_id)
                if len(got) == 2:
                    break  # its next step stays queued or running
            p2 = PROMPT + got + [238]
            if how == "task.cancel":
                t = asyncio.ensure_future(_run(engine, p2, 20, cache))
                await asyncio.sleep(0)
                t.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await t
            else:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(_run(engine, p2, 20, cache), 0.001)
            p3 = [*p2, 176, 261]
            return await _run(engine, p3, 13, cache), await _run(engine, p3, 13)

    kept, fresh = asyncio.run(main())
    assert kept == fresh


@pytest.mark.timeout(600, method="thread")  # (a hang is stuck threads: dump them, end)
def test_timed_out_calls_never_run_beside_the_next_one(tmp_path: Path) -> None:
    """Streaming experts, one call at a time (max_batch 1): generations timed out by
    asyncio.wait_for while others run. Their forwards kept running beside the next call's (2
    to 4 at once on one expert store: the engine hung for good); one at a time now, every
    generation ends, exact."""
    import random
    import threading

    async def main() -> tuple[list[list[int]], list[list[int]], int]:
        opts = colibri.EngineOptions(learn=False, max_batch=1, state_dir=tmp_path)
        async with colibri.Engine.open(None, ram_budget="16MiB", options=opts) as engine:
            sched = engine._scheduler
            timed = sched._timed
            lock, now, peak = threading.Lock(), [0], [0]

            def counted(*args: object) -> object:  # the real call, its overlap counted
                with lock:
                    now[0] += 1
                    peak[0] = max(peak[0], now[0])
                try:
                    return timed(*args)  # type: ignore[arg-type]
                finally:
                    with lock:
                        now[0] -= 1

            sched._timed = counted  # type: ignore[method-assign]
            prompts = [[1, 2, 3 + i] for i in range(3)]
            ref = [await _run(engine, p, 16) for p in prompts]
            rnd = random.Random(0)
            for _ in range(5):
                gens = [asyncio.ensure_future(_run(engine, p, 16)) for p in prompts]
                for _ in range(4):
                    try:
                        await asyncio.wait_for(
                            _run(engine, list(range(5, 300)), 24), rnd.uniform(0.01, 0.3)
                        )
                    except TimeoutError:
                        pass
                got = await asyncio.wait_for(asyncio.gather(*gens), 120)
                assert got == ref
            return ref, got, peak[0]

    ref, got, peak = asyncio.run(main())
    assert got == ref and peak == 1, peak


def test_a_deadline_over_the_engine_mid_generation_still_saves_the_turns_usage(
    tmp_path: Path,
) -> None:
    """The turn end (usage save) runs as an engine task: a deadline that cancels the whole
    Engine.open scope, its task group included, must not cut it short."""
    import anyio

    from storage.usage import USAGE_FILE

    async def main() -> int:
        opts = colibri.EngineOptions(learn=True, draft="off", state_dir=tmp_path)
        n = 0
        with anyio.CancelScope() as outer:
            async with colibri.Engine.open(DEMO, options=opts) as engine:
                async for ev in engine.generate(PROMPT, max_new_tokens=50, stop_token_ids=[]):
                    if isinstance(ev, TokenEvent):
                        n += 1
                        if n == 5:
                            outer.cancel()
        return n

    assert anyio.run(main) == 5
    saved = [p for p in tmp_path.rglob(USAGE_FILE)]
    assert saved and saved[0].read_text().count("\n") > 2, saved

"""A service's own asyncio cancellation (``task.cancel()``, ``asyncio.wait_for``), which
anyio's shielded scopes and ``to_thread`` do not hold back: the engine's waits on a running
step hold all the same. Before: a cancelled step's rows landed in a kept cache the next
generation was already filling (wrong tokens), and a timed-out forward kept running beside
the next one (two forwards on one expert store: the engine hung for good)."""

from __future__ import annotations

import asyncio
import gc
import os
from pathlib import Path
from typing import Any

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


def _fds() -> dict[str, int]:
    out: dict[str, int] = {}
    for f in os.listdir("/proc/self/fd"):
        try:
            name = os.readlink(f"/proc/self/fd/{f}").rsplit("/", 1)[-1].split(":")[0]
        except OSError:
            continue
        out[name] = out.get(name, 0) + 1
    return out


def test_a_second_cancel_while_the_engine_closes_still_closes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service shutting down cancels the task holding Engine.open, and a second
    task.cancel() lands while the engine closes (asyncio.run cancelling what is left, a
    shutdown handler twice): it cut the close short, and every time the io_uring ring, its
    eventfd, the shards' descriptors and the compute pool's threads stayed behind."""
    import threading

    import runtime.experts as experts_mod
    from colibri import ColibriError

    host: list[asyncio.Future[None]] = []
    plain = experts_mod.ExpertStore.begin_close

    def begin_close(self: experts_mod.ExpertStore, err: ColibriError) -> None:
        asyncio.get_running_loop().call_soon(host[-1].cancel)  # the second cancel
        plain(self, err)

    monkeypatch.setattr(experts_mod.ExpertStore, "begin_close", begin_close)

    async def one(engine: colibri.Engine) -> str:
        try:
            while True:
                await _run(engine, [1, 2, 3], 60)
        except ColibriError as exc:
            return str(exc)

    async def main() -> list[tuple[int, dict[str, int]]]:
        seen = []
        for _ in range(4):
            ready, gens = asyncio.Event(), []

            async def hold(ready: asyncio.Event = ready, gens: list[Any] = gens) -> None:
                opts = colibri.EngineOptions(learn=False, max_batch=4, state_dir=tmp_path)
                # (the bundled demo model: its experts stream at this budget, io_uring)
                async with colibri.Engine.open(None, ram_budget="16MiB", options=opts) as e:
                    gens.extend(asyncio.ensure_future(one(e)) for _ in range(2))
                    ready.set()
                    await asyncio.sleep(1000)

            host.append(asyncio.ensure_future(hold()))
            await ready.wait()
            await asyncio.sleep(0.3)
            host[-1].cancel()
            with pytest.raises(asyncio.CancelledError):
                await host[-1]
            ended = await asyncio.wait_for(asyncio.gather(*gens), 60)
            assert all("closed" in m for m in ended), ended
            await asyncio.sleep(0.2)
            gc.collect()
            seen.append((threading.active_count(), _fds()))
        return seen

    gc.collect()  # (a container an earlier test dropped closes its shards now, not mid-test)
    before = _fds()
    seen = asyncio.run(main())
    # nothing piles up from one engine to the next (an idle anyio worker thread may expire
    # meanwhile: threads may only go down)
    assert seen[1][1] == seen[-1][1] and seen[-1][0] <= seen[1][0], seen
    # and no shard stays open after its engine (beyond what was open before this test: in CI
    # an earlier test's container was still open here)
    shards = {k: n - before.get(k, 0) for k, n in seen[-1][1].items() if "safetensors" in k}
    assert all(n <= 0 for n in shards.values()), (shards, before)


def test_an_open_timed_out_by_wait_for_waits_for_its_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncio.wait_for around Engine.open returned the timeout while the experts went on
    loading in a worker thread (tens of GB of a large model read after the caller was told
    the open was cancelled; a retry loaded a second copy beside it). The deadline (a native
    asyncio timeout, as wait_for's) falls 0.2 s into the load, however long the open took to
    get there (a fixed 0.5 s ran out before the load began on a busy machine)."""
    import threading
    import time

    import runtime.weights as weights_mod

    plain = weights_mod.ResidentExperts.__init__
    log: list[tuple[str, float]] = []
    started = threading.Event()

    def slow(
        self: weights_mod.ResidentExperts, container: object, *a: object, **kw: object
    ) -> None:
        if a and a[0] == []:  # (the empty source load_model gets)
            plain(self, container, *a, **kw)  # type: ignore[arg-type]
            return
        log.append(("start", time.perf_counter()))
        started.set()
        time.sleep(1.0)
        plain(self, container, *a, **kw)  # type: ignore[arg-type]
        log.append(("end", time.perf_counter()))

    monkeypatch.setattr(weights_mod.ResidentExperts, "__init__", slow)

    async def main() -> float:
        loop = asyncio.get_running_loop()

        async def opener() -> None:
            opts = colibri.EngineOptions(learn=False, state_dir=tmp_path)
            async with colibri.Engine.open(DEMO, options=opts):
                pass

        with pytest.raises(TimeoutError):
            async with asyncio.timeout(None) as deadline:

                async def arm() -> None:
                    while not started.is_set():
                        await asyncio.sleep(0.01)
                    deadline.reschedule(loop.time() + 0.2)

                arming = asyncio.ensure_future(arm())
                try:
                    await opener()
                finally:
                    arming.cancel()
        return time.perf_counter()

    back = asyncio.run(main())
    assert [k for k, _ in log] == ["start", "end"] and log[1][1] <= back, (log, back)


def test_native_cancels_keep_one_grammar_compile_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generations cancelled by wait_for while their grammar compiled freed the compile
    limiter with the compile still running: four big schemas compiled at once."""
    import threading
    import time

    from runtime.grammar import TokenGrammar

    plain = TokenGrammar.matcher
    lock, now, peak = threading.Lock(), [0], [0]

    slow_on = [True]

    def slow(self: TokenGrammar, grammar: object) -> object:
        if not slow_on[0]:
            return plain(self, grammar)  # type: ignore[arg-type]
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        try:
            time.sleep(0.5)
            return plain(self, grammar)  # type: ignore[arg-type]
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(TokenGrammar, "matcher", slow)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    async def main() -> None:
        opts = colibri.EngineOptions(learn=False, draft="off", state_dir=tmp_path)
        async with colibri.Engine.open(DEMO, options=opts) as engine:

            async def gen(k: int) -> None:
                spec = colibri.GrammarSpec("json_schema", {**schema, "title": f"s{k}"})
                async for _ in engine.generate([1, 2, 3], max_new_tokens=4, grammar=spec):
                    pass

            slow_on[0] = False
            await gen(99)  # (the tokenizer's grammar tables, built once, not slowed)
            slow_on[0] = True

            tasks = []
            for k in range(4):  # each one's compile starts while the one before still runs
                tasks.append(asyncio.ensure_future(asyncio.wait_for(gen(k), 0.1)))
                await asyncio.sleep(0.15)
            for t in tasks:
                with pytest.raises(TimeoutError):
                    await t
            await asyncio.sleep(2.5)  # (what was started ends)

    asyncio.run(main())
    assert peak[0] == 1, peak


def test_calls_cancelled_before_their_turn_are_not_counted(tmp_path: Path) -> None:
    """Engine.forward calls cancelled (task.cancel) before they reached the compute thread
    were counted as forward calls and prefill steps all the same."""

    async def main() -> tuple[dict[str, int], int]:
        opts = colibri.EngineOptions(learn=False, state_dir=tmp_path)
        async with colibri.Engine.open(DEMO, options=opts) as engine:
            sched = engine._scheduler
            ran = [0]
            timed = sched._timed

            def counted(*args: object) -> object:
                ran[0] += 1
                return timed(*args)  # type: ignore[arg-type]

            sched._timed = counted  # type: ignore[method-assign]
            before = engine.stats()
            for turns in range(6):
                for _ in range(4):
                    t = asyncio.ensure_future(engine.forward([1, 2, 3]))
                    for _ in range(turns):
                        await asyncio.sleep(0)
                    t.cancel()
                    try:
                        await t
                    except asyncio.CancelledError:
                        pass
            after = engine.stats()
            return {k: after[k] - before[k] for k in ("forward_calls", "prefill_steps")}, ran[0]

    got, ran = asyncio.run(main())
    assert got == {"forward_calls": ran, "prefill_steps": ran}, (got, ran)

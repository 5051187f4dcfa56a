"""Concurrent generations share decode steps: each equals its solo output bit for bit, and the
expert reads of a step are unioned (bytes read per token fall as users are added)."""

from __future__ import annotations

import functools
from contextlib import aclosing
from typing import Any

import anyio
import numpy as np
import pytest
from _demo import demo_model

import colibri
import runtime.scheduler as scheduler_mod
from colibri._engine import TokenEvent

DEMO = demo_model()
PROMPTS = [
    [int(x) for x in np.random.default_rng(s).integers(3, 999, size=6 + s)] for s in range(8)
]


pytestmark = pytest.mark.usefixtures("private_home")


async def _collect(engine: colibri.Engine, prompt: list[int], out: dict[int, list[int]], k: int,
                   **kw: Any) -> None:  # fmt: skip
    toks = []
    async for ev in engine.generate(prompt, max_new_tokens=20, **kw):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
    out[k] = toks


def _run(concurrent: bool, **opts: Any) -> tuple[dict[int, list[int]], dict[str, Any]]:
    async def main() -> tuple[dict[int, list[int]], dict[str, Any]]:
        out: dict[int, list[int]] = {}
        o = colibri.EngineOptions(learn=False, reader="threads", prefetch=False, **opts)
        async with colibri.Engine.open(DEMO, options=o) as eng:
            if concurrent:
                async with anyio.create_task_group() as tg:
                    for k, p in enumerate(PROMPTS):
                        tg.start_soon(_collect, eng, p, out, k)
            else:
                for k, p in enumerate(PROMPTS):
                    await _collect(eng, p, out, k)
            return out, eng.stats()

    return anyio.run(main)


@pytest.mark.parametrize("budget", [None, "4600KiB"])
def test_concurrent_generations_equal_solo_and_share_steps(budget: str | None) -> None:
    solo, s_stats = _run(False, ram_budget=budget)
    together, t_stats = _run(True, ram_budget=budget)
    assert together == solo
    assert t_stats["decode_batches"] > 0
    rows_per_step = t_stats["decode_batched_rows"] / t_stats["decode_batches"]
    assert rows_per_step > 2  # steps really were shared
    if budget is not None:
        # Unioned reads: with nothing cached, shared steps read an expert once for all rows.
        tokens = t_stats["generated_tokens"]
        assert tokens == s_stats["generated_tokens"]
        assert t_stats["experts"]["bytes_read"] < 0.8 * s_stats["experts"]["bytes_read"]


def test_sampled_concurrent_generations_are_reproducible() -> None:
    async def main() -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        async with colibri.Engine.open(DEMO, options=colibri.EngineOptions(learn=False)) as eng:
            async with anyio.create_task_group() as tg:
                for k, p in enumerate(PROMPTS[:4]):
                    tg.start_soon(
                        functools.partial(_collect, eng, p, out, k, temperature=0.9, seed=k)
                    )
        return out

    assert anyio.run(main) == anyio.run(main)


def test_no_batching_option_still_works() -> None:
    solo, st = _run(True, max_batch=1)
    ref, _ = _run(False)
    assert solo == ref
    assert st["decode_batches"] == 0


def test_generations_that_decode_together_stay_in_one_step() -> None:
    """Eight generations of the same length: once all of them decode, each step holds all of
    them. (The batcher once started the next step as soon as one generation had queued: from
    then on every token took a step of seven and a step of one.)"""

    async def main() -> dict[str, Any]:
        o = colibri.EngineOptions(learn=False, reader="threads", prefetch=False, draft="off")
        async with colibri.Engine.open(DEMO, options=o) as eng:

            async def one(p: list[int]) -> None:
                async for _ in eng.generate(p, max_new_tokens=32, stop_token_ids=[]):
                    pass

            async with anyio.create_task_group() as tg:
                for p in PROMPTS:
                    tg.start_soon(one, p)
            return eng.stats()

    stats = anyio.run(main)
    per_step = stats["decode_batched_sequences"] / stats["decode_batches"]
    assert per_step > 6, (per_step, stats["decode_batches"])


@pytest.mark.parametrize("draft", ["off", "mtp:2"])
def test_the_next_step_runs_while_the_consumer_works_on_a_token(draft: str) -> None:
    """While the consumer works on a token (a server's text, JSON and socket writes), the
    generation's next step has already left the batcher's queue and runs, so the step does
    not wait for the consumer; after the last token no step runs or waits."""

    async def main() -> list[tuple[int, int]]:
        o = colibri.EngineOptions(learn=False, reader="threads", prefetch=False, draft=draft)
        async with colibri.Engine.open(DEMO, options=o) as eng:
            sched = eng._scheduler
            steps = [0, 0]  # decode steps started, finished
            run = sched._decode_run

            async def counted(*args: Any) -> Any:
                steps[0] += 1
                try:
                    return await run(*args)
                finally:
                    steps[1] += 1

            sched._decode_run = counted  # type: ignore[method-assign]
            seen = []  # (steps queued, steps running) as the consumer gets each token
            async for ev in eng.generate(PROMPTS[1], max_new_tokens=9, stop_token_ids=[]):
                if isinstance(ev, TokenEvent):
                    seen.append((len(sched._pending), steps[0] - steps[1]))
            return seen

    seen = anyio.run(main)
    assert len(seen) == 9
    assert seen == [(0, 1)] * 8 + [(0, 0)]


@pytest.mark.parametrize("draft", ["off", "mtp:2"])
def test_every_generation_queues_its_next_step_before_any_consumer_works(draft: str) -> None:
    """Several generations decoding together: each queues its next step and lets the others
    queue theirs before its consumer gets the token, so the shared step is already running
    while the consumers work (it once waited for every consumer but the last to finish its
    work: a server's text, JSON and socket writes for seven streams, serial before the step)."""

    async def main() -> list[int]:
        o = colibri.EngineOptions(learn=False, reader="threads", prefetch=False, draft=draft)
        async with colibri.Engine.open(DEMO, options=o) as eng:
            sched = eng._scheduler
            seen: list[int] = []  # decode requests still queued when a consumer got a token

            async def one(p: list[int]) -> None:
                i = 0
                async for ev in eng.generate(p, max_new_tokens=10, stop_token_ids=[]):
                    if isinstance(ev, TokenEvent):
                        if 1 <= i < 8:  # (not the first token, after the prefills, nor the last)
                            seen.append(sum(not r.prefill for r in sched._pending))
                        i += 1

            async with anyio.create_task_group() as tg:
                for p in PROMPTS[:4]:
                    tg.start_soon(one, p)
            return seen

    seen = anyio.run(main)
    assert len(seen) >= 4 * 7 - 4  # (a speculative round hands out several tokens at once)
    assert seen == [0] * len(seen)


@pytest.mark.parametrize("draft", ["off", "mtp:2"])
@pytest.mark.parametrize("wait", [0.0, 0.2])
def test_a_consumer_that_stops_early_leaves_the_cache_as_without_run_ahead(
    draft: str, wait: float
) -> None:
    """The consumer stops after five tokens, at once (its queued step leaves the queue) or
    after the step ran (its row is cut): the kept cache holds the prompt and every handed-out
    token but the last, as a generation that never queued ahead would, and continuing from it
    gives the tokens of a fresh run."""
    prompt = PROMPTS[2]

    async def main() -> tuple[list[int], list[int], list[int], list[int]]:
        o = colibri.EngineOptions(learn=False, reader="threads", prefetch=False, draft=draft)
        async with colibri.Engine.open(DEMO, options=o) as eng:
            cache = eng.new_cache()
            toks: list[int] = []
            agen = eng.generate(prompt, max_new_tokens=20, stop_token_ids=[], cache=cache)
            async with aclosing(agen):  # type: ignore[type-var]
                async for ev in agen:
                    if isinstance(ev, TokenEvent):
                        toks.append(ev.token_id)
                        if len(toks) == 5:
                            await anyio.sleep(wait)
                            break
            kept = [int(t) for t in cache.tokens[: cache.length]]

            async def six(**kw: Any) -> list[int]:
                out = []
                async for ev in eng.generate(prompt + toks, max_new_tokens=6, **kw):
                    if isinstance(ev, TokenEvent):
                        out.append(ev.token_id)
                return out

            more = await six(cache=cache)
            fresh = await six()
            return toks, kept, more, fresh

    toks, kept, more, fresh = anyio.run(main)
    assert kept == prompt + toks[:4]
    assert more == fresh


def _prefill_all(concurrent: bool, budget: str | None) -> tuple[list[Any], dict[str, Any]]:
    """Every prompt of PROMPTS prefilled into a fresh cache (at once, or one after the other):
    their last rows' logits and the engine's counters."""

    async def main() -> tuple[list[Any], dict[str, Any]]:
        o = colibri.EngineOptions(learn=False, reader="threads", prefetch=False, ram_budget=budget)
        async with colibri.Engine.open(DEMO, options=o) as eng:
            sched = eng._scheduler
            got: list[Any] = [None] * len(PROMPTS)

            async def one(k: int) -> None:
                ids = np.asarray(PROMPTS[k], dtype=np.int64)
                got[k] = await sched.prefill(ids, eng.new_cache())

            if concurrent:
                async with anyio.create_task_group() as tg:
                    for k in range(len(PROMPTS)):
                        tg.start_soon(one, k)
            else:
                for k in range(len(PROMPTS)):
                    await one(k)
            return got, eng.stats()

    return anyio.run(main)


@pytest.mark.parametrize("budget", [None, "4600KiB"])
def test_prompts_queued_together_share_prefill_steps(budget: str | None) -> None:
    """Eight prompts that arrive together are prefilled in shared steps: each prompt's logits
    are the bits of its prefill alone, the steps are fewer than the chunks, and streaming, the
    union of their experts is read once per step instead of once per prompt."""
    solo, s_stats = _prefill_all(False, budget)
    together, t_stats = _prefill_all(True, budget)
    for a, b in zip(solo, together, strict=True):
        assert np.array_equal(a, b)
    assert s_stats["prefill_steps"] == s_stats["prefill_chunks"] == len(PROMPTS)
    assert t_stats["prefill_chunks"] == len(PROMPTS)
    assert t_stats["prefill_steps"] <= 2  # the first may run before the others queue
    assert t_stats["prefill_chunks_per_step"] >= 4
    if budget is not None:
        assert t_stats["prefill_bytes_read"] < 0.8 * s_stats["prefill_bytes_read"]


def test_a_prompt_that_fails_in_a_shared_prefill_step_fails_alone() -> None:
    """Three prompts queued together: one with a token id the model does not have (the shared
    forward fails), one whose hook fails. Each chunk then runs alone, so the good prompt gets
    the logits of its prefill alone and only the other two fail, each with its own error."""

    def boom(ids: Any, hidden: Any) -> None:
        raise RuntimeError("hook failed")

    async def main() -> tuple[Any, dict[str, Any], int, int, int]:
        o = colibri.EngineOptions(learn=False, reader="threads", prefetch=False)
        async with colibri.Engine.open(DEMO, options=o) as eng:
            sched = eng._scheduler
            alone = await sched.prefill(np.asarray(PROMPTS[0], dtype=np.int64), eng.new_cache())
            good, bad = eng.new_cache(), eng.new_cache()
            res: dict[str, Any] = {}

            async def run(key: str, ids: list[int], cache: Any, hook: Any = None) -> None:
                try:
                    res[key] = await sched.prefill(np.asarray(ids, dtype=np.int64), cache, hook)
                except Exception as exc:
                    res[key] = exc

            steps0 = sched.stats.prefill_steps
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "good", PROMPTS[0], good)
                tg.start_soon(run, "bad", [5, 6, 10**9], bad)
                tg.start_soon(run, "hook", PROMPTS[1], eng.new_cache(), boom)
            return alone, res, good.length, bad.length, sched.stats.prefill_steps - steps0

    alone, res, good_len, bad_len, steps = anyio.run(main)
    assert steps == 1  # the three were in one step
    assert np.array_equal(res["good"], alone)
    assert good_len == len(PROMPTS[0])
    assert isinstance(res["bad"], colibri.ColibriError) and "out of range" in str(res["bad"])
    assert bad_len == 0
    assert isinstance(res["hook"], RuntimeError)


@pytest.mark.parametrize(("wait", "steps"), [(0.0, 2), (0.5, 1)])
def test_a_prompt_queued_shortly_after_another_joins_its_prefill_step(
    wait: float, steps: int
) -> None:
    """Before a prefill step with room for more prompts the batcher waits ``prefill_wait``
    (by default a small share of a measured prefill step): a prompt queued 50 ms after
    another joins its step when the wait covers that, and goes in a step of its own when the
    batcher does not wait. (A server's concurrent requests reach the queue milliseconds
    apart.)"""

    async def main() -> int:
        o = colibri.EngineOptions(learn=False, reader="threads", prefetch=False)
        async with colibri.Engine.open(DEMO, options=o) as eng:
            sched = eng._scheduler
            sched.prefill_wait = wait
            steps0 = sched.stats.prefill_steps

            async def one(k: int, delay: float) -> None:
                await anyio.sleep(delay)
                await sched.prefill(np.asarray(PROMPTS[k], dtype=np.int64), eng.new_cache())

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, 0, 0.0)
                tg.start_soon(one, 1, 0.05)
            return sched.stats.prefill_steps - steps0

    assert anyio.run(main) == steps


def test_a_prompt_cancelled_while_the_batcher_waits_for_more_leaves_it_serving() -> None:
    """A prompt whose caller is cancelled while the batcher waits for more prompts before its
    prefill step leaves the queue (nothing of it computed), and the batcher goes on: the next
    prompt is prefilled as if alone."""

    async def main() -> tuple[int, bool, Any, Any]:
        o = colibri.EngineOptions(learn=False, reader="threads", prefetch=False)
        async with colibri.Engine.open(DEMO, options=o) as eng:
            sched = eng._scheduler
            ids = np.asarray(PROMPTS[3], dtype=np.int64)
            alone = await sched.prefill(ids, eng.new_cache())
            sched.prefill_wait = 0.5
            dropped = eng.new_cache()
            with anyio.move_on_after(0.05) as scope:
                await sched.prefill(np.asarray(PROMPTS[0], dtype=np.int64), dropped)
            await anyio.sleep(0.6)  # the batcher's wait ends with nothing queued
            with anyio.fail_after(30):
                again = await sched.prefill(ids, eng.new_cache())
            return dropped.length, scope.cancelled_caught, alone, again

    dropped_len, cancelled, alone, again = anyio.run(main)
    assert cancelled and dropped_len == 0
    assert np.array_equal(alone, again)


@pytest.mark.parametrize(
    ("decoding", "fast_prefill"), [(False, False), (True, False), (True, True)]
)
def test_a_prompt_rides_in_the_decode_step_or_waits_only_while_others_decode(
    decoding: bool, fast_prefill: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two prompts queued 50 ms apart. Alone, each goes at once in a prefill step of its own.
    While another generation decodes, each rides in one of its decode steps (a mixed step:
    the decoding generation is not stopped for a prefill step). Where prefill and decode
    compute differently (--fast-prefill), they cannot share a step: the batcher then waits
    for more prompts while others decode, and the two share one prefill step. (The wait's
    share and cap are raised here so that it covers 50 ms.)"""
    monkeypatch.setattr(scheduler_mod, "PREFILL_WAIT_SHARE", 1000.0)
    monkeypatch.setattr(scheduler_mod, "PREFILL_WAIT_MAX_S", 0.5)

    async def main() -> tuple[int, int]:
        o = colibri.EngineOptions(
            learn=False, reader="threads", prefetch=False, draft="off", fast_prefill=fast_prefill
        )
        async with colibri.Engine.open(DEMO, options=o) as eng:
            sched = eng._scheduler
            await sched.prefill(np.asarray(PROMPTS[2], dtype=np.int64), eng.new_cache())
            done = anyio.Event()

            async def background() -> None:
                async for _ in eng.generate(PROMPTS[4], max_new_tokens=10_000, stop_token_ids=[]):
                    if done.is_set():
                        break

            async def one(k: int, delay: float) -> None:
                await anyio.sleep(delay)
                await sched.prefill(np.asarray(PROMPTS[k], dtype=np.int64), eng.new_cache())

            async with anyio.create_task_group() as tg:
                if decoding:
                    tg.start_soon(background)
                    with anyio.fail_after(30):
                        while sched._decoding == 0:
                            await anyio.sleep(0.01)
                steps0, mixed0 = sched.stats.prefill_steps, sched.stats.mixed_steps
                async with anyio.create_task_group() as inner:
                    inner.start_soon(one, 0, 0.0)
                    inner.start_soon(one, 1, 0.05)
                done.set()
            return sched.stats.prefill_steps - steps0, sched.stats.mixed_steps - mixed0

    steps, mixed = anyio.run(main)
    if not decoding:
        assert (steps, mixed) == (2, 0)
    elif fast_prefill:
        assert (steps, mixed) == (1, 0)
    else:
        assert (steps, mixed) == (2, 2)


@pytest.mark.parametrize("draft", ["off", "4", "mtp:2"])
def test_a_generation_left_with_break_leaves_its_kept_cache_whole(draft: str) -> None:
    """Breaking out of ``generate(cache=...)`` leaves the generator to be closed later by the
    event loop, with its next step queued (the batcher's pipelining): the next generation on
    the kept cache truncated and prefilled while that step still ran and was cut afterwards,
    and its tokens and logprobs were those of a damaged context. It now waits for that step
    to leave the queue or be cut: a kept cache gives what a fresh one gives."""
    prompt = PROMPTS[3]

    async def main() -> list[tuple[Any, Any]]:
        o = colibri.EngineOptions(learn=False, reader="threads")
        async with colibri.Engine.open(DEMO, options=o) as eng:

            async def first(cache: Any) -> list[int]:
                got: list[int] = []
                gen = eng.generate(
                    prompt, max_new_tokens=30, temperature=0.9, seed=1, cache=cache, draft=draft
                )
                async for ev in gen:
                    if isinstance(ev, TokenEvent):
                        got.append(ev.token_id)
                        if len(got) == 3:
                            break  # no aclosing(): the loop closes the generator later
                return got

            async def turn(p: list[int], cache: Any) -> list[tuple[int, float]]:
                out = []
                gen = eng.generate(
                    p, max_new_tokens=8, temperature=0.9, seed=2, cache=cache, draft=draft
                )
                async with aclosing(gen) as events:
                    async for ev in events:
                        if isinstance(ev, TokenEvent):
                            out.append((ev.token_id, ev.logprob))
                return out

            pairs = []
            for _ in range(3):
                cache = eng.new_cache()
                p2 = prompt + await first(cache) + [44, 45]
                pairs.append((await turn(p2, cache), await turn(p2, None)))
            return pairs

    for kept, fresh in anyio.run(main):
        assert kept == fresh


def test_prompt_reuse_counts_what_the_next_generation_reuses_after_a_break() -> None:
    """With the step a broken-off generation queued still on the cache, prompt_reuse (what a
    server or chat reports as cached) counted that step's row, which the next generation cuts
    first: one token more than it reused."""
    from colibri._engine import DoneEvent

    prompt = PROMPTS[2]

    async def main() -> tuple[int, int]:
        o = colibri.EngineOptions(learn=False, reader="threads")
        async with colibri.Engine.open(DEMO, options=o) as eng:
            cache = eng.new_cache()
            got: list[int] = []
            gen = eng.generate(prompt, max_new_tokens=30, cache=cache, draft="off")
            async for ev in gen:  # held, not closed: its queued step stays on the cache
                if isinstance(ev, TokenEvent):
                    got.append(ev.token_id)
                    if len(got) == 3:
                        break
            await anyio.sleep(0.3)  # the queued step runs meanwhile
            p2 = prompt + got + [44, 45]
            predicted = eng.prompt_reuse(cache, p2)
            reused = -1
            async for ev in eng.generate(p2, max_new_tokens=2, cache=cache, draft="off"):
                if isinstance(ev, DoneEvent):
                    reused = int(ev.stats["prompt_tokens_reused"])
            await gen.aclose()
            return predicted, reused

    predicted, reused = anyio.run(main)
    assert predicted == reused == len(PROMPTS[2]) + 2, (predicted, reused)

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
def test_the_next_step_is_queued_before_a_token_is_handed_out(draft: str) -> None:
    """While the consumer works on a token (a server's text, JSON and socket writes), the
    generation's next step already waits in the batcher's queue, so the step does not wait
    for the consumer; after the last token nothing is queued."""

    async def main() -> list[int]:
        o = colibri.EngineOptions(learn=False, reader="threads", prefetch=False, draft=draft)
        async with colibri.Engine.open(DEMO, options=o) as eng:
            sched = eng._scheduler
            queued = []
            async for ev in eng.generate(PROMPTS[1], max_new_tokens=9, stop_token_ids=[]):
                if isinstance(ev, TokenEvent):
                    queued.append(len(sched._pending))
            return queued

    assert anyio.run(main) == [1] * 8 + [0]


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

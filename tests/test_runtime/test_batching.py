"""Concurrent generations share decode steps: each equals its solo output bit for bit, and the
expert reads of a step are unioned (bytes read per token fall as users are added)."""

from __future__ import annotations

import functools
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

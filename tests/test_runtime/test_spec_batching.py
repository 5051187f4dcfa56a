"""Speculative generations keep drafting while others decode: their verify rows join the engine's
batched step (one forward_batch) and every generation's tokens equal its solo output."""

from __future__ import annotations

import functools
from typing import Any

import anyio
import numpy as np
import pytest
from _demo import demo_model

import colibri
from colibri._engine import DoneEvent, TokenEvent
from runtime.grammar import GrammarSpec
from runtime.kv import KVCache
from runtime.speculative.cost import CostModel
from storage.errors import ModelError

DEMO = demo_model()
N = 24


pytestmark = pytest.mark.usefixtures("private_home")


def _prompts(n: int) -> list[list[int]]:
    """Prompts with repetition (prompt lookup finds matches), one random."""
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        p = [int(x) for x in rng.integers(3, 999, size=5 + i % 4)]
        out.append(p if i == n - 1 else p * 3 + p[:2])
    return out


def _options(**kw: Any) -> colibri.EngineOptions:
    return colibri.EngineOptions(learn=False, reader="threads", prefetch=False, **kw)


async def _gen(eng: colibri.Engine, prompt: list[int], **kw: Any) -> list[int]:
    toks: list[int] = []
    async for ev in eng.generate(prompt, max_new_tokens=N, **kw):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
        else:
            assert isinstance(ev, DoneEvent)
            assert ev.tokens == toks
    return toks


def _solo(jobs: list[tuple[list[int], dict[str, Any]]], **opts: Any) -> list[list[int]]:
    """Each job alone, one after another."""

    async def main() -> list[list[int]]:
        async with colibri.Engine.open(DEMO, options=_options(**opts)) as eng:
            return [await _gen(eng, p, **kw) for p, kw in jobs]

    return anyio.run(main)


def _together(
    jobs: list[tuple[list[int], dict[str, Any]]], **opts: Any
) -> tuple[list[list[int]], dict[str, Any]]:
    """All jobs concurrently on one engine; their tokens and the engine's stats."""

    async def main() -> tuple[list[list[int]], dict[str, Any]]:
        out: list[list[int]] = [[] for _ in jobs]

        async def one(i: int) -> None:
            out[i] = await _gen(eng, jobs[i][0], **jobs[i][1])

        async with colibri.Engine.open(DEMO, options=_options(**opts)) as eng:
            async with anyio.create_task_group() as tg:
                for i in range(len(jobs)):
                    tg.start_soon(one, i)
            return out, eng.stats()

    return anyio.run(main)


@pytest.mark.parametrize("budget", [None, "4600KiB"])
def test_concurrent_greedy_speculative_equals_solo_plain(budget: str | None) -> None:
    prompts = _prompts(4)
    drafts = ["auto", "lookup:3", "mtp:2", "3", "off"]
    jobs = [(p, {"draft": d}) for d in drafts for p in prompts]
    ref = _solo([(p, {"draft": "off"}) for _, p in ((d, p) for d in drafts for p in prompts)])
    got, st = _together(jobs, ram_budget=budget, max_batch=8)
    assert got == ref
    spec = st["speculative"]
    # drafts were proposed and accepted in rounds that shared the batched step
    assert spec["batched_verify_rounds"] > 0
    assert spec["batched_proposed"] > 0
    assert spec["batched_rounds"] >= spec["batched_verify_rounds"]
    # the batched steps carried several rows for some sequences (verify rows)
    assert st["decode_batches"] > 0
    assert st["decode_batched_rows"] > st["decode_batched_sequences"]
    assert st["decode_batched_sequences"] / st["decode_batches"] > 1


def test_drafts_of_a_batched_step_share_the_mtp_head_calls() -> None:
    # Four generations drafting with the head: each step's drafts run the head together (one
    # batched call serves several drafts), and every generation's tokens are its solo ones.
    prompts = _prompts(4)
    jobs = [(p, {"draft": "mtp:2"}) for p in prompts]
    got, st = _together(jobs, max_batch=8)
    assert got == _solo([(p, {"draft": "off"}) for p in prompts])
    assert st["speculative"]["batched_proposed"] > 0
    assert st["draft_head_calls"] > 0
    assert st["draft_head_drafts"] > 1.5 * st["draft_head_calls"]


def test_a_failed_shared_head_call_fails_only_the_drafts_in_it() -> None:
    # Fault injection: the batched MTP head call fails. The generations whose drafts were in
    # it get the error; a generation decoding without drafts in the same steps finishes with
    # its solo tokens, and the engine serves the next request (a lone head call) as before.
    prompts = _prompts(4)
    ref = _solo([(p, {"draft": "off"}) for p in prompts])

    async def main() -> tuple[list[Any], list[int]]:
        results: list[Any] = [None] * 4
        async with colibri.Engine.open(DEMO, options=_options(max_batch=8)) as eng:
            model = eng._model
            real = model.mtp_step_batch

            def failing(hiddens: Any, *a: Any, **kw: Any) -> Any:
                if len(hiddens) > 1:
                    raise ModelError("injected head failure")
                return real(hiddens, *a, **kw)

            model.mtp_step_batch = failing

            async def one(i: int) -> None:
                try:
                    results[i] = await _gen(eng, prompts[i], draft="off" if i == 3 else "mtp:2")
                except ModelError as exc:
                    results[i] = exc

            try:
                async with anyio.create_task_group() as tg:
                    for i in range(4):
                        tg.start_soon(one, i)
            finally:
                del model.mtp_step_batch
            after = await _gen(eng, prompts[0], draft="mtp:2")
            return results, after

    results, after = anyio.run(main)
    failed = [r for r in results[:3] if isinstance(r, ModelError)]
    assert len(failed) >= 2 and all("injected" in str(e) for e in failed)
    assert results[3] == ref[3]
    assert after == ref[0]


FORCING = GrammarSpec.json_schema(
    {
        "type": "object",
        "properties": {
            "the_answer_to_the_question": {"type": "integer", "minimum": 0, "maximum": 99},
            "how_sure_the_model_is": {"enum": ["very sure", "not sure"]},
        },
        "required": ["the_answer_to_the_question", "how_sure_the_model_is"],
        "additionalProperties": False,
    }
)


def test_forced_spans_accepted_in_batched_verify_rounds() -> None:
    # forced grammar spans are drafts the greedy target always accepts: batched rounds emit
    # several tokens per forward, with output identical to plain decoding alone
    prompts = _prompts(3)
    jobs: list[tuple[list[int], dict[str, Any]]] = [
        (prompts[0], {"draft": "2", "grammar": FORCING}),
        (prompts[1], {"draft": "auto", "grammar": FORCING}),
        (prompts[2], {"draft": "mtp:2"}),
        (prompts[0], {"draft": "off"}),
    ]
    ref = _solo([(p, {**kw, "draft": "off"}) for p, kw in jobs])
    got, st = _together(jobs, max_batch=8)
    assert got == ref
    spec = st["speculative"]
    assert spec["accepted"]["grammar"] >= 10
    assert spec["batched_accepted"] >= 10
    assert spec["batched_tokens"] > spec["batched_rounds"]  # > 1 token per shared forward
    assert st["decode_batched_rows"] > st["decode_batched_sequences"]


def test_without_batching_rounds_are_never_shared() -> None:
    prompts = _prompts(3)
    jobs = [(p, {"draft": "lookup:3"}) for p in prompts]
    got, st = _together(jobs, max_batch=1)
    assert got == _solo([(p, {"draft": "off"}) for p in prompts])
    assert st["speculative"]["batched_rounds"] == 0
    assert st["speculative"]["verify_steps"] > 0


def test_seeded_sampling_with_fixed_drafts_same_batched_or_alone() -> None:
    # A pinned source makes the schedule a function of the tokens: a seed reproduces its output
    # whether the verify rows ran alone or in a shared step.
    prompts = _prompts(4)
    jobs = [(p, {"draft": d, "temperature": 0.8, "seed": i}) for i, p in enumerate(prompts)
            for d in ("lookup:2", "mtp:1")]  # fmt: skip
    got, st = _together(jobs, max_batch=8)
    assert got == _solo(jobs)
    assert st["speculative"]["batched_verify_rounds"] > 0


def test_cancelling_one_generation_mid_batch_leaves_the_others_intact() -> None:
    prompts = _prompts(4)
    drafts = ["lookup:3", "lookup:2", "off", "lookup:4"]  # the MTP head: one generation's
    ref = _solo([(p, {"draft": "off"}) for p in prompts])

    async def main() -> tuple[list[list[int]], list[int], KVCache, dict[str, Any]]:
        out: list[list[int]] = [[] for _ in prompts]
        cut: list[int] = []
        async with colibri.Engine.open(DEMO, options=_options(max_batch=8)) as eng:
            kept = eng.new_cache()

            async def victim() -> None:
                with anyio.CancelScope() as scope:
                    async for ev in eng.generate(
                        prompts[0], max_new_tokens=N, draft="lookup:3", cache=kept
                    ):
                        assert isinstance(ev, TokenEvent)
                        cut.append(ev.token_id)
                        if len(cut) >= 5:
                            scope.cancel()

            # cancelled while its verify rows are in a running step: only this generation drafts
            # with the MTP head, so the head's routing (seen on the compute thread, while the
            # batcher prepares its rows) says its round is in the step about to run
            kept2 = eng.new_cache()
            cut2: list[int] = []
            scope2 = anyio.CancelScope()
            hits: list[int] = []
            n_main = int(eng._model.config.num_hidden_layers)

            def observe(event: str, layer: int, arr: Any) -> None:
                if event == "route" and layer >= n_main and len(cut2) >= 4 and not hits:
                    hits.append(len(cut2))
                    anyio.from_thread.run_sync(scope2.cancel)

            async def victim2() -> None:
                with scope2:
                    async for ev in eng.generate(
                        prompts[2], max_new_tokens=N, draft="mtp:3", cache=kept2
                    ):
                        if isinstance(ev, TokenEvent):
                            cut2.append(ev.token_id)

            async def one(i: int) -> None:
                out[i] = await _gen(eng, prompts[i], draft=drafts[i])

            with eng._scheduler.observing(observe):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(victim)
                    tg.start_soon(victim2)
                    for i in range(len(prompts)):
                        tg.start_soon(one, i)
            # the engine goes on serving after the cancellations
            out.append(await _gen(eng, prompts[1], draft="mtp:2"))
            assert hits and len(cut2) == hits[0] < N  # cancelled mid-step, no token after
            assert cut2 == ref[2][: len(cut2)]
            # its cache holds the prompt and what it emitted, no unchecked drafts
            assert [int(t) for t in kept2.tokens] == (prompts[2] + ref[2])[: kept2.length]
            assert kept2.length == len(prompts[2]) + len(cut2)
            return out, cut, kept, eng.stats()

    out, cut, kept, st = anyio.run(main)
    assert out[:4] == ref
    assert out[4] == ref[1]
    assert 5 <= len(cut) < N and cut == ref[0][: len(cut)]
    # the cancelled generation's kept cache holds no unchecked drafts: a prefix of the truth
    truth = prompts[0] + ref[0]
    assert kept.length <= len(prompts[0]) + len(cut)
    assert [int(t) for t in kept.tokens] == truth[: kept.length]
    assert st["speculative"]["batched_verify_rounds"] > 0


def test_the_cost_model_learns_what_a_batched_step_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batched step's forward (all its generations' rows) is observed once per step: the
    auto policy weighs drafts against what wide steps really cost. With ``mtp:2`` a round
    alone has 3 rows; every observed step wider than that was a shared one."""
    prompts = _prompts(4)
    seen: list[tuple[int, float]] = []
    real = CostModel.observe_step

    def spy(self: CostModel, rows: int, seconds: float, **kw: Any) -> None:
        seen.append((rows, seconds))
        real(self, rows, seconds, **kw)

    monkeypatch.setattr(CostModel, "observe_step", spy)

    async def main() -> dict[str, Any]:
        async with colibri.Engine.open(DEMO, options=_options(max_batch=8)) as eng:
            async with anyio.create_task_group() as tg:
                for p in prompts:
                    tg.start_soon(functools.partial(_gen, eng, p, draft="mtp:2"))
            return eng.stats()

    st = anyio.run(main)
    wide = [rows for rows, _ in seen if rows > 3]
    assert wide, seen
    # once per step, not once per generation in it
    assert len(wide) <= st["decode_batches"]
    assert st["speculative"]["batched_verify_rounds"] > len(wide)
    assert all(s > 0 for _, s in seen)

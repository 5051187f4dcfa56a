"""Expert-major chunked prefill: any chunk size gives the same bits as token-by-token prefill,
prefill does not flush the decode hot set, and an interrupted prefill resumes from its KV."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from _demo import demo_model

import colibri
from colibri._engine import DoneEvent, TokenEvent
from runtime.models import load_model
from storage.container import Container

DEMO = demo_model()
PROMPT = [int(x) for x in np.random.default_rng(7).integers(3, 999, size=70)]


pytestmark = pytest.mark.usefixtures("private_home")


def _generate(path: Path, **opts: Any) -> tuple[list[int], list[float], dict[str, Any]]:
    async def main() -> tuple[list[int], list[float], dict[str, Any]]:
        async with colibri.Engine.open(path, options=colibri.EngineOptions(**opts)) as eng:
            toks: list[int] = []
            lps: list[float] = []
            async for ev in eng.generate(PROMPT, max_new_tokens=16):
                if isinstance(ev, TokenEvent):
                    toks.append(ev.token_id)
                    lps.append(ev.logprob)
            return toks, lps, eng.stats()

    return anyio.run(main)


@pytest.mark.parametrize("path_kind", ["demo", "deepseek_v3"])
def test_model_rows_are_bit_identical_for_any_chunking(
    path_kind: str, oracle_dir: Path, tmp_path: Path
) -> None:
    if path_kind == "demo":
        path = DEMO
    else:
        from storage.convert import convert

        path = tmp_path / "dsv3"
        convert(oracle_dir / "deepseek_v3", path)
    c = Container.open(path)
    m = load_model(c)  # calls without a StepContext run absorbed attention, as the engine does
    ids = np.array(PROMPT, dtype=np.int64)

    def run(chunk: int) -> np.ndarray:
        cache = m.new_cache()
        return np.concatenate(
            [m.forward(ids[i : i + chunk], cache).logits for i in range(0, ids.size, chunk)]
        )

    ref = run(1)  # token-by-token
    for chunk in (7, 64, ids.size):
        assert np.array_equal(run(chunk), ref), chunk


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("budget", [None, "4600KiB"])
def test_engine_chunked_prefill_same_tokens_and_logprobs(chunk: int, budget: str | None) -> None:
    ref = _generate(DEMO, prefill_chunk=1, learn=False)
    got = _generate(DEMO, prefill_chunk=chunk, ram_budget=budget, learn=False, reader="threads")
    assert got[0] == ref[0]
    assert got[1] == ref[1]  # logprobs equal as floats: the logits are the same bits
    st = got[2]
    assert st["prefill_tokens"] == len(PROMPT)
    assert st["prefill_chunks"] == -(-len(PROMPT) // chunk)
    if budget is not None:
        assert st["experts"]["mode"] == "streaming"
        assert st["prefill_bytes_per_token"] > 0


def test_expert_major_prefill_reads_each_expert_once_per_chunk() -> None:
    """With nothing cached, a whole-prompt chunk reads each routed expert once per layer, while
    token-by-token prefill re-reads them for every token."""
    whole = _generate(DEMO, prefill_chunk=10_000, ram_budget="4600KiB", learn=False, pin=False,
                      prefetch=False, reader="threads")  # fmt: skip
    single = _generate(DEMO, prefill_chunk=1, ram_budget="4600KiB", learn=False, pin=False,
                       prefetch=False, reader="threads")  # fmt: skip
    assert whole[0] == single[0]
    w, s = whole[2], single[2]
    per_expert = w["experts"]["bytes_read"] / w["experts"]["experts_read"]
    moe_layers, experts = 3, 16  # the demo model's main MoE layers (MTP is not run here)
    assert w["prefill_bytes_read"] <= moe_layers * experts * per_expert + 1
    assert w["prefill_bytes_read"] * 3 < s["prefill_bytes_read"]
    # telemetry: one chunk, at most one read per (layer, expert) in it
    assert w["prefill_chunks"] == 1
    assert 0 < w["prefill_expert_reads_per_chunk"] <= moe_layers * experts
    assert s["prefill_expert_reads"] > 3 * w["prefill_expert_reads"]


def test_prefill_does_not_flush_the_decode_hot_set() -> None:
    async def main() -> tuple[list[list[int]], list[list[int]]]:
        opts = colibri.EngineOptions(ram_budget="5MiB", learn=False, prefetch=False,
                                     reader="threads", prefill_chunk=10_000)  # fmt: skip
        async with colibri.Engine.open(DEMO, options=opts) as eng:
            store = eng._store
            assert store.layout.lru_slots_per_layer < 16
            async for _ in eng.generate([5, 6, 7], max_new_tokens=40):
                pass  # decode fills every layer's LRU
            before = [store._lru[layer].keys() for layer in sorted(store._lru)]
            full = [len(k) == store.layout.lru_slots_per_layer for k in before]
            assert all(full[:3])
            # a long fresh prompt touches most experts once
            async for ev in eng.generate(PROMPT, max_new_tokens=1):
                if isinstance(ev, DoneEvent):
                    break
            after = [store._lru[layer].keys() for layer in sorted(store._lru)]
            return before, after

    before, after = anyio.run(main)
    # the same residents (the one decode step after the prompt may touch, not evict, them)
    assert [sorted(x) for x in before[:3]] == [sorted(x) for x in after[:3]]


def test_interrupted_prefill_resumes_from_committed_chunks() -> None:
    async def main() -> tuple[list[int], list[int], int, int]:
        opts = colibri.EngineOptions(learn=False, prefill_chunk=16)
        async with colibri.Engine.open(DEMO, options=opts) as eng:
            ref = [e.token_id async for e in eng.generate(PROMPT, max_new_tokens=8)
                   if isinstance(e, TokenEvent)]  # fmt: skip
            cache = eng.new_cache()
            chunks0 = eng.stats()["prefill_chunks"]
            with anyio.CancelScope() as scope:

                async def watch() -> None:
                    while eng.stats()["prefill_chunks"] < chunks0 + 2:
                        await anyio.sleep(0.001)
                    scope.cancel()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(watch)
                    async for _ in eng.generate(PROMPT, max_new_tokens=8, cache=cache):
                        pass
            kept = cache.length
            toks = [e.token_id async for e in eng.generate(PROMPT, max_new_tokens=8, cache=cache)
                    if isinstance(e, TokenEvent)]  # fmt: skip
            reused = eng.stats()["prompt_tokens_reused"]
            return ref, toks, kept, reused

    ref, toks, kept, reused = anyio.run(main)
    assert kept > 0 and kept % 16 == 0 and kept < len(PROMPT)
    assert reused >= kept
    assert toks == ref

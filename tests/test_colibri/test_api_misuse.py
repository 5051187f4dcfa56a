"""The embedding API under misuse and shutdown: what one caller does wrong never fails another
caller's generation, closing the engine ends the generations still running (never a hang),
an engine awaited from another event loop says so, and malformed arguments are ModelErrors.
The bundled demo model, real threads and event loops."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from _demo import budget_for_lru, demo_model

import colibri
from colibri import DoneEvent, Engine, EngineOptions, TokenEvent
from storage.errors import ColibriError, ModelError

DEMO = demo_model()


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("state")


def _opts(state_dir: Path, **kw: Any) -> EngineOptions:
    return EngineOptions(model=DEMO, state_dir=state_dir, **kw)


@dataclass
class _Running:
    tokens: list[int] = field(default_factory=list)
    done: DoneEvent | None = None


@asynccontextmanager
async def _beside_a_generation(engine: Engine, n: int) -> AsyncIterator[_Running]:
    """Generation A (``n`` tokens after [1, 2, 3], no early stop) in the background: the block
    runs once it has decoded 5 tokens, and A finishes before the block is left."""
    a = _Running()

    async def run() -> None:
        async for ev in engine.generate([1, 2, 3], max_new_tokens=n, stop_token_ids=[]):
            if isinstance(ev, TokenEvent):
                a.tokens.append(ev.token_id)
            else:
                a.done = ev

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            while len(a.tokens) < 5:
                await anyio.sleep(0.005)
            yield a


@pytest.mark.anyio
async def test_a_prompt_past_the_vocabulary_fails_only_its_own_generation(
    state_dir: Path, anyio_backend: str
) -> None:
    """B's bad prompt used to be found inside the batched step it shared with A's decode rows
    (its first chunk rides in A's step), and the error went to both."""
    async with Engine.open(options=_opts(state_dir)) as engine:
        async with _beside_a_generation(engine, 200) as a:
            with pytest.raises(
                ModelError, match=r"prompt token ids must be in 0\.\.\d+, got 99999"
            ):
                async for _ in engine.generate([1, 2, 99999], max_new_tokens=4):
                    pass
    assert a.done is not None and a.done.reason == "length" and len(a.tokens) == 200


@pytest.mark.anyio
@pytest.mark.parametrize(("max_batch", "streaming"), [(8, False), (1, False), (8, True)])
async def test_closing_the_engine_ends_a_running_generation(
    state_dir: Path, anyio_backend: str, max_batch: int, streaming: bool
) -> None:
    """A generation in a task outside the engine's block, still running when the block ends,
    raises the engine's closed error at its next step (it used to wait forever for the
    stopped batcher, or, with max_batch 1, go on computing on the closed engine)."""
    got: list[int] = []
    outcome: list[BaseException | str] = []

    async def generation(engine: Engine) -> None:
        try:
            async for ev in engine.generate([1, 2, 3], max_new_tokens=900, stop_token_ids=[]):
                if isinstance(ev, TokenEvent):
                    got.append(ev.token_id)
                else:
                    outcome.append(ev.reason)
        except ColibriError as exc:
            outcome.append(exc)

    # streaming: the reader closes under reads in flight, which is not a disk error (they
    # failed with "uring reader is closed", counted as read errors)
    budget = budget_for_lru(DEMO, 0) if streaming else None
    opts = _opts(state_dir, max_batch=max_batch, ram_budget=budget)
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            async with Engine.open(options=opts) as engine:
                tg.start_soon(generation, engine)
                while len(got) < 5:
                    await anyio.sleep(0.005)
    assert len(outcome) == 1 and isinstance(outcome[0], ColibriError), outcome
    assert "engine is closed" in str(outcome[0])
    assert len(got) < 900
    if streaming:
        assert engine.stats()["experts"]["read_errors"] == 0


def test_leaving_open_model_while_a_thread_generates_ends_that_generation(
    state_dir: Path,
) -> None:
    """The sync API: the block's exit used to wait forever for the other thread's generation
    (the portal waits for its tasks, the task for a batcher that had stopped)."""
    res: list[object] = []

    def worker(m: colibri.SyncModel) -> None:
        try:
            res.append(m.generate([1, 2, 3], max_new_tokens=900, stop_token_ids=[]))
        except ColibriError as exc:
            res.append(exc)

    closed = threading.Event()

    def close_and_signal() -> None:
        with colibri.open_model(DEMO, state_dir=state_dir) as m:
            m.generate([1, 2, 3], max_new_tokens=2)  # compiled and warm
            t = threading.Thread(target=worker, args=(m,), daemon=True)
            t.start()
            while not m.engine.stats()["generated_tokens"] > 2:
                threading.Event().wait(0.005)
        closed.set()
        t.join(60)

    closer = threading.Thread(target=close_and_signal, daemon=True)
    closer.start()
    closer.join(120)
    assert closed.is_set(), "leaving open_model() hung while another thread generated"
    assert len(res) == 1 and isinstance(res[0], ColibriError), res


def test_an_engine_awaited_from_another_event_loop_says_so(state_dir: Path) -> None:
    """SyncModel.engine awaited inside this thread's own asyncio.run: its batcher lives on the
    portal's loop, so a generation used to wait forever for a wake-up that never came."""
    with colibri.open_model(DEMO, state_dir=state_dir) as m:

        async def foreign() -> list[str]:
            errors = []
            try:
                async for _ in m.engine.generate([1, 2, 3], max_new_tokens=3):
                    pass
            except ColibriError as exc:
                errors.append(str(exc))
            try:
                await m.engine.forward([1, 2, 3])
            except ColibriError as exc:
                errors.append(str(exc))
            return errors

        errors = asyncio.run(asyncio.wait_for(foreign(), timeout=60))
        assert len(errors) == 2 and all("event loop that opened it" in e for e in errors)
        assert len(m.generate([1, 2, 3], max_new_tokens=3)) == 3  # still serves its own loop


@pytest.mark.anyio
async def test_malformed_sampling_and_stop_arguments_are_model_errors(
    state_dir: Path, anyio_backend: str
) -> None:
    async def run(**kw: Any) -> list[int]:
        out: list[int] = []
        async for ev in engine.generate([1, 2, 3], max_new_tokens=3, **kw):
            if isinstance(ev, DoneEvent):
                out = ev.tokens
        return out

    async with Engine.open(options=_opts(state_dir)) as engine:
        for bad in (
            {"temperature": None},
            {"temperature": "0.7"},
            {"temperature": True},
            {"top_p": None},
            {"top_p": "0.9"},
            {"stop_token_ids": 0},
            {"stop_token_ids": "12"},
            {"stop_token_ids": [1.5]},
        ):
            with pytest.raises(ModelError):
                await run(**bad)
        # any collection of ids works, a set or a generator as a list does
        greedy = await run(stop_token_ids=[])
        stop = greedy[1]
        for ids in ([stop], {stop}, (t for t in [stop]), iter([stop])):
            assert await run(stop_token_ids=ids) == greedy[: greedy.index(stop) + 1]


def test_engine_options_refuse_what_they_would_misread() -> None:
    """Each of these used to be read as something else (1.5 bytes as 1, True as one thread)
    or to fail with a bare OverflowError / TypeError."""
    for bad in (
        {"ram_budget": "9" * 400},
        {"ram_budget": 1.5},
        {"ram_budget": "1.9"},
        {"disk_weights": 5},
        {"threads": True},
        {"max_batch": True},
        {"expert_timeout": True},
        {"expert_timeout": float("inf")},  # crashed Ray's first wait
        {"prefill_chunk": False},
    ):
        with pytest.raises((ColibriError, ValueError)) as err:
            EngineOptions(**bad)
        assert not isinstance(err.value, (OverflowError, TypeError)), (bad, err.value)
    assert EngineOptions(ram_budget="1.5GiB").ram_budget == 1536 * 2**20
    assert EngineOptions(ram_budget=2e9).ram_budget == 2_000_000_000


def test_stats_have_every_documented_key_before_the_first_prompt(state_dir: Path) -> None:
    with colibri.open_model(DEMO, state_dir=state_dir) as m:
        fresh = m.stats()
        for key in ("prefill_tokens_per_s", "prefill_bytes_per_token",
                    "prefill_expert_reads_per_chunk", "prefill_chunks_per_step"):  # fmt: skip
            assert key in fresh and fresh[key] is None, key
        m.generate([1, 2, 3], max_new_tokens=2)
        assert m.stats()["prefill_tokens_per_s"] > 0


def test_no_hit_rate_before_the_first_expert_lookup(state_dir: Path) -> None:
    """It read 0.0 (a cold cache that missed everything) before any expert was looked up."""
    from _demo import budget_for_lru

    budget = budget_for_lru(DEMO, 2)
    with colibri.open_model(DEMO, ram_budget=budget, state_dir=state_dir, learn=False) as m:
        assert m.stats()["experts"]["mode"] == "streaming"
        assert m.stats()["experts"]["hit_rate"] is None
        m.generate([1, 2, 3], max_new_tokens=3)
        assert 0.0 <= m.stats()["experts"]["hit_rate"] <= 1.0


@pytest.mark.anyio
async def test_a_generation_that_fails_by_itself_fails_alone(
    state_dir: Path, anyio_backend: str
) -> None:
    """B continues a cache whose rows overflow (as a damaged one would): the step its prompt
    shares with A's decode rows fails, and used to fail A too. Each now runs again alone;
    only B fails, and A's tokens are those it gives alone."""
    alone: list[int] = []
    async with Engine.open(options=_opts(state_dir)) as engine:
        async for ev in engine.generate([1, 2, 3], max_new_tokens=120, stop_token_ids=[]):
            if isinstance(ev, DoneEvent):
                alone = ev.tokens
        bad = engine.new_cache()
        async for _ in engine.generate([7, 8, 9, 10], max_new_tokens=1, cache=bad):
            pass
        for layer in range(bad.n_layers):
            bad.latent(layer)[:] = 1e30  # every cached row far past any activation
        async with _beside_a_generation(engine, 120) as a:
            mixed = engine.stats()["mixed_steps"]
            with pytest.raises(ModelError, match="overflowed"):
                async for _ in engine.generate([7, 8, 9, 10, 11, 12], cache=bad):
                    pass
            assert engine.stats()["mixed_steps"] > mixed  # B's prompt rode in A's step
    assert a.done is not None and a.done.tokens == alone


_CANCEL_SCRIPT = """
import sys, anyio, colibri
from _demo import budget_for_lru, demo_model

async def main(backend_note: str) -> None:
    model = demo_model()
    opts = colibri.EngineOptions(
        model=model, ram_budget=budget_for_lru(model, 0), learn=False, state_dir=sys.argv[2]
    )
    for after in (1, 2, 3, 5, 8, 13):
        # a deadline of the app around the engine, cancelled while a step reads experts
        with anyio.CancelScope() as outer:
            async with colibri.Engine.open(options=opts) as e:
                assert e.stats()["experts"]["mode"] == "streaming"
                n = 0
                async for ev in e.generate([1, 2, 3], max_new_tokens=200, stop_token_ids=[]):
                    n += 1
                    if n == after:
                        outer.cancel()
        # a sibling task of the app fails while the engine generates
        async def fail() -> None:
            await anyio.sleep(0.05 * after)
            raise RuntimeError("another part of the service failed")
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(fail)
                async with colibri.Engine.open(options=opts) as e:
                    async for ev in e.generate([1, 2, 3], max_new_tokens=400, stop_token_ids=[]):
                        pass
        except BaseException as exc:  # the sibling's error, in a group
            assert "another part" in repr(exc), repr(exc)
    print("left every scope", flush=True)

anyio.run(main, sys.argv[1], backend=sys.argv[1])
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_cancelling_what_holds_a_streaming_engine_never_hangs(tmp_path: Path, backend: str) -> None:
    """A cancellation of the scope holding Engine.open (an app's deadline, a sibling task's
    failure, Ctrl-C) while a step waited for expert reads hung forever with streaming experts:
    the reads ran in the engine's task group, a read task cancelled before it started never
    ran a line, and the compute thread waited for its arrival (the engine's close waited for
    that thread). Now the step fails and every scope is left (a subprocess: a hang is a
    timeout, not a stuck test run)."""
    import subprocess
    import sys

    pytest.importorskip(backend)
    script = tmp_path / "cancel.py"
    script.write_text(_CANCEL_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": f"{root}:{root / 'tests'}", "PATH": "/usr/bin:/bin",
           "OMP_WAIT_POLICY": "PASSIVE", "HOME": str(tmp_path)}  # fmt: skip
    r = subprocess.run(
        [sys.executable, str(script), backend, str(tmp_path / "state")],
        capture_output=True, text=True, timeout=240, cwd=root, env=env,
    )  # fmt: skip
    assert r.returncode == 0 and "left every scope" in r.stdout, r.stderr[-3000:]


@pytest.mark.anyio
async def test_forward_runs_in_chunks_others_step_between_and_a_cancel_stops_it(
    state_dir: Path, anyio_backend: str
) -> None:
    """A long ``forward`` was one step: a timeout around it returned only once all of it ran,
    and every other generation stalled for its whole length. It runs in ``prefill_chunk``
    steps now (the same logits, bit for bit), and a cancelled caller stops at the next."""
    ids = [(7 * i) % 900 + 3 for i in range(200)]
    async with Engine.open(options=_opts(state_dir)) as whole:
        want = await whole.forward(ids)
    async with Engine.open(options=_opts(state_dir, prefill_chunk=16)) as engine:
        assert np.array_equal(await engine.forward(ids), want)
        model = engine._model
        calls: list[int] = []
        plain = model.forward_batch

        def counted(*a: Any, **kw: Any) -> Any:
            calls.append(len(a[0][0]))
            return plain(*a, **kw)

        model.forward_batch = counted  # type: ignore[method-assign]
        try:
            # a generation beside it takes steps between the forward's chunks
            order: list[str] = []

            async def gen() -> None:
                async for ev in engine.generate([1, 2, 3], max_new_tokens=6, stop_token_ids=[]):
                    if isinstance(ev, TokenEvent):
                        order.append("token")

            async def fwd() -> None:
                await engine.forward(ids)
                order.append("forward done")

            async with anyio.create_task_group() as tg:
                tg.start_soon(fwd)
                tg.start_soon(gen)
            assert order.index("forward done") > order.index("token")
            calls.clear()
            with anyio.CancelScope() as scope:

                async def cancel_once_started() -> None:
                    while not calls:
                        await anyio.sleep(0.001)
                    scope.cancel()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_once_started)
                    await engine.forward(ids)
            assert scope.cancelled_caught
            assert 1 <= len(calls) <= 2 < -(-len(ids) // 16)  # stopped after a chunk or two
        finally:
            del model.forward_batch
        assert np.array_equal(await engine.forward(ids), want)  # and the engine goes on


@pytest.mark.anyio
async def test_a_foreign_or_wrong_cache_and_a_0d_stop_array_are_model_errors(
    state_dir: Path, anyio_backend: str
) -> None:
    """A cache of another model's shape failed inside the step with a numpy broadcast error;
    a string as the cache with an AttributeError; a 0-d array of stop ids with a TypeError."""
    from runtime.kv import KVCache

    async def run(**kw: Any) -> None:
        async for _ in engine.generate([1, 2, 3], max_new_tokens=2, **kw):
            pass

    async with Engine.open(options=_opts(state_dir)) as engine:
        own = engine.new_cache()
        other = KVCache(own.n_layers, own.kv_lora_rank + 32, own.qk_rope_head_dim)
        for bad, words in (
            ({"cache": "x"}, "engine.new_cache()"),
            ({"cache": other}, "another model"),
            ({"stop_token_ids": np.array(3)}, "collection of token ids"),
        ):
            with pytest.raises(ModelError, match=words):
                await run(**bad)
        await run(cache=own)  # its own cache still works
        assert own.length > 0


def test_engine_options_errors_are_colibri_errors_and_a_dict_is_accepted(
    state_dir: Path,
) -> None:
    """A bad option was pydantic's ValidationError (not a ColibriError, unlike a bad budget);
    ``Engine.open(options={...})`` an AttributeError."""
    from storage.errors import OptionsError

    for bad in ({"threads": 0}, {"reader": "x"}, {"frobnicate": 1}):
        with pytest.raises(OptionsError) as err:
            EngineOptions(**bad)
        assert isinstance(err.value, ColibriError) and isinstance(err.value, ValueError)
        assert next(iter(bad)) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(OptionsError):
        with colibri.open_model(DEMO, threads=0):
            pass

    async def main() -> int:
        async with Engine.open(DEMO, options={"state_dir": state_dir, "max_batch": 2}) as e:
            return e.options.max_batch

    assert anyio.run(main) == 2

    async def wrong() -> None:
        async with Engine.open(DEMO, options="threads=1"):  # type: ignore[arg-type]
            pass

    with pytest.raises(OptionsError, match="EngineOptions"):
        anyio.run(wrong)


def test_a_blocking_call_inside_the_models_own_loop_is_a_colibri_error(state_dir: Path) -> None:
    """``model.call(coro)`` where the coroutine calls a blocking method: anyio's RuntimeError
    about the event loop thread; a ColibriError saying what to do now."""
    with colibri.open_model(DEMO, state_dir=state_dir) as m:

        async def nested() -> None:
            m.generate([1, 2, 3], max_new_tokens=2)

        with pytest.raises(ColibriError, match=r"await model\.engine"):
            m.call(nested)
        assert len(m.generate([1, 2, 3], max_new_tokens=2)) == 2  # still usable


def test_two_processes_on_one_state_dir_lose_no_usage_counts(tmp_path: Path) -> None:
    """Each engine saved the counts it held in memory: on a shared state directory (a chat
    beside a server, two chats) the last writer's counts replaced the other's turns. Each
    engine now adds what it counted since its last save to the file's counts: the file ends
    up with every turn of both, as one engine running them all would write."""
    from colibri._engine import ENGINE_ID
    from storage.usage import parse_usage

    def run(m: colibri.SyncModel, seed: int) -> None:
        m.generate([seed, seed + 1, seed + 2], max_new_tokens=6)

    def total(state: Path, m: colibri.SyncModel) -> int:
        arch = m.container.arch
        text = (state / ".coli_usage").read_text()
        return parse_usage(text, arch.total_layers, arch.n_routed_experts, ENGINE_ID).total

    shared, alone = tmp_path / "shared", tmp_path / "alone"
    opts: dict[str, Any] = {"draft": "off", "pin": False}
    with (
        colibri.open_model(DEMO, state_dir=shared, **opts) as a,
        colibri.open_model(DEMO, state_dir=shared, **opts) as b,
    ):
        run(a, 5)
        run(b, 9)
        run(a, 13)
        got = total(shared, a)
    with colibri.open_model(DEMO, state_dir=alone, **opts) as one:
        for seed in (5, 9, 13):
            run(one, seed)
        want = total(alone, one)
    assert got == want > 0

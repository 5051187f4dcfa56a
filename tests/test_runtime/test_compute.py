"""Expert compute: threads never change a bit, the fast prefill path (dequantize + BLAS) stays
within float rounding of the exact kernels, and a failing expert computation gives every
streamed buffer back."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from _demo import demo_model

import colibri
from colibri._config import EngineOptions
from colibri._engine import TokenEvent
from runtime.compute import ExpertCompute, causal_edges
from runtime.context import StepContext
from runtime.experts import ExpertStore, StreamingExperts
from runtime.kernels.dequant import dequantize
from runtime.linear import Linear
from runtime.models import load_model
from runtime.planner import PREFILL_CHUNK_MAX, PREFILL_CHUNK_RESIDENT, choose_prefill_chunk
from storage.container import Container
from storage.quant import dequantize as reference_dequantize
from storage.quant import quantize

DEMO = demo_model()
PROMPT = [int(x) for x in np.random.default_rng(11).integers(3, 999, size=90)]


pytestmark = pytest.mark.usefixtures("private_home")


@pytest.mark.parametrize(
    ("fmt", "shape"),
    [
        ("int4-g64", (37, 192)),
        ("int4-g32", (5, 99)),  # odd width: the last byte holds one column
        ("int4-g48", (33, 101)),  # group of 48: a multiple of 16, not of 64
        ("int4-g17", (9, 70)),  # odd group: groups end mid-byte
        ("int4-row", (21, 77)),
        ("int8", (13, 40)),
        ("bf16", (7, 33)),
        ("f16", (7, 33)),
        ("f32", (7, 33)),
    ],
)
def test_dequantize_matches_the_format_definition(fmt: str, shape: tuple[int, int]) -> None:
    w = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    q = quantize(w, fmt)
    ref = reference_dequantize(q)
    assert np.array_equal(dequantize(q), ref)
    scratch = np.full(shape[0] * shape[1] + 5, np.nan, dtype=np.float32)
    assert np.array_equal(dequantize(q, scratch), ref)  # into a larger reused scratch


def test_dequantize_rejects_a_small_scratch() -> None:
    q = quantize(np.ones((4, 8), np.float32), "int8")
    with pytest.raises(ValueError, match="32 elements"):
        dequantize(q, np.empty(31, np.float32))


def test_fast_matmul_agrees_with_the_exact_kernel() -> None:
    rng = np.random.default_rng(5)
    w = rng.standard_normal((96, 256)).astype(np.float32)
    lin = Linear(quantize(w, "int4-g64"))
    x = rng.standard_normal((40, 256)).astype(np.float32)
    comp = ExpertCompute(fast_min_rows=1)
    got = comp._dense(lin, x)
    exact = lin(x)
    assert comp.fast_calls == 1
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g17", "int4-row", "int8", "bf16", "f32"])
@pytest.mark.parametrize("parts", [2, 3, 7])
def test_output_feature_split_is_bit_identical(fmt: str, parts: int) -> None:
    rng = np.random.default_rng(parts)
    lin = Linear(quantize(rng.standard_normal((203, 99)).astype(np.float32), fmt))
    x = rng.standard_normal((3, 99)).astype(np.float32)
    whole = lin(x)
    pieces = lin.split(parts)
    assert pieces[0][0] == 0 and pieces[-1][1] == 203
    assert np.array_equal(np.concatenate([p(x) for _, _, p in pieces], axis=1), whole)
    comp = ExpertCompute(parts, parallel_min_macs=0)
    try:
        for rows in (x[:1], x):
            assert np.array_equal(comp.linear(lin, rows), lin(rows))
        assert comp.split_calls == (2 if 203 >= 64 * parts else 0)
    finally:
        comp.close()


def test_threads_give_bit_identical_rows_resident() -> None:
    c = Container.open(DEMO)
    m = load_model(c)
    ids = np.array(PROMPT, dtype=np.int64)

    def chunked(size: int, ctx: StepContext) -> np.ndarray:
        cache = m.new_cache()
        return np.concatenate(
            [m.forward(ids[i : i + size], cache, ctx=ctx).logits for i in range(0, ids.size, size)]
        )

    serial = StepContext()
    ref = chunked(1, serial)  # token by token: nothing to split
    # serially, each layer's routed experts ran as one kernel call (routed_layer); the pool
    # runs them expert by expert: the same bits
    assert serial.compute.layer_calls > 0
    pool = StepContext(ExpertCompute(3, parallel_min_macs=0))
    try:
        # whole prompt, and chunks after a prefix (row blocks of later chunks see the cache)
        # and token by token: one row, so lm_head, shared and dense MLPs split their output
        # features over the pool instead
        for size in (ids.size, 31, 1):
            assert np.array_equal(chunked(size, pool), ref), size
        assert pool.compute.parallel_steps > 0  # the pool really ran the experts
        assert pool.compute.layer_calls == 0
        assert pool.compute.split_calls > 0  # ... and split one-row matmuls
    finally:
        pool.compute.close()


def test_shared_jobs_run_here_and_on_the_workers_in_order() -> None:
    """A step's jobs (resident experts, row blocks) run on the calling thread and the workers,
    each taking the next job: every result in its job's place, the calling thread computing
    too (and splitting nothing over the pool meanwhile), a job's error raised once all
    runners stopped."""
    comp = ExpertCompute(3)
    here = threading.current_thread()
    ran: list[tuple[int, threading.Thread, bool]] = []
    all_three = threading.Barrier(3)

    def job(i: int) -> int:
        if i < 3:  # a runner held here takes no other job: the first three need three runners
            all_three.wait(timeout=60)
        ran.append((i, threading.current_thread(), comp._on_worker()))
        return i * i

    try:
        assert comp._share([lambda i=i: job(i) for i in range(9)]) == [i * i for i in range(9)]
        assert sorted(i for i, _, _ in ran) == list(range(9))
        threads = {t for _, t, _ in ran}
        assert here in threads and len(threads) == 3  # this thread and both workers
        assert all(worker for _, _, worker in ran)  # nobody waits on the pool inside a job
        assert not comp._on_worker()  # ... and this thread is itself again afterwards
        rows = comp.map_rows([(0, 2), (2, 5), (5, 6)], lambda a, b: list(range(a, b)))
        assert rows == [[0, 1], [2, 3, 4], [5]]

        done: list[int] = []

        def bad(i: int) -> int:
            if i == 1:
                raise ValueError("job 1 failed")
            done.append(i)
            return i

        with pytest.raises(ValueError, match="job 1 failed"):
            comp._share([lambda i=i: bad(i) for i in range(6)])
        assert sorted(done) == [0, 2, 3, 4, 5]  # the others ran to the end before the raise
    finally:
        comp.close()


def test_a_worker_that_never_began_is_not_waited_for() -> None:
    """The calling thread runs every job when the pool's worker is busy elsewhere, and
    returns without waiting for that worker (it would only have found no job left)."""
    comp = ExpertCompute(2)
    busy, release = threading.Semaphore(0), threading.Event()
    pool = comp._pool
    assert pool is not None

    def hold() -> None:
        busy.release()
        release.wait(timeout=60)

    holds = [pool.submit(hold) for _ in range(pool._max_workers)]  # every worker of the pool
    try:
        for _ in holds:
            assert busy.acquire(timeout=60)
        returned = threading.Event()
        got: list[list[int]] = []

        def call() -> None:
            got.append(comp._share([lambda i=i: i + 1 for i in range(4)]))
            returned.set()

        caller = threading.Thread(target=call)
        caller.start()
        assert returned.wait(timeout=30)  # (waited for the held worker before)
        assert got == [[1, 2, 3, 4]]
        assert not any(h.done() for h in holds)  # ... which are still held
    finally:
        release.set()
        for h in holds:
            h.result(timeout=60)
        caller.join(timeout=60)
        comp.close()


@pytest.mark.parametrize("poll_iters", [0, 10**9])
def test_a_countdown_waits_for_every_part(poll_iters: int) -> None:
    """``Countdown.wait`` returns once every part ticked (polled or slept: the same), also
    when a part failed (which it records); the poll kernel runs without the GIL."""
    from runtime.countdown import KERNELS, Countdown, iterations_per_us

    assert all(k.targetoptions.get("nogil") is True for k in KERNELS)
    assert iterations_per_us() > 0
    cd = Countdown(3, poll_iters)
    go = threading.Event()

    def part(ok: bool) -> None:
        go.wait(timeout=60)
        cd.tick(ok)

    threads = [threading.Thread(target=part, args=(i != 1,)) for i in range(3)]
    for t in threads:
        t.start()
    waiter = threading.Thread(target=cd.wait)
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive()  # nothing ticked yet: still waiting
    go.set()
    waiter.join(timeout=60)
    assert not waiter.is_alive() and cd.failed
    for t in threads:
        t.join()
    Countdown(0, poll_iters).wait()  # nothing to wait for
    with pytest.raises(ValueError, match="parts"):
        Countdown(-1, 0)


def test_an_uneven_step_splits_its_last_expert_over_the_threads() -> None:
    """With every expert resident and more jobs than divide evenly over the threads, the last
    expert of a MoE step runs in parts on all of them (``split_experts``), bit-identical to
    the serial path; a part that fails raises from the step instead of leaving the other
    thread waiting for it."""
    from runtime.kernels.quant_matmul import SplitExpert
    from runtime.layers import moe as moe_ops
    from runtime.scheduler import moe_step

    c = Container.open(DEMO)
    m = load_model(c)
    ids = np.array(PROMPT[:12], dtype=np.int64)
    serial = StepContext()
    ref_cache, cache = m.new_cache(), m.new_cache()
    comp = ExpertCompute(2, parallel_min_macs=0)
    try:
        ctx = StepContext(comp)
        for t in range(ids.size):  # token by token: the steps of decode
            want = m.forward(ids[t : t + 1], ref_cache, ctx=serial).logits
            got = m.forward(ids[t : t + 1], cache, ctx=ctx).logits
            assert np.array_equal(got, want), t
        assert comp.split_experts > 0

        layer = next(i for i, lw in enumerate(m.weights.layers) if lw.moe is not None)
        lw = m.weights.layers[layer]
        x = np.random.default_rng(1).standard_normal((1, m.config.hidden_size)).astype(np.float32)
        routed = set(moe_ops.route(lw.moe, x)[0].ravel().tolist())
        assert (len(routed) + 1) % 2 == 1  # K experts plus the shared one: an odd step
        macs = 3 * m.config.hidden_size * m.config.moe_intermediate_size

        class Broken(SplitExpert):
            def h_part(self, i: int) -> None:
                if i == 1:
                    raise RuntimeError("part 1 failed")
                super().h_part(i)

        def broken(x: Any, ids: Any, gates: Any, e: int, w: Any) -> SplitExpert:
            from runtime.layers.swiglu import fused

            f = fused(w)
            assert f is not None
            return Broken(x, ids, gates, e, *f, 2)

        comp.split_expert = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="part 1 failed"):
            moe_step(StepContext(comp), m.experts, layer, lw.moe, x, macs)
    finally:
        comp.close()


async def _stream(opts: EngineOptions, compute: Any = None) -> tuple[list[int], dict[str, Any]]:
    async with colibri.Engine.open(options=opts) as eng:
        sched = eng._scheduler
        if compute is not None:  # the scheduler's contexts are replaced between calls
            sched.ctx = sched.ctx.replace(compute=compute(eng))
            sched.prefill_ctx = sched.ctx
        toks: list[int] = []
        lps: list[float] = []
        async for ev in eng.generate(PROMPT, max_new_tokens=12):
            if isinstance(ev, TokenEvent):
                toks.append(ev.token_id)
                lps.append(ev.logprob)
        st = eng.stats()
        st["compute"] = sched.ctx.compute.as_dict()
        st["logprobs"] = lps
        if compute is not None:
            sched.ctx.compute.close()
        return toks, st


def test_threads_give_identical_output_streaming() -> None:
    base = dict(model=DEMO, ram_budget="4600KiB", learn=False, pin=False, reader="threads")
    ref, st_ref = anyio.run(_stream, EngineOptions(**base, threads=1))
    got, st = anyio.run(
        _stream,
        EngineOptions(**base),
        lambda eng: ExpertCompute(2, parallel_min_macs=0),
    )
    assert st["compute"]["parallel_steps"] > 0
    assert st["experts"]["misses"] > 0  # experts really streamed through map_arrivals
    assert st["compute"]["split_experts"] > 0  # ... the last arrival in parts on both threads
    assert got == ref
    assert st["logprobs"] == st_ref["logprobs"]


def test_fast_prefill_keeps_the_greedy_tokens() -> None:
    base = dict(model=DEMO, learn=False, pin=False, prefill_chunk=64)
    ref, st_ref = anyio.run(_stream, EngineOptions(**base))
    got, st = anyio.run(
        _stream, EngineOptions(**base, fast_prefill=True, fast_prefill_rows=2, threads=2)
    )
    assert got == ref
    np.testing.assert_allclose(st["logprobs"], st_ref["logprobs"], atol=1e-3)


def test_fast_prefill_uses_blas_only_while_prefilling() -> None:
    async def main() -> tuple[int, int]:
        opts = EngineOptions(
            model=DEMO, learn=False, pin=False, fast_prefill=True, fast_prefill_rows=2
        )
        async with colibri.Engine.open(options=opts) as eng:
            async for _ in eng.generate(PROMPT, max_new_tokens=1):
                pass
            sched = eng._scheduler
            after_prefill = sched.prefill_ctx.compute.fast_calls
            async for _ in eng.generate([5], max_new_tokens=6):  # decode: one row per step
                pass
            return after_prefill, sched.ctx.compute.fast_calls

    prefill_calls, decode_calls = anyio.run(main)
    assert prefill_calls > 0
    assert decode_calls == 0


def test_a_failing_expert_computation_returns_every_buffer() -> None:
    async def main() -> None:
        opts = EngineOptions(
            model=DEMO, ram_budget="4600KiB", learn=False, pin=False, reader="threads"
        )
        async with colibri.Engine.open(options=opts) as eng:
            store = eng._store
            source = eng._model.experts
            layer = min(store._lru)
            comp = ExpertCompute(2, parallel_min_macs=0)

            def fn(e: int, w: Any) -> int:
                if e == 3:
                    raise RuntimeError("injected")
                return e

            def call() -> Any:
                return comp.run(source, layer, list(range(12)), fn, macs=1)

            try:
                with pytest.raises(RuntimeError, match="injected"):
                    await eng._scheduler.run(call)
                ok = await eng._scheduler.run(
                    lambda: comp.run(source, layer, [0, 1, 2], lambda e, w: e, macs=1)
                )
            finally:
                comp.close()
            assert ok == {0: 0, 1: 1, 2: 2}
            with anyio.fail_after(30):  # reads the aborted step had queued still land
                while store._inflight:
                    await anyio.sleep(0.01)
            assert not store._held
            assert not store._prefetched  # an aborted step's demand reads are not parked
            assert len(store._transient_free) == store.layout.transient_slots

    anyio.run(main)


def test_planned_prefill_chunk() -> None:
    assert choose_prefill_chunk(6144, 8, streaming=False, ram_budget=None) == 512
    assert PREFILL_CHUNK_RESIDENT == 512
    # GLM-5 geometry: 576 KiB of activations per token; 1/8 of 24 GiB (3 GiB) holds 4096 tokens.
    assert choose_prefill_chunk(6144, 8, streaming=True, ram_budget=24 << 30) == PREFILL_CHUNK_MAX
    assert choose_prefill_chunk(6144, 8, streaming=True, ram_budget=16 << 30) == 2048
    assert choose_prefill_chunk(6144, 8, streaming=True, ram_budget=4 << 30) == 512
    assert choose_prefill_chunk(6144, 8, streaming=True, ram_budget=1 << 30) == 512
    assert choose_prefill_chunk(256, 4, streaming=True, ram_budget=1 << 20) == PREFILL_CHUNK_MAX


def test_engine_stats_count_layer_calls(tmp_path: Path) -> None:
    """Decode of the resident demo model (steps below ``parallel_min_macs``) runs each layer's
    routed experts as one kernel call, and ``stats()["compute"]["layer_calls"]`` says so."""
    c = Container.open(DEMO)
    main = int(c.config["num_hidden_layers"])
    moe_layers = sum(1 for layer in c.expert_layers() if layer < main)  # not the MTP layer's
    with colibri.open_model(DEMO, state_dir=tmp_path, draft="off") as m:
        assert m.stats()["compute"]["layer_calls"] == 0
        m.generate(PROMPT[:8], max_new_tokens=3)  # the prompt's forward and two decode steps
        assert m.stats()["compute"]["layer_calls"] == 3 * moe_layers


def test_threads_option_and_flag(tmp_path: Path) -> None:
    assert EngineOptions(threads="auto").threads is None
    assert EngineOptions(threads="3").resolved_threads() == 3
    assert EngineOptions().resolved_threads() >= 1
    with pytest.raises(ValueError, match=">= 1"):
        EngineOptions(threads=0)
    with pytest.raises(ValueError, match=">= 1"):
        EngineOptions(prefill_chunk=0)


def test_cli_flags_reach_the_engine() -> None:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}

    def run(*flags: str) -> tuple[str, dict[str, Any]]:
        p = subprocess.run(
            [sys.executable, "-m", "colibri.cli", "run", "--raw", "-n", "6", "--stats",
             "--model", str(DEMO), *flags, "one two three four five six seven"],
            capture_output=True, text=True, env=env, timeout=300, check=True,
        )  # fmt: skip
        lines = p.stdout.strip().splitlines()
        return "\n".join(lines[:-1]), json.loads(lines[-1])

    text1, st1 = run("--threads", "1", "--prefill-chunk", "512")
    text3, st3 = run("--threads", "3", "--prefill-chunk", "2")
    assert text1 == text3
    assert st1["compute"]["threads"] == 1 and st3["compute"]["threads"] == 3
    assert st1["compute"]["prefill_chunk"] == 512 and st3["compute"]["prefill_chunk"] == 2
    assert st3["prefill_chunks"] > st1["prefill_chunks"]
    _, fast = run("--fast-prefill")
    assert fast["compute"]["fast_prefill"] is True


@contextlib.asynccontextmanager
async def _store_holding_a_read(
    c: Container, layer: int, expert: int, gate: anyio.Event, prefetch: str, threads: int
) -> AsyncIterator[tuple[ExpertStore, ExpertCompute]]:
    """A streaming store on ``c`` (no cache slots) whose read of ``layer``'s ``expert`` waits
    for ``gate``, and a compute on ``threads``; on exit the gate opens, the compute's pool
    stops and so does the store."""
    from fake_reader import FakeReader, Rule

    from runtime.experts import StoreLayout, slot_sizes

    reader = FakeReader(rules=[Rule(offset=c.expert(layer, expert).start, release=gate)])
    blob, scales = slot_sizes(c)
    layout = StoreLayout((), 0, len(c.expert_layers()), 16, blob + max(scales, 4096))
    async with anyio.create_task_group() as tg:
        store = ExpertStore(c, reader, layout, prefetch=prefetch, clock=reader.clock)
        await store.start(tg)
        comp = ExpertCompute(threads, parallel_min_macs=0)
        try:
            yield store, comp
        finally:
            gate.set()
            comp.close()
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_side_work_runs_before_the_last_read_lands(threads: int) -> None:
    """``run_step``'s side work (the shared expert) is computed while the step's misses are
    still being read, not after the last one lands."""
    c = Container.open(DEMO)
    layer = c.expert_layers()[0]
    gate = anyio.Event()
    order: list[str] = []

    async def main() -> None:
        async with _store_holding_a_read(c, layer, 5, gate, "off", threads) as (store, comp):
            token = anyio.lowlevel.current_token()

            def side() -> str:  # (on a pool worker with 2 threads: the loop is named by token)
                order.append("side")
                anyio.from_thread.run_sync(gate.set, token=token)  # now expert 5 may land
                return "done"

            def fn(e: int, w: Any) -> int:
                order.append(f"expert {e}")
                return e

            with anyio.fail_after(30):  # a side run after the last arrival never comes
                out, extra = await anyio.to_thread.run_sync(
                    lambda: comp.run_step(
                        StreamingExperts(store), layer, [2, 5], fn, 1, None, side
                    ),
                    abandon_on_cancel=True,
                )
        assert out == {2: 2, 5: 5} and extra == "done"

    anyio.run(main)
    assert order.index("side") < order.index("expert 5")


def test_the_side_work_waits_for_the_steps_first_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the pool, the side work (the shared expert) goes to a worker only once the step's
    first read went to the device: a worker busy from the step's start can keep the event
    loop from sending that read (measured: 2.4 ms late in a quarter of the steps)."""
    import runtime.experts as experts_mod

    monkeypatch.setattr(experts_mod, "ISSUE_WAIT_S", 30.0)  # (no bound: the order alone)
    c = Container.open(DEMO)
    layer = c.expert_layers()[0]
    gate = anyio.Event()
    granted: list[int] = []

    async def main() -> None:
        async with _store_holding_a_read(c, layer, 5, gate, "off", 2) as (store, comp):
            token = anyio.lowlevel.current_token()

            def side() -> str:
                granted.append(store.policy._demand_inflight)  # reads on the device now
                anyio.from_thread.run_sync(gate.set, token=token)
                return "done"

            with anyio.fail_after(30):
                out, extra = await anyio.to_thread.run_sync(
                    lambda: comp.run_step(
                        StreamingExperts(store), layer, [2, 5], lambda e, w: e, 1, None, side
                    ),
                    abandon_on_cancel=True,
                )
        assert out == {2: 2, 5: 5} and extra == "done"

    anyio.run(main)
    assert granted and granted[0] >= 1


@pytest.mark.parametrize("threads", [1, 2])
def test_a_guess_is_made_while_the_step_reads_and_its_reads_are_issued(threads: int) -> None:
    """``run_step``'s ``guess`` (the next layer's prediction): on the pool it is made on a
    worker while the step's misses are still being read (its router is not on the path to
    the step's first read), serially before the step; either way its lookahead reads are
    issued, and the step's outputs are the same as without it."""
    from runtime.weights import Lookahead

    c = Container.open(DEMO)
    layer, after = c.expert_layers()[:2]
    gate = anyio.Event()
    order: list[str] = []

    async def main() -> None:
        async with _store_holding_a_read(c, layer, 5, gate, "on", threads) as (store, comp):
            compute_thread: list[str] = []

            prefetch = store._loop_prefetch

            def prefetch_then_land(layer: int, experts: Sequence[int], cpu_s: float = 0.0) -> None:
                # Expert 5 lands only once the guess reached the loop: a guess handed over after
                # the step's last arrival is dropped by design (too late to read ahead), so
                # opening the gate from inside the guess would race the hand-over.
                prefetch(layer, experts, cpu_s)
                gate.set()

            store._loop_prefetch = prefetch_then_land  # type: ignore[method-assign]

            def guess() -> Lookahead:
                order.append("guess")
                here = threading.current_thread().name
                assert (here != compute_thread[0]) == (threads > 1)
                return Lookahead(after, [7, 3])

            def fn(e: int, w: Any) -> int:
                order.append(f"expert {e}")
                return e

            def step() -> tuple[dict[int, int], None]:
                compute_thread.append(threading.current_thread().name)
                if threads == 1:  # (serially the guess comes first; nothing to wait for)
                    anyio.from_thread.run_sync(gate.set)  # (an Event is set on its loop)
                return comp.run_step(StreamingExperts(store), layer, [2, 5], fn, 1, guess, None)

            with anyio.fail_after(30):  # a guess made only after the last arrival: hangs
                out, _ = await anyio.to_thread.run_sync(step, abandon_on_cancel=True)
            # both predicted experts of `after` go to the device: the step's own reads go
            # first, so the second lookahead read may still be queued when the step returns
            with anyio.fail_after(10):
                while store.policy.stats.prefetch_issued < 2:
                    await anyio.sleep(0.001)
        assert out == {2: 2, 5: 5}
        assert store.policy.stats.prefetch_issued == 2  # and no more than those two

    anyio.run(main)
    if threads > 1:
        assert order.index("guess") < order.index("expert 5")
    else:
        assert order[0] == "guess"


@pytest.mark.parametrize(("n_rows", "keys", "per_row", "per_key", "parts"), [
    (512, 512, 5_000_000, 9_216, 2), (64, 64, 0, 1, 2), (300, 1000, 10, 1, 3),
    (7, 7, 0, 1, 4), (4, 4, 1, 0, 2), (1000, 1000, 0, 1, 8),
])  # fmt: skip
def test_causal_row_blocks_hold_about_equal_work(
    n_rows: int, keys: int, per_row: int, per_key: int, parts: int
) -> None:
    """A prompt's rows split by work, not by count: each range within one row's work of an
    equal share (row i sees keys - n_rows + i + 1 keys), so the later, longer rows get fewer
    rows per range; the edges run from 0 to n_rows without going back."""
    edges = causal_edges(n_rows, keys, per_row, per_key, parts)
    assert edges[0] == 0 and edges[-1] == n_rows and len(edges) == parts + 1
    assert np.all(np.diff(edges) >= 0)
    work = per_row + per_key * (keys - n_rows + 1 + np.arange(n_rows))
    share, most = work.sum() / parts, work.max()
    for a, b in itertools.pairwise(edges):
        assert abs(work[a:b].sum() - share) <= most, (a, b)
    if per_key and parts == 2 and n_rows >= 64:
        assert edges[1] > n_rows // 2  # the first half of the rows has less than half the work

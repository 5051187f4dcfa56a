"""The job crew: kernel calls handed to worker threads without the GIL give the bits of one
thread, whoever runs them; a parked worker is woken, a busy crew runs a table alone, and the
workers really take jobs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _demo import demo_model

from runtime.compute import ExpertCompute
from runtime.context import StepContext
from runtime.crew import Crew, i4_prepared, i4_rows_template
from runtime.kernels import crew as crew_kernels
from runtime.kernels.crew import CELL, PARKED, combine_sorted
from runtime.kernels.quant_matmul import edges16
from runtime.layers import moe as moe_ops
from runtime.layers.moe_router import RouterConfig
from runtime.linear import Linear
from runtime.models import load_model
from storage.container import Container
from storage.quant import quantize

DEMO = demo_model()
ROOT = Path(__file__).resolve().parents[2]


def _weight(rng: np.random.Generator, o: int, i: int, fmt: str = "int4-g64") -> Linear:
    """A random [o, i] weight in ``fmt``."""
    return Linear(quantize(rng.standard_normal((o, i)).astype(np.float32), fmt))


def test_crew_kernels_release_the_gil() -> None:
    assert all(k.targetoptions.get("nogil") is True for k in crew_kernels.KERNELS)


def test_importing_the_compute_compiles_no_job() -> None:
    """The jobs' cfuncs compile when a crew starts, not at import (a first run says that it
    is compiling kernels before it does)."""
    code = (
        "import runtime.compute, runtime.kernels.crew as c; "
        "print(c.job_kinds.cache_info().currsize)"
    )
    got = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert got.stdout.strip() == "0"


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g32", "int4-row", "int8", "bf16", "f32"])
@pytest.mark.parametrize("lanes", [8, 16])
def test_a_crew_matmul_is_the_one_call_bit_for_bit(fmt: str, lanes: int) -> None:
    rng = np.random.default_rng(lanes)
    lin = Linear(quantize(rng.standard_normal((203, 192)).astype(np.float32), fmt), lanes=lanes)
    comp = ExpertCompute(2)
    comp.crew_min_macs = 0
    try:
        assert comp._crew is not None
        for n in (1, 3, 17):
            x = rng.standard_normal((n, 192)).astype(np.float32)
            assert np.array_equal(comp.linear(lin, x), lin(x)), n
        takes = fmt.startswith("int4") or (fmt == "int8" and lanes == 16) or fmt == "f32"
        assert (comp._crew.runs > 0) == takes
    finally:
        comp.close()


def test_a_big_router_is_routed_on_the_crew_with_the_calls_bits() -> None:
    """A GLM-5-sized float32 router (here [256, 4096]: 1M multiply-adds a row) takes its
    logits from the crew in a decode step and in a prompt's chunk: the same experts and gate
    weights, from the same bits, as the router's own call."""
    rng = np.random.default_rng(7)
    router = _weight(rng, 256, 4096, "f32")
    w = moe_ops.MoEWeights(
        router,
        (0.01 * rng.standard_normal(256)).astype(np.float32),
        None,
        RouterConfig(256, 8, routed_scaling_factor=2.5),
    )
    comp = ExpertCompute(2)
    try:
        assert comp._crew is not None
        for n in (1, 5):
            x = rng.standard_normal((n, 4096)).astype(np.float32)
            runs = comp._crew.runs
            assert np.array_equal(comp.router_logits(router, x), router(x))
            assert comp._crew.runs == runs + 1  # (one run of feature ranges)
            got, want = moe_ops.route(w, x, comp.router_logits), moe_ops.route(w, x)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        # below the crew's threshold the router is called as it is
        small = _weight(rng, 64, 256, "f32")
        runs = comp._crew.runs
        x = rng.standard_normal((1, 256)).astype(np.float32)
        assert np.array_equal(comp.router_logits(small, x), small(x))
        assert comp._crew.runs == runs
    finally:
        comp.close()


def test_fast_int8_matmuls_on_the_crew_are_its_one_call_bits() -> None:
    """Under fast-int8, a matmul's feature ranges (and two weights of one input) on the crew
    from one rounding of the rows: the bits of the weight's own fast-int8 call."""
    rng = np.random.default_rng(8)

    a, b = _weight(rng, 200, 256), _weight(rng, 96, 256)
    comp = ExpertCompute(2, kernels="fast-int8")
    comp.crew_min_macs = 0
    try:
        assert comp._crew is not None
        for n in (1, 3, 17):
            x = rng.standard_normal((n, 256)).astype(np.float32)
            runs = comp._crew.runs
            assert np.array_equal(comp.linear(a, x), a(x, fast_int8=True)), n
            got = comp.linears([a, b], x)
            assert comp._crew.runs == runs + 2, n
            assert np.array_equal(got[0], a(x, fast_int8=True)), n
            assert np.array_equal(got[1], b(x, fast_int8=True)), n
            assert not np.array_equal(got[0], a(x)), n  # (the lossy kernel did run)
        # a weight without the int8-activation kernel takes its exact one, on the crew too
        g32 = _weight(rng, 96, 256, "int4-g32")
        x = rng.standard_normal((2, 256)).astype(np.float32)
        runs = comp._crew.runs
        assert np.array_equal(comp.linear(g32, x), g32(x, fast_int8=True))
        assert comp._crew.runs == runs + 1
    finally:
        comp.close()


@pytest.mark.parametrize("kernels", ["exact", "fast-int8"])
def test_the_lora_query_path_on_the_crew_is_the_calls_one_by_one(kernels: str) -> None:
    """An MLA projection's ``q_a_proj`` + ``kv_a_proj_with_mqa``, ``q_a_layernorm`` and
    ``q_b_proj`` in one numba call of two crew runs: the bits of the calls one by one."""
    from runtime.layers.rms_norm import rms_norm

    rng = np.random.default_rng(12)

    q_a, kv_a, q_b = _weight(rng, 128, 256), _weight(rng, 80, 256), _weight(rng, 192, 128)
    norm_w = (1 + 0.1 * rng.standard_normal(128)).astype(np.float32)
    fast = kernels == "fast-int8"
    comp = ExpertCompute(2, kernels=kernels)
    comp.crew_min_macs = 0
    try:
        assert comp._crew is not None
        for n in (1, 3):
            x = rng.standard_normal((n, 256)).astype(np.float32)
            runs = comp._crew.runs
            got = comp.lora(q_a, kv_a, norm_w, 1e-6, q_b, x)
            assert got is not None and comp._crew.runs == runs + 2, n
            q_resid = rms_norm(q_a(x, fast_int8=fast), norm_w, 1e-6)
            assert np.array_equal(got[0], q_resid), n
            assert np.array_equal(got[1], kv_a(x, fast_int8=fast)), n
            assert np.array_equal(got[2], q_b(q_resid, fast_int8=fast)), n
    finally:
        comp.close()


def test_linears_of_one_input_share_a_crew_run_bit_for_bit() -> None:
    """Several int4 weights of the same input width (``q_a_proj`` and ``kv_a_proj_with_mqa``)
    in one crew run, one preparation of the rows: each the bits of its own call; weights of
    different widths or formats fall back to one call each."""
    rng = np.random.default_rng(5)

    pair = [_weight(rng, 96, 192), _weight(rng, 80, 192, "int4-g32")]
    comp = ExpertCompute(2)
    comp.crew_min_macs = 0
    try:
        assert comp._crew is not None
        for n in (1, 3, 17):
            x = rng.standard_normal((n, 192)).astype(np.float32)
            runs = comp._crew.runs
            got = comp.linears(pair, x)
            assert comp._crew.runs == runs + 1, n
            assert all(np.array_equal(g, w(x)) for g, w in zip(got, pair, strict=True)), n
        mixed = [_weight(rng, 96, 192), _weight(rng, 64, 192, "int8")]
        x = rng.standard_normal((2, 192)).astype(np.float32)
        got = comp.linears(mixed, x)
        assert all(np.array_equal(g, w(x)) for g, w in zip(got, mixed, strict=True))
    finally:
        comp.close()


def test_crew_mlps_and_moe_steps_are_the_serial_bits() -> None:
    """A prompt chunk, then decode token by token, of the demo model (resident int4 experts)
    with every MLP and matmul, and the decode MoE steps, on the crew: the logits of one
    thread, bit for bit."""
    c = Container.open(DEMO)
    m = load_model(c)
    ids = np.random.default_rng(2).integers(3, 999, size=20).astype(np.int64)
    serial = StepContext()
    comp = ExpertCompute(2, parallel_min_macs=0)
    comp.crew_min_macs = 0
    assert comp._crew is not None
    comp._crew._iters_per_us = float("inf")  # never judged busy: every step must take the crew
    try:
        ctx = StepContext(comp)
        ref_cache, cache = m.new_cache(), m.new_cache()
        want = m.forward(ids[:12], ref_cache, ctx=serial).logits
        got = m.forward(ids[:12], cache, ctx=ctx).logits
        assert np.array_equal(got, want)
        # a prompt chunk's many experts run on the pool (whole experts); decode on the crew
        pool_experts = comp.split_experts
        steps = comp.parallel_steps
        assert comp._crew is not None
        runs = comp._crew.runs
        for t in range(12, ids.size):
            want = m.forward(ids[t : t + 1], ref_cache, ctx=serial).logits
            got = m.forward(ids[t : t + 1], cache, ctx=ctx).logits
            assert np.array_equal(got, want), t
        assert comp._crew.runs > runs
        assert comp.parallel_steps > steps  # MoE steps ran on the crew
        assert comp.split_experts == pool_experts  # ... not on the pool
    finally:
        comp.close()


@pytest.mark.parametrize("n_tok", [1, 2, 5])
@pytest.mark.parametrize("with_shared", [True, False])
@pytest.mark.parametrize("q8", [False, True])
def test_the_crew_moe_step_is_the_expert_by_expert_sum(
    n_tok: int, with_shared: bool, q8: bool
) -> None:
    """``crew_moe`` (routing to per-row sums in one numba call, two crew runs) against the
    Python MoE step of the serial kernels: each routed expert on its rows, summed in
    ascending expert id, and the shared expert, bit for bit; experts with one row and with
    several, a shared expert of another intermediate size; exact and fast-int8 (the rows
    rounded once, each MLP's intermediate rows rounded range by range in the first run: the
    bits of its one-call kernel)."""
    from runtime.crew import mlp_templates, q8_mlp_templates
    from runtime.kernels.crew import WIDTH, crew_moe
    from runtime.layers import moe as moe_ops
    from runtime.layers.swiglu import MLPWeights, fused, fused_q8, swiglu, swiglu_q8

    rng = np.random.default_rng(n_tok)
    d, f, n_e, k = 128, (192 if q8 else 96), 7, 3

    def mlp(n_f: int) -> MLPWeights:
        return MLPWeights(_weight(rng, n_f, d), _weight(rng, n_f, d), _weight(rng, d, n_f))

    def templates(w: MLPWeights) -> tuple[np.ndarray, np.ndarray]:
        if q8:
            return q8_mlp_templates(fused_q8(w), 2)  # type: ignore[arg-type]
        return mlp_templates(fused(w), 2)  # type: ignore[arg-type]

    def one(xe: np.ndarray, w: MLPWeights) -> np.ndarray:
        return swiglu_q8(xe, fused_q8(w)) if q8 else swiglu(xe, w)  # type: ignore[arg-type]

    experts = [mlp(f) for _ in range(n_e)]
    shared = mlp(2 * f)
    x = rng.standard_normal((n_tok, d)).astype(np.float32)
    ids = np.sort(np.stack([rng.choice(4, k, replace=False) for _ in range(n_tok)]), axis=1)
    gates = rng.random((n_tok, k)).astype(np.float32)
    parts = [templates(w) for w in experts]
    first = np.stack([p[0] for p in parts])
    second = np.stack([p[1] for p in parts])
    if with_shared:
        s_first, s_second = templates(shared)
    else:
        s_first = s_second = np.zeros((0, WIDTH), np.int64)
    crew = Crew(1, 10**6)
    try:
        routed, side = crew.call(
            crew_moe, 2, x, ids.astype(np.int64), gates, first, second, s_first, s_second,
            np.full(n_e, f, np.int64), 2 * f, q8,
        )  # fmt: skip
        assert crew.runs == 2
    finally:
        crew.close()
    outputs = {}
    for e in moe_ops.union(ids):
        rows, slot = np.nonzero(ids == e)
        outputs[e] = (
            rows,
            one(np.ascontiguousarray(x[rows]), experts[e]) * gates[rows, slot][:, None],
        )
    assert np.array_equal(routed, moe_ops.combine(x, ids, outputs))
    if with_shared:
        assert np.array_equal(side, one(x, shared))
    else:
        assert side.shape == (0, d)


@pytest.mark.parametrize(
    ("n_heads", "keys", "masked", "uk_int4"),
    [(16, 1, False, False), (12, 37, True, False), (8, 300, False, False), (16, 1, False, True),
     (12, 37, True, True)],
)  # fmt: skip
def test_mla_heads_on_the_crew_are_the_serial_bits(
    n_heads: int, keys: int, masked: bool, uk_int4: bool
) -> None:
    """One query row's absorbed attention with its head ranges on the crew (W_UK, the latent
    attention, W_UV in one job per range), then o_proj's feature ranges, against the serial
    calls with W_UK from a float32 copy: bit for bit, with and without a sparse selection's
    mask, head counts that split evenly and not, and W_UK read from the int4 rows as
    stored (``axpy_int4``)."""
    from runtime.kernels.dequant import dequantize
    from runtime.kernels.heads import HeadsMatmul
    from runtime.layers import mla
    from runtime.weights import qtensor_rows

    rng = np.random.default_rng(n_heads + keys)
    n, v, c, r = 16, 24, 64, 8
    kv_b = quantize(rng.standard_normal((n_heads * (n + v), c)).astype(np.float32), "int4-g32")
    kv_b_f32 = dequantize(kv_b).reshape(n_heads, n + v, c)
    uk = HeadsMatmul.axpy(kv_b_f32[:, :n])
    w_uv = [Linear(qtensor_rows(kv_b, h * (n + v) + n, (h + 1) * (n + v))) for h in range(n_heads)]
    uv = HeadsMatmul.int4_rows(
        np.asarray(kv_b.data), kv_b.scales, 32, c, n, n + v, v, w_uv, w_uv[0].lanes
    )
    q = rng.standard_normal((1, n_heads, n + r)).astype(np.float32)
    q_nope, q_rope = q[:, :, :n], np.ascontiguousarray(q[:, :, n:])
    latent = rng.standard_normal((keys, c)).astype(np.float32)
    k_rope = rng.standard_normal((keys, r)).astype(np.float32)
    allowed = rng.random((1, keys)) < 0.5 if masked else None
    if allowed is not None:
        allowed[0, -1] = True
    scale = 0.125
    o_proj = _weight(rng, 96, n_heads * v)
    heads = uv(mla.latent_attention(uk(q_nope), q_rope, latent, k_rope, allowed, scale))
    want = o_proj(heads.reshape(1, n_heads * v))
    if uk_int4:
        uk4 = HeadsMatmul.axpy_int4(np.asarray(kv_b.data), kv_b.scales, 32, c, 0, n + v, n, n_heads)
        assert uk4 is not None and uk4.kind == "axpy_int4"
        assert np.array_equal(uk4(q_nope), uk(q_nope))
        uk = uk4
    comp = ExpertCompute(2)
    comp.crew_min_macs = 0
    try:
        assert comp._crew is not None
        runs = comp._crew.runs
        got = comp.mla_heads(uk, uv, o_proj, q_nope, q_rope, latent, k_rope, allowed, scale)
        assert comp._crew.runs == runs + 2  # the heads, then o_proj's features
    finally:
        comp.close()
    assert got is not None
    assert np.array_equal(got, want)


def test_the_moe_steps_mlp_order_is_numpys_stable_argsort() -> None:
    """The crew's MoE step orders its MLPs by rows, most first, ties by index: what
    ``np.argsort(-n, kind="stable")`` gives, on counts with many ties and on none."""
    rng = np.random.default_rng(8)
    for size in (0, 1, 2, 7, 9, 64, 257):
        for hi in (1, 3, 50):
            n = rng.integers(0, hi, size + 3).astype(np.int64)  # (entries past n_all ignored)
            got = crew_kernels._most_rows_first(n, size)
            assert np.array_equal(got, np.argsort(-n[:size], kind="stable")), (size, hi)


def test_combine_sorted_is_the_per_expert_sum() -> None:
    from runtime.layers import moe as moe_ops

    rng = np.random.default_rng(4)
    n_tok, k, d = 5, 3, 24
    ids = np.stack([rng.choice(9, k, replace=False) for _ in range(n_tok)]).astype(np.int64)
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    out = rng.standard_normal((flat.size, d)).astype(np.float32)
    tok = (order // k).astype(np.int64)
    outputs = {}
    for e in np.unique(flat):
        sel = np.flatnonzero(flat[order] == e)
        outputs[int(e)] = (tok[sel], out[sel])
    x = np.zeros((n_tok, d), np.float32)
    assert np.array_equal(combine_sorted(out, tok, n_tok), moe_ops.combine(x, ids, outputs))


def _table(seed: int, rows: int = 512) -> tuple[np.ndarray, np.ndarray, object, np.ndarray]:
    """A crew table computing a [rows, 256] int4 matmul in 8 ranges, its output, what the
    table points into (to keep alive) and the expected result."""
    rng = np.random.default_rng(seed)
    lin = _weight(rng, rows, 256)
    w4 = lin.int4
    assert w4 is not None
    x = rng.standard_normal((1, 256)).astype(np.float32)
    edges = edges16(rows, 8)
    table = i4_rows_template(w4, edges)
    y, ys = i4_prepared(x, w4)
    out = np.full(rows, np.nan, np.float32)
    table[:, 1], table[:, 2], table[:, 3], table[:, 4] = y.ctypes.data, y.size, ys, 1
    table[:, 16] = out.ctypes.data + 4 * np.asarray(edges[:-1], np.int64)
    return table, out, (lin, w4, y), lin(x)[0]


def test_a_parked_worker_is_woken_and_a_busy_crew_runs_alone() -> None:
    crew = Crew(1, poll_iters=1000)  # parks almost at once
    try:
        table, out, _keep, want = _table(1)
        deadline = time.monotonic() + 10
        while not crew._ctrl[PARKED * CELL] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert crew._ctrl[PARKED * CELL] == 1
        crew.run(table)
        assert np.array_equal(out, want)
        assert crew.runs == 1 and crew.jobs == 8
        out[:] = np.nan
        with crew._busy:  # another run in progress: this one runs on the caller alone
            crew.run(table)
        assert crew.alone == 1 and crew.runs == 1
        assert np.array_equal(out, want)
    finally:
        crew.close()
    assert not any(t.is_alive() for t in crew._threads)


def test_the_workers_take_jobs() -> None:
    crew = Crew(1, poll_iters=1 << 30)  # never parks
    try:
        table, out, _keep, want = _table(2, rows=4096)
        deadline = time.monotonic() + 20
        while crew.posted == crew.jobs and time.monotonic() < deadline:
            crew.run(table)
        assert crew.posted < crew.jobs  # the worker ran some of them
        assert np.array_equal(out, want)
    finally:
        crew.close()


def test_a_crew_needs_one_worker_or_more() -> None:
    with pytest.raises(ValueError, match="workers"):
        Crew(0, 10)


def test_rest_sends_a_polling_worker_to_sleep_and_a_run_wakes_it() -> None:
    """A pool submission rests the crew (its polling worker would hold the CPU the pool's
    Python job needs); the next run wakes it and computes the same."""
    comp = ExpertCompute(2)
    crew = comp._crew
    assert crew is not None
    crew._poll_iters = 1 << 40  # would poll for hours
    try:
        table, out, _keep, want = _table(3)
        crew.run(table)
        assert comp._pool is not None
        comp._pool.submit(lambda: None).result()  # rests the crew
        deadline = time.monotonic() + 10
        while not crew._ctrl[PARKED * CELL] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert crew._ctrl[PARKED * CELL] == 1
        out[:] = np.nan
        crew.run(table)
        assert np.array_equal(out, want)
        while crew.posted == crew.jobs and time.monotonic() < deadline:
            crew.run(table)  # woken: it takes jobs again
        assert crew.posted < crew.jobs
    finally:
        comp.close()


def test_runs_of_a_prompt_chunk_are_not_judged() -> None:
    """A run posted as not judged (a prompt chunk's long, uneven jobs: its end waits for the
    last one whoever has the CPUs) counts in the crew's totals but not in its judgement."""
    table, out, held, want = _table(3)
    # never parks: a run that wakes a parked worker is not judged either, and a worker that
    # polled 10**6 times parked between the two runs now and then on a busy machine
    crew = Crew(1, poll_iters=1 << 40)
    try:
        crew.run(table, judged=False)
        assert crew.runs == 1 and crew._window == [0, 0]
        assert np.array_equal(out, want)
        crew.run(table)
        assert crew.runs == 2 and crew._window[0] == 1
    finally:
        crew.close()
    del held


def test_a_crew_kept_off_its_cpus_stands_aside_then_tries_again() -> None:
    """Long waits at the ends of runs (another process keeps the workers off their CPUs) in
    two windows in a row make the crew stand aside, with its workers asleep; one slow window
    (first touches of pages) does not, nor a few very long waits in each (a hypervisor's
    preemption); after the pause it is used again."""
    from runtime.crew import WINDOW

    crew = Crew(1, poll_iters=1 << 40, iters_per_us=1.0)  # one poll a microsecond
    try:
        for _ in range(WINDOW):
            crew._note(1000)  # one slow window: 1 ms a run
        for _ in range(WINDOW):
            crew._note(3)
        assert crew.usable() and crew.contended == 0
        for _ in range(2):  # a vCPU taken away now and then: a few runs of a window wait long
            for i in range(WINDOW):
                crew._note(1700 if i in (5, 99) else 3)
        assert crew.usable() and crew.contended == 0
        crew._backoff_s = 0.2
        for _ in range(2 * WINDOW):
            crew._note(500)
        assert not crew.usable() and crew.contended == 1
        assert crew._backoff_s == pytest.approx(0.4)  # doubled for the next time
        deadline = time.monotonic() + 10
        while not crew._ctrl[PARKED * CELL] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert crew._ctrl[PARKED * CELL] == 1  # its worker sleeps meanwhile
        time.sleep(0.25)
        assert crew.usable()
        for _ in range(WINDOW):
            crew._note(2)
        assert crew._backoff_s == pytest.approx(1.0)  # a quiet window: back to the start
    finally:
        crew.close()


def test_a_compute_uses_the_pool_while_its_crew_stands_aside() -> None:
    rng = np.random.default_rng(9)
    lin = _weight(rng, 256, 128)
    x = rng.standard_normal((1, 128)).astype(np.float32)
    comp = ExpertCompute(2, parallel_min_macs=0)
    comp.crew_min_macs = 0
    comp.split_min_macs = 0
    try:
        crew = comp._crew
        assert crew is not None
        crew._idle_until = time.monotonic() + 60
        assert np.array_equal(comp.linear(lin, x), lin(x))
        assert crew.runs == 0 and comp.split_calls == 1  # split on the pool instead
    finally:
        comp.close()


def test_engine_stats_count_crew_runs(tmp_path: Path) -> None:
    import colibri

    with colibri.open_model(DEMO, state_dir=tmp_path, draft="off", threads=2) as m:
        comp = m.engine._scheduler.ctx.compute
        comp.crew_min_macs = 0  # the demo model's matmuls are below the default
        m.generate([5, 6, 7], max_new_tokens=3)
        got = m.stats()["compute"]
        assert got["crew_runs"] > 0
        assert comp._crew is not None
        assert got["crew_stood_aside"] == comp._crew.contended  # 0 unless the machine is busy

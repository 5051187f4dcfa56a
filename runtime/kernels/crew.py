"""The numba half of the job crew: kernel calls handed to other threads without the GIL.

A *job* is one row of an int64 table: the address of a numba ``cfunc`` (``void f(int64)``) and
its arguments (array addresses, lengths, ints), which the ``cfunc`` turns back into arrays with
``numba.carray`` and passes to the same kernels a Python call runs (so the same bits: the
kernels are serial and ``fastmath=False``, and each output feature is computed by the same code
whichever thread computes it). A *run* is a batch of jobs that the posting thread
(:func:`crew_run`) and every worker (:func:`crew_work`) take one at a time, in table order,
until none is left; the posting thread then waits until every job it did not run itself has
finished. Nothing in a run touches Python: a worker that finished a run polls for the next one
in a ``nogil`` loop of atomic loads (no ``pause``: see :mod:`runtime.countdown`), so handing it
the next run costs a store and a cache-line transfer instead of a lock, a GIL hand-over and, on
a virtual machine, the wake of an idle vCPU (47-120 us on a 2-vCPU Firecracker guest, where a
one-token matmul of the attention projections takes 100-300 us).

The control array (``ctrl``, int64, one cache line per cell) holds, per run: the generation
(bumped by the posting thread to start a run), the job table's address, its row width and job
count, the *next* cell (the run's generation in the high 32 bits, the next job index in the
low 32: a worker that wakes late for an old run can only claim an index past its end, never a
job of a newer run), the count of finished jobs, and per worker a *parked* flag (set when it
gave up polling and went back to Python to sleep) and a stop flag, and a *rest* flag that sends
every polling worker to sleep at once (the thread pool is about to run Python jobs, which need
the CPU a polling worker holds).

The table's arrays must stay alive until :func:`crew_run` returns (the Python caller holds
them). Jobs do not raise: their arguments are checked before they are posted.

Shape legend: ctrl int64 [CELLS * 8]; table int64 [N, WIDTH] (one job per row).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import cfunc, njit, types
from numba.np.numpy_support import carray

from runtime.kernels._intrinsics import (
    ALIGN,
    call_at,
    compare_swap,
    f32_at,
    fetch_add,
    i8_at,
    i32_at,
    i64_at,
    load_acquire,
    store_release,
    swap,
    u8_at,
    zeros64,
)
from runtime.kernels._matmul_kernels import (
    _KIND_F32,
    _col_matmul,
    _i4_apply,
    _i4_prep,
    _i4_stride,
    _i8_matmul16,
    _i8_matmul16_tiles,
    i4_down_part,
    i4_swiglu_part,
    silu_mul,
)
from runtime.kernels._q8 import _q8_apply, _q8_round, q8_prep_groups, q8_strides
from runtime.kernels.attention import _latent_attention
from runtime.kernels.heads import _heads_axpy, _heads_axpy_i4, _heads_i4
from runtime.kernels.norm import rms_rows

__all__ = [
    "CELL",
    "GEN",
    "JOBS",
    "KERNELS",
    "PARKED",
    "REST",
    "STOP",
    "WAITED",
    "WIDTH",
    "JobKinds",
    "combine_sorted",
    "crew_heads_out",
    "crew_linears",
    "crew_lora",
    "crew_moe",
    "crew_run",
    "crew_work",
    "heads_table",
    "job_kinds",
    "one_run",
]

#: int64 cells per control slot (one 64-byte cache line each, so that polling one does not
#: contend with writes to another)
CELL = 8
# slots; worker w: PARKED + w, STOP + w
GEN, TABLE, NJOBS, NEXT, DONE, ROWW, REST, WAITED = 0, 1, 2, 3, 4, 5, 6, 7
PARKED = 8
STOP = 40
JOBS = 32  # most workers a control array has room for
WIDTH = 32  # int64 arguments per job row (the cfunc address included)
_LOW = (1 << 32) - 1
_GEN_MASK = (1 << 31) - 1


@njit(nogil=True, cache=True)
def _drain(ctrl, g):  # type: ignore[no-untyped-def]
    """Run jobs of run ``g`` until none is left; how many this thread ran."""
    tag = (g & _GEN_MASK) << 32
    n = load_acquire(ctrl, NJOBS * CELL)
    base = load_acquire(ctrl, TABLE * CELL)
    width = load_acquire(ctrl, ROWW * CELL)
    ran = 0
    while True:
        v = load_acquire(ctrl, NEXT * CELL)
        if v & ~_LOW != tag or v & _LOW >= n:
            return ran
        if compare_swap(ctrl, NEXT * CELL, v, v + 1) != v:
            continue
        row = base + (v & _LOW) * width * 8
        call_at(carray(i64_at(row), 1)[0], row)  # the row's cfunc, given the row
        fetch_add(ctrl, DONE * CELL, 1)
        ran += 1


@njit(nogil=True, cache=True)
def crew_run(ctrl, table, n):  # type: ignore[no-untyped-def]
    """Post the first ``n`` rows of ``table`` as a run, take jobs with the workers until none
    is left, and wait until every job has finished; how many of them this thread ran (and,
    in the ``WAITED`` cell, how many polls it made waiting for the others). Called by one
    thread at a time."""
    g = load_acquire(ctrl, GEN * CELL) + 1
    store_release(ctrl, NEXT * CELL, (g & _GEN_MASK) << 32)
    store_release(ctrl, DONE * CELL, 0)
    store_release(ctrl, NJOBS * CELL, n)
    store_release(ctrl, ROWW * CELL, table.shape[1])
    store_release(ctrl, TABLE * CELL, table.ctypes.data)
    swap(ctrl, GEN * CELL, g)  # a full barrier: the run's cells are visible before it starts
    ran = _drain(ctrl, g)
    waited = 0
    while load_acquire(ctrl, DONE * CELL) < n:
        waited += 1
    ctrl[WAITED * CELL] = waited
    return ran


@njit(nogil=True, cache=True)
def one_run(ctrl, table, n, stats):  # type: ignore[no-untyped-def]
    """:func:`crew_run` reporting as ``runtime.crew.Crew.call`` asks: ``stats`` [3]."""
    stats[0] = crew_run(ctrl, table, n)
    stats[1] = n
    stats[2] = ctrl[WAITED * CELL]


@njit(nogil=True, cache=True)
def crew_work(ctrl, w, seen, poll_iters):  # type: ignore[no-untyped-def]
    """Worker ``w``'s loop: take jobs of every new run; after ``poll_iters`` polls without a
    new run, or once the rest flag is set (other threads need the CPU), set its parked flag
    and return the last run seen (the caller sleeps, then calls again); -1 once its stop flag
    is set."""
    idle = 0
    while True:
        if load_acquire(ctrl, (STOP + w) * CELL):
            return -1
        g = load_acquire(ctrl, GEN * CELL)
        if g != seen:
            seen = g
            _drain(ctrl, g)
            idle = 0
            continue
        idle += 1
        if idle >= poll_iters or load_acquire(ctrl, REST * CELL):
            swap(ctrl, (PARKED + w) * CELL, 1)  # then look once more: a run posted meanwhile
            if load_acquire(ctrl, GEN * CELL) != seen:  # is taken before sleeping
                swap(ctrl, (PARKED + w) * CELL, 0)
                idle = 0
                continue
            return seen


# ----------------------------------------------------------------------------- job kinds
# Each takes the address of its table row: [cfunc address, arguments...]. They are compiled
# (or loaded from numba's cache) at the first :func:`job_kinds` call (exact decode's kinds) or
# at their first use (the others), never at import: a first run says it is compiling kernels
# before it does (``runtime.kernels.cache``).

_SIG = types.void(types.int64)


@njit(nogil=True, cache=True, inline="always")
def _i4_at(a, k):  # type: ignore[no-untyped-def]
    """The int4 weight whose 11 fields start at ``a[k]`` (packed address, size, scales
    address, size, walk (7); ``runtime.crew.i4_fields``): (packed, scales, walk)."""
    packed = carray(u8_at(a[k]), a[k + 1])
    scales = carray(f32_at(a[k + 2]), a[k + 3])
    w = k + 4
    return packed, scales, (a[w], a[w + 1], a[w + 2], a[w + 3], a[w + 4], a[w + 5], a[w + 6])


def _job_i4_apply(row):  # type: ignore[no-untyped-def]
    """Rows of an int4 matmul from activations already prepared (``_i4_apply``): [fn, y, y
    size, ys, T, weight (11 fields), out, pf]; ``out`` [T, O] of the weight's O."""
    a = carray(i64_at(row), WIDTH)
    packed, scales, walk = _i4_at(a, 5)
    y = carray(f32_at(a[1]), a[2])
    out = carray(f32_at(a[16]), (a[4], walk[0]))
    _i4_apply(y, a[3], packed, scales, walk, out, a[17])


def _job_i8_rows(row):  # type: ignore[no-untyped-def]
    """Rows of an int8 matmul (16 lanes) from padded activations: [fn, xp, T, Ip, w, O, I,
    scales, out, pf]; ``xp`` flat [T * Ip], ``out`` [T, O]."""
    a = carray(i64_at(row), WIDTH)
    n_tok, ip, n_out, n_in = a[2], a[3], a[5], a[6]
    xp = carray(f32_at(a[1]), n_tok * ip)
    w = carray(u8_at(a[4]), n_out * n_in)
    scales = carray(f32_at(a[7]), n_out)
    out = carray(f32_at(a[8]), (n_tok, n_out))
    if n_tok == 1:
        _i8_matmul16(w, scales, n_out, n_in, xp, out, a[9])
    else:
        _i8_matmul16_tiles(w, scales, n_out, n_in, xp, ip, out, a[9])


def _job_f32_rows(row):  # type: ignore[no-untyped-def]
    """Rows of a float32 matmul (``_col_matmul``) from activations padded to 8 columns: [fn,
    xp, T, Ip, w, O, I, one, out, pf]; ``xp`` flat [T * Ip], ``w`` flat [O * I], ``one`` the
    float32 1.0 the kernel takes as the scale, ``out`` [T, O], ``pf`` in elements."""
    a = carray(i64_at(row), WIDTH)
    n_tok, ip, n_out, n_in = a[2], a[3], a[5], a[6]
    xp = carray(f32_at(a[1]), n_tok * ip)
    w = carray(f32_at(a[4]), n_out * n_in)
    one = carray(f32_at(a[7]), 1)
    out = carray(f32_at(a[8]), (n_tok, n_out))
    _col_matmul(w, one, n_out, n_in, _KIND_F32, xp, ip, out, a[9])


def _job_i4_swiglu_part(row):  # type: ignore[no-untyped-def]
    """``i4_swiglu_part``: [fn, xe, n, D, gate (11 fields), up (11 fields), a, b, h, F, pf];
    ``h`` [n, F]."""
    a = carray(i64_at(row), WIDTH)
    n, d = a[2], a[3]
    xe = carray(f32_at(a[1]), (n, d))
    gp, gsc, gw = _i4_at(a, 4)
    upk, usc, uw = _i4_at(a, 15)
    h = carray(f32_at(a[28]), (n, a[29]))
    i4_swiglu_part(xe, gp, gsc, gw, upk, usc, uw, a[26], a[27], h, a[30])


def _job_i4_down_part(row):  # type: ignore[no-untyped-def]
    """``i4_down_part``: [fn, h, n, F, down (11 fields), c, d, g, out, D, pf]; ``h`` [n, F],
    ``g`` [n], ``out`` [n, D]."""
    a = carray(i64_at(row), WIDTH)
    n, f = a[2], a[3]
    h = carray(f32_at(a[1]), (n, f))
    dp, dsc, dw = _i4_at(a, 4)
    g = carray(f32_at(a[17]), n)
    out = carray(f32_at(a[18]), (n, a[19]))
    i4_down_part(h, dp, dsc, dw, a[15], a[16], g, out, a[20])


@njit(nogil=True, cache=True, inline="always")
def _q8_at(a, k):  # type: ignore[no-untyped-def]
    """Activations rounded for the fast-int8 kernels whose 8 fields start at ``a[k]`` (digits
    address, size, biases address, size, scales address, size, digit stride, bias stride):
    (xq, bias, sx, xstride, bstride), as ``_q8_round`` returns them."""
    xq = carray(i8_at(a[k]), a[k + 1])
    bias = carray(i32_at(a[k + 2]), a[k + 3])
    sx = carray(f32_at(a[k + 4]), a[k + 5])
    return xq, bias, sx, a[k + 6], a[k + 7]


def _job_q8_rows(row):  # type: ignore[no-untyped-def]
    """Rows of a fast-int8 matmul from rounded activations (``_q8_apply``): [fn, x rounded
    (8 fields), T, packed, size, scales, size, n, out, pf]; the weight fields are the range's
    rows, ``out`` [T, n]."""
    a = carray(i64_at(row), WIDTH)
    xq, bias, sx, xstride, bstride = _q8_at(a, 1)
    packed = carray(u8_at(a[10]), a[11])
    scales = carray(f32_at(a[12]), a[13])
    out = carray(f32_at(a[15]), (a[9], a[14]))
    _q8_apply(xq, bias, sx, xstride, bstride, packed, scales, a[14], out, a[16])


def _job_q8_swiglu_part(row):  # type: ignore[no-untyped-def]
    """Features ``[a, b)`` (multiples of 64) of a fast-int8 MLP's first half: gate and up
    from the rounded rows, ``silu_mul`` into ``h`` [n, F], and those columns of ``h`` rounded
    for the down projection (``q8_prep_groups``): [fn, x rounded (8), n, gate (packed, size,
    scales, size), up (4), a, b, F, D, h, h rounded (8), pf]; the weights whole."""
    a = carray(i64_at(row), WIDTH)
    xq, bias, sx, xstride, bstride = _q8_at(a, 1)
    n, lo, hi, n_f, n_d = a[9], a[18], a[19], a[20], a[21]
    nb, groups = n_d // 2, n_d // 64
    w = hi - lo
    g = np.empty((n, w), np.float32)
    u = np.empty((n, w), np.float32)
    gp = carray(u8_at(a[10] + lo * nb), w * nb)
    gs = carray(f32_at(a[12] + 4 * lo * groups), w * groups)
    _q8_apply(xq, bias, sx, xstride, bstride, gp, gs, w, g, a[31])
    up = carray(u8_at(a[14] + lo * nb), w * nb)
    us = carray(f32_at(a[16] + 4 * lo * groups), w * groups)
    _q8_apply(xq, bias, sx, xstride, bstride, up, us, w, u, a[31])
    silu_mul(g, u, g)
    h = carray(f32_at(a[22]), (n, n_f))
    h[:, lo:hi] = g
    hq, hbias, hsx, hxs, hbs = _q8_at(a, 23)
    q8_prep_groups(h.reshape(-1), n, n_f, hq, hbias, hsx, hxs, hbs, lo // 64, hi // 64)


def _job_q8_down_part(row):  # type: ignore[no-untyped-def]
    """Output features ``[c, d)`` of a fast-int8 MLP's down projection from its rounded
    intermediate rows, times each row's gate weight: [fn, h rounded (8), n, down (packed,
    size, scales, size), c, d, F, g, out, D, pf]; the weight whole, ``out`` [n, D]."""
    a = carray(i64_at(row), WIDTH)
    hq, hbias, hsx, hxs, hbs = _q8_at(a, 1)
    n, lo, hi, n_f = a[9], a[14], a[15], a[16]
    nb, groups = n_f // 2, n_f // 64
    w = hi - lo
    dp = carray(u8_at(a[10] + lo * nb), w * nb)
    ds = carray(f32_at(a[12] + 4 * lo * groups), w * groups)
    tmp = np.empty((n, w), np.float32)
    _q8_apply(hq, hbias, hsx, hxs, hbs, dp, ds, w, tmp, a[20])
    g = carray(f32_at(a[17]), n)
    out = carray(f32_at(a[18]), (n, a[19]))
    for r in range(n):
        for j in range(w):
            out[r, lo + j] = tmp[r, j] * g[r]


def _job_mla_heads(row):  # type: ignore[no-untyped-def]
    """Absorbed MLA attention of one query row for heads ``[h0, h1)``: ``W_UK`` (``_heads_axpy``),
    the latent attention over its keys (``_latent_attention``), ``W_UV`` (int4,
    ``_heads_i4``), each head computed by the code a whole call runs for it (``h0`` a multiple
    of 4: the attention takes heads four at a time). [fn, q_nope, N, W_UK, C, q_rope, R,
    latent, k_rope, S, mask, mask size (0: every key), scale (float32 bits), h0, h1, q_lat,
    o_lat, W_UV (packed, size, scales, size, row0, row_step, V, gbytes, s_row, s_step, wide),
    out, pf, W_UK int4 (1: ``W_UK`` is int4 rows of W_UV's matrix, ``_heads_axpy_i4``, and the
    W_UK address unused), its first row]; per head ``q_nope`` [N], ``q_lat`` / ``o_lat`` [C],
    ``out`` [V]."""
    a = carray(i64_at(row), WIDTH)
    n, c, r, s_all, h0, h1, v = a[2], a[4], a[6], a[9], a[13], a[14], a[23]
    nh = h1 - h0
    q_nope = carray(f32_at(a[1] + h0 * n * 4), (1, nh, n))
    q_lat = carray(f32_at(a[15] + h0 * c * 4), (1, nh, c))
    packed = carray(u8_at(a[17]), a[18])
    scales = carray(f32_at(a[19]), a[20])
    if a[30] != 0:  # int4 W_UK: rows of W_UV's matrix, from row a[31], with its walk
        _heads_axpy_i4(
            packed, scales, a[31] + h0 * a[22], a[22], nh, n, c, a[24], a[25], a[26], q_nope,
            q_lat,
        )  # fmt: skip
    else:
        w_uk = carray(f32_at(a[3] + h0 * n * c * 4), nh * n * c)
        _heads_axpy(w_uk, nh, n, c, q_nope, q_lat)
    q_rope = carray(f32_at(a[5] + h0 * r * 4), nh * r)
    latent = carray(f32_at(a[7]), s_all * c)
    k_rope = carray(f32_at(a[8]), s_all * r)
    mask = carray(u8_at(a[10]), a[11])
    scale = carray(f32_at(row + 12 * 8), 1)[0]
    o_lat = carray(f32_at(a[16] + h0 * c * 4), (1, nh, c))
    _latent_attention(
        q_lat.reshape(-1), q_rope, latent, k_rope, mask, 1, nh, c, r, s_all, scale, 0,
        o_lat.reshape(-1),
    )  # fmt: skip
    out = carray(f32_at(a[28] + h0 * v * 4), (1, nh, v))
    _heads_i4(
        packed, scales, a[21] + h0 * a[22], a[22], nh, v, c, a[24], a[25], a[26], a[27] != 0,
        o_lat, out, a[29],
    )  # fmt: skip


@njit(nogil=True, cache=True)
def combine_sorted(out, tok, n_tok):  # type: ignore[no-untyped-def]
    """[T, D]: rows of ``out`` [R, D] (routed experts' gate-weighted outputs, grouped by
    ascending expert id) summed into their rows ``tok`` [R] in that order, from zeros: per
    row the additions of ``moe.combine``, so the same bits."""
    n_d = out.shape[1]
    y = np.zeros((n_tok, n_d), np.float32)
    for r in range(tok.shape[0]):
        t = tok[r]
        for c in range(n_d):
            y[t, c] += out[r, c]
    return y


@njit(nogil=True, cache=True)
def crew_linears(ctrl, x, template, job_out, job_at, out_at, n_outs, nb, q8, stats):  # type: ignore[no-untyped-def]
    """Int4 matmuls of the same input ``x`` [T, I] in one crew run: flat [T * sum(O)], each
    weight's [T, O] after the one before (``out_at[m]`` its first column in the sum).

    ``template`` [P, WIDTH]: every weight's ``_job_i4_apply`` rows (``i4_rows_template``), job
    ``p`` computing features from ``job_at[p]`` of weight ``job_out[p]``; ``nb`` the packed
    bytes per row, the same for all (so one ``_i4_prep`` of ``x`` serves every job). The bits
    of one ``i4_matmul`` per weight; with ``q8``, of one ``q8_matmul`` (``q8_rows_template``
    jobs, ``x`` rounded once). ``stats`` as ``crew_moe``'s ([3])."""
    n_tok = x.shape[0]
    ys = _i4_stride(nb)
    y = _i4_prep(x[: 0 if q8 else n_tok], nb, ys)
    xq, xb, xs, xstride, xbstride = _q8_round(x[: n_tok if q8 else 0])
    total = out_at[-1] + n_outs[-1]
    buf = np.empty(n_tok * total, np.float32)  # job by job, each [T, b - a]
    n = template.shape[0]
    table = template.copy()
    for p in range(n):
        at = buf.ctypes.data + 4 * n_tok * (out_at[job_out[p]] + job_at[p])
        if q8:
            table[p, 1] = xq.ctypes.data
            table[p, 2] = xq.size
            table[p, 3] = xb.ctypes.data
            table[p, 4] = xb.size
            table[p, 5] = xs.ctypes.data
            table[p, 6] = xs.size
            table[p, 7] = xstride
            table[p, 8] = xbstride
            table[p, 9] = n_tok
            table[p, 15] = at
        else:
            table[p, 1] = y.ctypes.data
            table[p, 2] = y.size
            table[p, 3] = ys
            table[p, 4] = n_tok
            table[p, 16] = at
    stats[0] = crew_run(ctrl, table, n)
    stats[1] = n
    stats[2] = ctrl[WAITED * CELL] + _alive(y, table, buf, xq, xb) + xs.size * 0
    if n_tok == 1:
        return buf
    out = np.empty(n_tok * total, np.float32)
    for p in range(n):
        m = job_out[p]
        a = job_at[p]
        b = job_at[p + 1] if p + 1 < n and job_out[p + 1] == m else n_outs[m]
        blk = n_tok * (out_at[m] + a)
        for t in range(n_tok):
            row = n_tok * out_at[m] + t * n_outs[m]
            for j in range(b - a):
                out[row + a + j] = buf[blk + t * (b - a) + j]
    return out


@njit(nogil=True, cache=True)
def crew_lora(ctrl, x, first, norm_w, eps, second, stats):  # type: ignore[no-untyped-def]
    """An MLA projection's low-rank query path and its KV projection in two crew runs:
    ``q_a_proj`` and ``kv_a_proj_with_mqa`` of ``x`` [T, D] (:func:`crew_linears` with the
    arguments ``first``), ``q_a_layernorm`` of the first (``rms_rows``, ``norm_w``, ``eps``),
    then ``q_b_proj`` of that (``second``): (q_resid [T, Q], kv [T, C + R], q [T, H]) with the
    bits of the calls one by one. ``first`` / ``second``: (template, job_out, job_at, out_at,
    n_outs, nb, q8). ``stats`` [4] as ``crew_heads_out``'s."""
    n_tok = x.shape[0]
    t1, o1, a1, at1, n1, nb1, q1 = first
    t2, o2, a2, at2, n2, nb2, q2 = second
    inner = np.zeros(3, np.int64)
    y = crew_linears(ctrl, x, t1, o1, a1, at1, n1, nb1, q1, inner)
    stats[0] = inner[0]
    stats[1] = inner[1]
    stats[2] = inner[2]
    qa = y[: n_tok * n1[0]].reshape(n_tok, n1[0])
    kv = y[n_tok * n1[0] :].reshape(n_tok, n1[1])
    q_resid = np.empty((n_tok, n1[0]), np.float32)
    rms_rows(qa, norm_w, eps, q_resid)
    q = crew_linears(ctrl, q_resid, t2, o2, a2, at2, n2, nb2, q2, inner)
    stats[0] += inner[0]
    stats[1] += inner[1]
    stats[3] = inner[2]
    return q_resid, kv, q.reshape(n_tok, n2[0])


@njit(nogil=True, cache=True)
def heads_table(template, q_nope, q_rope, latent, k_rope, mask, scale_bits, q_lat, o_lat, out):  # type: ignore[no-untyped-def]
    """A copy of ``heads_template`` rows with one call's columns filled: the query row
    (``q_nope`` [1, NH, N], ``q_rope`` [1, NH, R]), its keys (``latent`` [S, C], ``k_rope``
    [S, R]), ``mask`` (uint8 [S] or empty), the scale's float32 bits and the scratch and output
    arrays (every array C-contiguous; the caller keeps them alive while the table runs)."""
    table = template.copy()
    for j in range(table.shape[0]):
        table[j, 1] = q_nope.ctypes.data
        table[j, 5] = q_rope.ctypes.data
        table[j, 6] = k_rope.shape[1]
        table[j, 7] = latent.ctypes.data
        table[j, 8] = k_rope.ctypes.data
        table[j, 9] = latent.shape[0]
        table[j, 10] = mask.ctypes.data
        table[j, 11] = mask.size
        table[j, 12] = scale_bits
        table[j, 15] = q_lat.ctypes.data
        table[j, 16] = o_lat.ctypes.data
        table[j, 28] = out.ctypes.data
    return table


@njit(nogil=True, cache=True)
def crew_heads_out(ctrl, table, heads, template, job_out, job_at, out_at, n_outs, nb, q8, stats):  # type: ignore[no-untyped-def]
    """A run of ``_job_mla_heads`` (``table``, filling ``heads`` [1, NH * V]), then the output
    projection of ``heads`` as :func:`crew_linears` (its arguments): [1, D] flat. ``stats``
    [4]: jobs this thread ran, jobs posted, each run's polls waited at its end."""
    n = table.shape[0]
    ran = crew_run(ctrl, table, n)
    waited = ctrl[WAITED * CELL]
    inner = np.zeros(3, np.int64)
    y = crew_linears(ctrl, heads, template, job_out, job_at, out_at, n_outs, nb, q8, inner)
    stats[0] = ran + inner[0]
    stats[1] = n + inner[1]
    stats[2] = waited
    stats[3] = inner[2]
    return y


@njit(nogil=True, cache=True, inline="always")
def _lines(n, size):  # type: ignore[no-untyped-def]
    """``n`` elements of ``size`` bytes rounded up to whole 64-byte lines, in elements."""
    per = ALIGN // size
    return (n + per - 1) // per * per


@njit(nogil=True, cache=True)
def _alive(a, b, c, d, e):  # type: ignore[no-untyped-def]
    """0, after a use of every argument (see :func:`crew_moe`)."""
    return a.size * 0 + b.size * 0 + c.size * 0 + d.size * 0 + e.size * 0


@njit(nogil=True, cache=True)
def _most_rows_first(n, n_all):  # type: ignore[no-untyped-def]
    """``np.argsort(-n[:n_all], kind="stable")``: the indices by descending ``n``, ties in
    index order, by insertion (a MoE step has a few MLPs, a prefill chunk at most one per
    expert and the shared one; numba's merge sort took ~1.7 s of a first run's compile)."""
    order = np.empty(n_all, np.int64)
    for i in range(n_all):
        j = i
        while j > 0 and n[order[j - 1]] < n[i]:
            order[j] = order[j - 1]
            j -= 1
        order[j] = i
    return order


@njit(nogil=True, cache=True)
def _post_mlps(table, at, templates, cols, vals):  # type: ignore[no-untyped-def]
    """Copy ``templates`` [P, WIDTH] into ``table`` from row ``at`` with column ``cols[i]`` set
    to ``vals[i]`` in every copied row; the next free row."""
    for p in range(templates.shape[0]):
        for c in range(WIDTH):
            table[at + p, c] = templates[p, c]
        for i in range(cols.shape[0]):
            table[at + p, cols[i]] = vals[i]
    return at + templates.shape[0]


@njit(nogil=True, cache=True)
def crew_moe(ctrl, x, ids, gates, first, second, s_first, s_second, n_f, s_nf, q8, stats):  # type: ignore[no-untyped-def]
    """A MoE step's experts in two crew runs, from the routing to the per-row sums:
    (routed [T, D], the shared expert's output [T, D] or an empty [0, D]).

    ``x`` [T, D] (normed rows), ``ids`` [T, K] (expert ids), ``gates`` [T, K]; ``first`` /
    ``second`` [E, P, WIDTH]: each routed expert's job templates (``mlp_templates``: its
    activation feature ranges, its output feature ranges), ``n_f`` its intermediate size;
    ``s_first`` / ``s_second`` [P', WIDTH] the shared expert's (no rows: none), ``s_nf``.
    The rows routed to an expert are gathered in ascending expert id, by row within one
    (``np.argsort(ids, kind="stable")``), each MLP's rows through its two phases as
    ``i4_swiglu_part`` / ``i4_down_part`` with its gate weights, and summed per row from zeros
    in that order (``combine_sorted``): the bits of ``ExpertCompute.crew_step``'s Python form,
    which did the same in some twenty numpy calls. ``q8``: the fast-int8 form (templates of
    ``q8_mlp_templates``; the gathered rows rounded once, each MLP's intermediate rows
    rounded range by range in its first run): the bits of ``q8_expert`` / ``q8_swiglu``.
    ``stats`` int64 [4]: jobs this thread ran, jobs posted, the polls waited at each run's
    end."""
    n_tok, k = ids.shape
    n_d = x.shape[1]
    n_e = first.shape[0]
    shared = s_first.shape[0] > 0
    counts = np.zeros(n_e, np.int64)
    for t in range(n_tok):
        for j in range(k):
            counts[ids[t, j]] += 1
    n_m = 0
    for e in range(n_e):
        if counts[e] > 0:
            n_m += 1
    es = np.empty(n_m + 1, np.int64)  # present experts ascending, then the shared one (-1)
    n = np.empty(n_m + 1, np.int64)  # rows of each MLP
    start = np.empty(n_m + 1, np.int64)  # its first row in xe
    pos = np.zeros(n_e, np.int64)  # next free row of each expert's block
    m = 0
    r = 0
    for e in range(n_e):
        if counts[e] > 0:
            es[m], n[m], start[m], pos[e] = e, counts[e], r, r
            r += counts[e]
            m += 1
    n_routed = r
    es[n_m], n[n_m], start[n_m] = -1, n_tok, n_routed
    n_all = n_m + 1 if shared else n_m
    rows = n_routed + (n_tok if shared else 0)
    xe = np.empty((rows, n_d), np.float32)
    g = np.ones(rows, np.float32)
    tok = np.empty(n_routed, np.int64)
    for t in range(n_tok):  # row-major: within an expert, rows ascending (a stable sort)
        for j in range(k):
            e = ids[t, j]
            i = pos[e]
            pos[e] = i + 1
            tok[i] = t
            g[i] = gates[t, j]
            for c in range(n_d):  # (element by element: a row assignment compiles numba's
                xe[i, c] = x[t, c]  # shape-mismatch message, ~2.5 s of a first run)
    if shared:
        for t in range(n_tok):
            for c in range(n_d):
                xe[n_routed + t, c] = x[t, c]
    nf = np.empty(n_all, np.int64)
    h_at = np.empty(n_all, np.int64)
    total = 0
    for m in range(n_all):
        nf[m] = n_f[es[m]] if es[m] >= 0 else s_nf
        h_at[m] = total
        total += n[m] * nf[m]
    h = np.empty(total, np.float32)
    out = np.empty((rows, n_d), np.float32)
    # fast-int8: the rows rounded once (a row's digits depend on that row alone), and room for
    # each MLP's rounded intermediate rows, every block on a cache line of its own
    x_groups = n_d // 64
    if q8:
        xq, xb, xs, xstride, xbstride = _q8_round(xe)
    else:
        xq, xb, xs, xstride, xbstride = _q8_round(xe[:0])
    hq_at = np.zeros(n_all + 1, np.int64)
    hb_at = np.zeros(n_all + 1, np.int64)
    hs_at = np.zeros(n_all + 1, np.int64)
    for m in range(n_all):
        hxs, hbs = q8_strides(nf[m]) if q8 else (0, 0)
        hq_at[m + 1] = hq_at[m] + _lines(n[m] * hxs, 1)
        hb_at[m + 1] = hb_at[m] + _lines(n[m] * hbs, 4)
        hs_at[m + 1] = hs_at[m] + _lines(n[m] * (nf[m] // 64) * (1 if q8 else 0), 4)
    hq = zeros64(hq_at[n_all], np.int8)
    hb = zeros64(hb_at[n_all], np.int32)
    hs = zeros64(hs_at[n_all], np.float32)
    # the MLPs with most rows first (a stable sort: a prefill step's shared expert, which
    # takes every row, leads), so no big job is left for the end of a run
    order = _most_rows_first(n, n_all)
    p1 = first.shape[1] * n_m + (s_first.shape[0] if shared else 0)
    p2 = second.shape[1] * n_m + (s_second.shape[0] if shared else 0)
    t1 = np.empty((p1, WIDTH), np.int64)
    t2 = np.empty((p2, WIDTH), np.int64)
    if q8:
        c1 = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 22, 23, 24, 25, 26, 27, 28, 29, 30], np.int64)
        c2 = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 18], np.int64)
    else:
        c1 = np.array([1, 2, 28], np.int64)
        c2 = np.array([1, 2, 17, 18], np.int64)
    v1 = np.empty(c1.size, np.int64)
    v2 = np.empty(c2.size, np.int64)
    a1 = 0
    a2 = 0
    for i in range(n_all):
        m = order[i]
        e = es[m]
        h_addr = h.ctypes.data + h_at[m] * 4
        g_addr = g.ctypes.data + start[m] * 4
        o_addr = out.ctypes.data + start[m] * 4 * n_d
        if q8:
            hxs, hbs = q8_strides(nf[m])
            v1[0] = xq.ctypes.data + start[m] * xstride
            v1[1] = n[m] * xstride
            v1[2] = xb.ctypes.data + start[m] * xbstride * 4
            v1[3] = n[m] * xbstride
            v1[4] = xs.ctypes.data + start[m] * x_groups * 4
            v1[5] = n[m] * x_groups
            v1[6] = xstride
            v1[7] = xbstride
            v1[8] = n[m]
            v1[9] = h_addr
            v1[10] = hq.ctypes.data + hq_at[m]
            v1[11] = n[m] * hxs
            v1[12] = hb.ctypes.data + hb_at[m] * 4
            v1[13] = n[m] * hbs
            v1[14] = hs.ctypes.data + hs_at[m] * 4
            v1[15] = n[m] * (nf[m] // 64)
            v1[16] = hxs
            v1[17] = hbs
            for j in range(8):
                v2[j] = v1[10 + j]
            v2[8] = n[m]
            v2[9] = g_addr
            v2[10] = o_addr
        else:
            v1[0] = xe.ctypes.data + start[m] * 4 * n_d
            v1[1] = n[m]
            v1[2] = h_addr
            v2[0] = h_addr
            v2[1] = n[m]
            v2[2] = g_addr
            v2[3] = o_addr
        if e >= 0:
            a1 = _post_mlps(t1, a1, first[e], c1, v1)
            a2 = _post_mlps(t2, a2, second[e], c2, v2)
        else:
            a1 = _post_mlps(t1, a1, s_first, c1, v1)
            a2 = _post_mlps(t2, a2, s_second, c2, v2)
    stats[0] = crew_run(ctrl, t1, p1)
    stats[2] = ctrl[WAITED * CELL]
    stats[0] += crew_run(ctrl, t2, p2)
    stats[3] = ctrl[WAITED * CELL]
    # numba frees an array after its last use in the function: the jobs' arrays are used
    # here, after the runs that read and write them through addresses
    stats[1] = p1 + p2 + _alive(xe, g, h, t1, t2) + _alive(xq, xb, xs, hq, hb) + hs.size * 0
    routed = combine_sorted(out, tok, n_tok)
    if shared:
        return routed, out[n_routed:]
    return routed, out[:0]


_KINDS = {
    "i4_apply": _job_i4_apply,
    "i8_rows": _job_i8_rows,
    "f32_rows": _job_f32_rows,
    "i4_swiglu_part": _job_i4_swiglu_part,
    "i4_down_part": _job_i4_down_part,
    "mla_heads": _job_mla_heads,
    "q8_rows": _job_q8_rows,
    "q8_swiglu_part": _job_q8_swiglu_part,
    "q8_down_part": _job_q8_down_part,
}
#: the kinds every exact decode step uses, compiled when a crew starts (the others at their
#: first job: the attention heads' and the fast-int8 kinds took ~16 s to compile cold)
_AT_START = ("i4_apply", "i8_rows", "i4_swiglu_part", "i4_down_part")


@functools.cache
def _compiled(name: str) -> Any:
    """Job kind ``name``'s ``cfunc``, compiled (or loaded from numba's cache) once; the object
    keeps its compiled code alive."""
    return cfunc(_SIG, cache=True)(_KINDS[name])


class JobKinds:
    """The job kinds' ``cfunc`` addresses by name (``job_kinds().i4_apply``), each compiled at
    its first use."""

    def __getattr__(self, name: str) -> int:
        if name not in _KINDS:
            raise AttributeError(name)
        return int(_compiled(name).address)


@functools.cache
def job_kinds() -> JobKinds:
    """The job kinds, those of exact decode compiled now (see above)."""
    kinds = JobKinds()
    for name in _AT_START:
        getattr(kinds, name)
    return kinds


#: Every compiled kernel (tests check they were built with ``nogil=True``).
KERNELS: tuple[Any, ...] = (
    _drain, crew_run, one_run, crew_work, combine_sorted, _alive, _post_mlps, _most_rows_first,
    crew_moe, crew_linears, heads_table, crew_heads_out, crew_lora,
)  # fmt: skip

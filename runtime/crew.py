"""The job crew: worker threads that take kernel calls from the compute thread without the GIL.

:class:`Crew` starts ``workers`` threads that each run :func:`runtime.kernels.crew.crew_work`
(a ``nogil`` loop); the ``*_template`` functions make a weight's jobs once, a table of kernel
calls whose callers fill in their arrays' addresses (:mod:`runtime.kernels.crew` says what a
job is). :meth:`Crew.run` posts a table and takes jobs from it on the calling thread too,
returning once every job has finished. Between runs a worker polls for the next one for
``poll_iters`` atomic loads (about as long as :data:`runtime.compute.POLL_US`), then sleeps on
an event; the next run wakes it but does not wait for it (the posting thread takes every job
nobody else took), so a machine busy with other work never makes a run wait for a worker that
is not running.

Why: on the 2-vCPU guests this project is measured on, handing a Python callable to a thread
pool costs 47-120 us (a lock, the wake of the idle vCPU, the GIL), about what a one-token
attention projection takes; a decode step of the DeepSeek-V3-shaped benchmark model made nine
such hand-offs. A crew run costs a few microseconds, so every matmul of a decode step worth
more than :data:`CREW_MIN_MACS` multiply-adds splits over both cores (docs/architecture.md).

Every job computes output features with the kernels a single call runs, so results are
bit-identical to one thread's whatever the number of workers (tests compare them bit for bit).

Shape legend: T rows, D hidden, F intermediate, O out features, I in features.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from runtime.kernels._intrinsics import zeros64
from runtime.kernels._matmul_kernels import _i4_prep, _i4_stride, _pad_rows
from runtime.kernels.crew import (
    CELL,
    JOBS,
    PARKED,
    REST,
    STOP,
    WIDTH,
    crew_work,
    job_kinds,
)
from runtime.kernels.crew import one_run as _one_run
from runtime.kernels.heads import HeadsMatmul
from runtime.kernels.quant_matmul import DEFAULT_PREFETCH, Int4Weight, Q8Weight, edges16

__all__ = [
    "CREW_MIN_MACS",
    "Crew",
    "F32Rows",
    "Int8Rows",
    "addr",
    "f32_prepared",
    "f32_rows_template",
    "heads_template",
    "i4_fields",
    "i4_prepared",
    "i4_rows_template",
    "i8_prepared",
    "i8_rows_template",
    "mlp_templates",
    "q8_fields",
    "q8_mlp_templates",
    "q8_rows_template",
]

F32Array = npt.NDArray[np.float32]
I64Array = npt.NDArray[np.int64]

#: Matmuls from this many multiply-adds split over the crew (a run costs a few microseconds;
#: below ~1M multiply-adds a one-token matmul takes less than ~50 us and splitting gains little).
CREW_MIN_MACS = 1 << 20
_PREFIX = "colibri-crew"
#: Runs per judgement of the crew, the mean wait (us) at a run's end that means its workers
#: are kept off their CPUs, and the first and longest time it then stands aside (seconds).
#: A window is long (~10 decode steps) because the waits come in rare long ones both ways: a
#: quiet 2-vCPU guest's hypervisor takes a vCPU away for 0.3-1.7 ms a few times a second
#: (means over 256 runs 2-5 us; 32 runs with one such wait averaged 55 us), while another
#: process on a CPU leaves a few percent of the runs waiting one of its 10-15 ms time slices
#: (means over 256 runs 200-290 us).
WINDOW = 256
CONTENDED_WAIT_US = 40.0
BACKOFF_S = (1.0, 8.0)


def addr(a: npt.NDArray[Any]) -> int:
    return int(a.__array_interface__["data"][0])


class Int8Rows:
    """An int8 weight (16-lane kernels) as the crew takes it: bytes [O * I], scales [O]."""

    __slots__ = ("data", "n_in", "n_out", "scales")

    def __init__(self, data: npt.NDArray[np.uint8], scales: F32Array, n_out: int, n_in: int):
        self.data, self.scales, self.n_out, self.n_in = data, scales, n_out, n_in


class F32Rows:
    """A float32 weight as the crew takes it: elements [O * I] (a router: the MoE layers'
    routers stay float32, and GLM-5's [256, 6144] is 6.3 MB a layer)."""

    __slots__ = ("data", "n_in", "n_out", "one")

    def __init__(self, data: F32Array, n_out: int, n_in: int):
        self.data, self.n_out, self.n_in = data, n_out, n_in
        self.one = np.ones(1, np.float32)  # the scale the dense kernel takes (held here)


def _table(rows: Sequence[Sequence[int]]) -> I64Array:
    table = np.zeros((len(rows), WIDTH), np.int64)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return table


# Templates: a weight's jobs with every field that does not change between calls filled in
# (made once per weight); a call copies them and fills in the addresses of its activations and
# outputs with a few column stores, ~1 us a job where filling each row from Python took 10.


def i4_fields(packed: npt.NDArray[np.uint8], scales: F32Array, walk: Sequence[int]) -> list[int]:
    """An int4 weight as the 11 fields a job row holds (``_i4_at`` reads them back): packed
    address, size, scales address, size, walk (7)."""
    return [addr(packed), packed.size, addr(scales), scales.size, *walk]


def i4_rows_template(w: Int4Weight, edges: Sequence[int]) -> I64Array:
    """Jobs of ``_job_i4_apply`` for the row ranges ``edges`` of int4 ``w`` [P, WIDTH]; per call
    columns 1 (activations), 2 (their size), 3 (their stride), 4 (T) and 16 (output)."""
    walk = w.walk
    nb, s_row = walk[2], walk[4]
    rows = []
    for a, b in itertools.pairwise(edges):
        p, s = w.packed[a * nb : b * nb], w.scales[a * s_row : b * s_row]
        fields = i4_fields(p, s, (b - a, *walk[1:]))
        rows.append([job_kinds().i4_apply, 0, 0, 0, 0, *fields, 0, DEFAULT_PREFETCH])
    return _table(rows)


def i8_rows_template(w: Int8Rows, edges: Sequence[int]) -> I64Array:
    """Jobs of ``_job_i8_rows`` for the row ranges ``edges`` of int8 ``w`` [P, WIDTH]; per call
    columns 1 (padded activations), 2 (T), 3 (their row stride) and 8 (output)."""
    rows = []
    for a, b in itertools.pairwise(edges):
        d, s = w.data[a * w.n_in : b * w.n_in], w.scales[a:b]
        rows.append(
            (
                job_kinds().i8_rows,
                0,
                0,
                0,
                addr(d),
                b - a,
                w.n_in,
                addr(s),
                0,
                DEFAULT_PREFETCH,
            )
        )
    return _table(rows)


def f32_rows_template(w: F32Rows, edges: Sequence[int]) -> I64Array:
    """Jobs of ``_job_f32_rows`` for the row ranges ``edges`` of float32 ``w`` [P, WIDTH]; per
    call columns 1 (activations padded to 8 columns), 2 (T), 3 (their row stride) and 8
    (output), as :func:`i8_rows_template`'s."""
    rows = []
    for a, b in itertools.pairwise(edges):
        d = w.data[a * w.n_in : b * w.n_in]
        pf = DEFAULT_PREFETCH // 4  # (the dense kernel counts its prefetch in elements)
        rows.append((job_kinds().f32_rows, 0, 0, 0, addr(d), b - a, w.n_in, addr(w.one), 0, pf))
    return _table(rows)


def mlp_templates(
    f: tuple[Int4Weight, Int4Weight, Int4Weight], parts: int
) -> tuple[I64Array, I64Array]:
    """An int4 SwiGLU MLP's jobs in ``parts`` ranges: the activation features
    (``_job_i4_swiglu_part``; per call columns 1 (rows), 2 (n), 28 (h)) and the output
    features (``_job_i4_down_part``; per call columns 1 (h), 2 (n), 17 (gate weights), 18
    (output))."""
    gate, up, down = f
    n_f, n_d = gate.walk[0], down.walk[0]
    gate_up = i4_fields(*gate) + i4_fields(*up)
    first = [
        [job_kinds().i4_swiglu_part, 0, 0, gate.walk[1], *gate_up, a, b, 0, n_f, DEFAULT_PREFETCH]
        for a, b in itertools.pairwise(edges16(n_f, parts))
    ]
    down_fields = i4_fields(*down)
    second = [
        [job_kinds().i4_down_part, 0, 0, n_f, *down_fields, c, d, 0, 0, n_d, DEFAULT_PREFETCH]
        for c, d in itertools.pairwise(edges16(n_d, parts))
    ]
    return _table(first), _table(second)


def q8_fields(w: Q8Weight) -> list[int]:
    """A fast-int8 weight as the 4 fields a job row holds: packed address, size, per-chunk
    scales address, size."""
    return [addr(w.packed), w.packed.size, addr(w.scales), w.scales.size]


def q8_mlp_templates(
    f: tuple[Q8Weight, Q8Weight, Q8Weight], parts: int
) -> tuple[I64Array, I64Array]:
    """A fast-int8 SwiGLU MLP's jobs in ``parts`` ranges: the intermediate features in whole
    64-column groups (``_job_q8_swiglu_part``; per call columns 1-8 (rows rounded), 9 (n), 22
    (h) and 23-30 (h rounded)) and the output features (``_job_q8_down_part``; per call
    columns 1-8 (h rounded), 9 (n), 17 (gate weights), 18 (output))."""
    gate, up, down = f
    n_f, n_d = gate.n_out, gate.n_in
    kinds = job_kinds()
    first = [
        [kinds.q8_swiglu_part, *[0] * 9, *q8_fields(gate), *q8_fields(up), a, b, n_f, n_d,
         *[0] * 9, DEFAULT_PREFETCH]
        for a, b in itertools.pairwise(edges16(n_f, parts, 64))
    ]  # fmt: skip
    second = [
        [kinds.q8_down_part, *[0] * 9, *q8_fields(down), c, d, n_f, 0, 0, n_d, DEFAULT_PREFETCH]
        for c, d in itertools.pairwise(edges16(n_d, parts))
    ]
    return _table(first), _table(second)


def q8_rows_template(w: Q8Weight, edges: Sequence[int]) -> I64Array:
    """Jobs of ``_job_q8_rows`` for the row ranges ``edges`` of fast-int8 ``w`` [P, WIDTH];
    per call columns 1-8 (rows rounded), 9 (T) and 15 (output)."""
    nb, groups = w.packed.size // w.n_out, w.scales.size // w.n_out
    rows = []
    for a, b in itertools.pairwise(edges):
        p, s = w.packed[a * nb : b * nb], w.scales[a * groups : b * groups]
        rows.append([job_kinds().q8_rows, *[0] * 9, addr(p), p.size, addr(s), s.size, b - a, 0,
                     DEFAULT_PREFETCH])  # fmt: skip
    return _table(rows)


def heads_template(uk: HeadsMatmul, uv: HeadsMatmul, parts: int) -> I64Array | None:
    """``_job_mla_heads`` rows for about ``parts`` ranges of heads (from multiples of 4) with
    the weights' fields filled in; per call columns 1 (q_nope), 5 (q_rope), 6 (R), 7-8 (the
    keys), 9 (S), 10-11 (mask), 12 (scale), 15-16 (scratch) and 28 (output). An int4
    ``W_UK`` (``axpy_int4``) must be rows of ``W_UV``'s matrix with its walk (the job reads
    both from it: column 30 says so, column 31 is its first row); None where it is not."""
    nh, n, c = uk.spec[:3]
    _, row0, row_step, v, _, gbytes, s_row, s_step, wide = uv.spec
    packed, scales = uv.held
    if uk.kind == "axpy_int4":
        k_packed, k_scales = uk.held
        _, _, _, k_row0, k_step, k_gbytes, k_s_row, k_s_step = uk.spec
        mine = (addr(k_packed), k_packed.size, addr(k_scales), k_scales.size)
        same_matrix = mine == (addr(packed), packed.size, addr(scales), scales.size)
        same_walk = (k_step, k_gbytes, k_s_row, k_s_step) == (row_step, gbytes, s_row, s_step)
        if not (same_matrix and same_walk):
            return None
        uk_fields = (0, 1, k_row0)  # W_UK address unused; int4; its first row
    else:
        (w_uk,) = uk.held
        uk_fields = (addr(w_uk), 0, 0)
    step = -(-nh // (4 * parts)) * 4
    table = np.zeros((-(-nh // step), WIDTH), np.int64)
    for i, h0 in enumerate(range(0, nh, step)):
        table[i, :5] = (job_kinds().mla_heads, 0, n, uk_fields[0], c)
        table[i, 30:32] = uk_fields[1:]
        table[i, 13:15] = (h0, min(h0 + step, nh))
        table[i, 17:28] = (
            addr(packed), packed.size, addr(scales), scales.size, row0, row_step, v, gbytes,
            s_row, s_step, wide,
        )  # fmt: skip
        table[i, 29] = DEFAULT_PREFETCH
    return table


def i4_prepared(x: F32Array, w: Int4Weight) -> tuple[F32Array, int]:
    """``x`` [T, I] prepared once for every row range of int4 ``w`` (``_i4_prep``), and the
    stride of its rows."""
    ys = int(_i4_stride(w.walk[2]))
    return _i4_prep(x, w.walk[2], ys), ys


def f32_prepared(x: F32Array, n_in: int) -> F32Array:
    """``x`` [T, I] zero-padded to a multiple of 8 columns for the dense 8-lane kernel."""
    out: F32Array = _pad_rows(x, (n_in + 7) // 8 * 8)
    return out


def i8_prepared(x: F32Array, n_in: int) -> F32Array:
    """``x`` [T, I] zero-padded to a multiple of 16 columns for the int8 16-lane kernels."""
    out: F32Array = _pad_rows(x, (n_in + 15) // 16 * 16)
    return out


class Crew:
    """``workers`` threads taking kernel jobs (see the module docstring). :meth:`run` may be
    called from any thread; a run posted while another is in progress runs on the calling
    thread alone (the same results)."""

    def __init__(self, workers: int, poll_iters: int, iters_per_us: float = 1000.0) -> None:
        """``poll_iters``: how many polls a worker makes for the next run before it sleeps;
        ``iters_per_us``: polls per microsecond on this CPU (how the posting thread's waits
        are judged, see :meth:`usable`)."""
        if not 1 <= workers <= JOBS:
            raise ValueError(f"a crew has 1..{JOBS} workers, got {workers}")
        self.workers = workers
        self._iters_per_us = max(float(iters_per_us), 1e-3)
        self._window = [0, 0]  # runs and polls waited since the last judgement
        self._slow = 0  # judgements in a row that found long waits
        self._backoff_s = BACKOFF_S[0]
        self._idle_until = 0.0  # monotonic time before which the crew stands aside
        self.contended = 0  # judgements that found the workers kept off their CPUs
        job_kinds()  # compiled (or loaded) now, not at the first matmul of a step
        self._poll_iters = max(1, int(poll_iters))
        self._ctrl: I64Array = zeros64((STOP + JOBS) * CELL, np.int64)
        self._alone: I64Array = zeros64((STOP + JOBS) * CELL, np.int64)  # a run without workers
        self._wake = [threading.Event() for _ in range(workers)]
        self._busy = threading.Lock()
        self.runs = 0  # runs posted to the workers
        self.jobs = 0  # jobs in them
        self.posted = 0  # ... of them run by the posting thread
        self.waited = 0  # polls the posting thread made waiting for the workers' jobs
        self.alone = 0  # runs taken on the calling thread alone (another run was in progress)
        self._threads = [
            threading.Thread(target=self._work, args=(w,), name=f"{_PREFIX}-{w}", daemon=True)
            for w in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _work(self, w: int) -> None:
        seen = 0
        ctrl, wake = self._ctrl, self._wake[w]
        while True:
            seen = int(crew_work(ctrl, w, seen, self._poll_iters))
            if seen < 0:
                return
            wake.wait()
            wake.clear()
            ctrl[(PARKED + w) * CELL] = 0

    def run(self, table: I64Array, *, judged: bool = True) -> None:
        """Run every job of ``table`` (int64 [N, WIDTH], C-contiguous; the caller keeps every
        array it points to alive), on this thread and the workers; returns when all
        finished. ``judged``: as :meth:`call`'s."""
        n = table.shape[0]
        if n == 0:
            return
        self.call(_one_run, 1, table, n, judged=judged)

    def call(self, fn: Any, runs: int, *args: Any, judged: bool = True) -> Any:
        """``fn(ctrl, *args, stats)``: a numba function that posts ``runs`` runs itself with
        :func:`runtime.kernels.crew.crew_run` on ``ctrl`` (one call for a whole step instead
        of Python between its runs) and reports in ``stats`` (int64 [2 + runs]) the jobs it
        ran, the jobs posted and each run's polls waited at its end; what ``fn`` returns.
        While another thread's runs are in progress, ``fn`` runs on the calling thread alone
        (the same results). ``judged``: whether the waits at the runs' ends say anything of the
        workers' CPUs (:meth:`_note`); a prompt chunk's jobs are long and uneven, so its runs'
        ends wait for the last long job whoever has the CPUs, and are not judged (they made
        the crew stand aside on a quiet guest)."""
        stats = np.zeros(2 + runs, np.int64)
        if not self._busy.acquire(blocking=False):
            got = fn(self._alone, *args, stats)
            self.alone += runs
            return got
        try:
            ctrl = self._ctrl
            ctrl[REST * CELL] = 0
            woken = False
            for w in range(self.workers):
                if ctrl[(PARKED + w) * CELL]:
                    self._wake[w].set()
                    woken = True
            got = fn(ctrl, *args, stats)
            self.posted += int(stats[0])
            self.jobs += int(stats[1])
            self.runs += runs
            for waited in stats[2:].tolist():
                self.waited += waited
                if judged and not woken:  # a woken worker starts late: no sign of contention
                    self._note(waited)
                woken = False  # it has started by the next run
            return got
        finally:
            self._busy.release()

    def _note(self, waited: int) -> None:
        """Judge the crew every :data:`WINDOW` runs by how long the posting thread waited at
        their ends: a few microseconds a run when the workers have their CPUs, hundreds when
        another process keeps them off (a worker descheduled in the middle of a job), which
        made a decode step 1.37x slower than the thread pool's (2-vCPU guest, one busy
        process beside). After two such windows in a row the crew stands aside
        (:meth:`usable`) for a while, doubling up to ``BACKOFF_S[1]`` while it stays so, and
        its workers sleep."""
        self._window[0] += 1
        self._window[1] += waited
        if self._window[0] < WINDOW:
            return
        mean_us = self._window[1] / self._window[0] / self._iters_per_us
        self._window = [0, 0]
        if mean_us <= CONTENDED_WAIT_US:
            self._backoff_s = BACKOFF_S[0]
            self._slow = 0
            return
        self._slow += 1
        if self._slow < 2:  # one slow window may be first touches of the weights' pages
            return
        self._slow = 0
        self.contended += 1
        self._idle_until = time.monotonic() + self._backoff_s
        self._backoff_s = min(2 * self._backoff_s, BACKOFF_S[1])
        self.rest()

    def usable(self) -> bool:
        """False while the crew stands aside (see :meth:`_note`): callers then use the thread
        pool, whose sleeping workers cost nothing while they cannot run."""
        return time.monotonic() >= self._idle_until

    def rest(self) -> None:
        """Send polling workers to sleep now (the next :meth:`run` wakes them): other threads
        of this process are about to need the CPUs they hold."""
        self._ctrl[REST * CELL] = 1

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        for w in range(self.workers):
            self._ctrl[(STOP + w) * CELL] = 1
            self._wake[w].set()
        for t in self._threads:
            t.join()

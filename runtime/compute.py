"""How a MoE layer computes its routed experts: on how many threads, and with which matmul.

:class:`ExpertCompute` travels in a call's :class:`~runtime.context.StepContext` (the engine makes
one for decode and, under ``--fast-prefill``, one for prefill that shares its pool); it holds no
process-wide state besides the BLAS thread limit it sets for the duration of a parallel fast step.

* **Threads.** Routed experts are independent, so with ``threads > 1`` each arrived expert is
  computed on a worker thread while the compute thread waits for the next read (numba kernels
  and BLAS release the GIL). Outputs are summed afterwards in ascending expert id, exactly as
  the serial path does, so results are bit-identical for every thread count. Small steps (the
  multiply-adds of the step below ``parallel_min_macs``: decode on a tiny model) stay serial:
  handing work to a thread would cost more than it saves.
* **Fast matmul** (``fast_min_rows > 0``, the opt-in ``fast_prefill``). An expert that receives
  at least that many rows is dequantized into a float32 scratch (one projection at a time) and
  multiplied by BLAS, several times faster than the streaming int4 kernel for large prefill
  chunks. BLAS sums in its own order: rows agree with the exact kernels to float rounding, not
  bit for bit, which is why it is opt-in and never used for decode (rows < threshold).
* **Kernels** (``kernels``): ``"exact"`` (the default) or ``"fast-int8"``, the labelled lossy
  kernels that round activations to two int8 digits per 64 columns for int4 weights (experts,
  dense and shared MLPs, attention projections, ``lm_head``: every matmul that goes through
  this class).
  Still deterministic and batch-invariant; not equal to the exact kernels.

Shape legend: T tokens (rows), D hidden, F intermediate, K experts per token.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from runtime.countdown import Countdown, iterations_per_us
from runtime.crew import (
    CREW_MIN_MACS,
    Crew,
    F32Rows,
    Int8Rows,
    addr,
    f32_prepared,
    f32_rows_template,
    heads_template,
    i4_rows_template,
    i8_prepared,
    i8_rows_template,
    mlp_templates,
    q8_mlp_templates,
    q8_rows_template,
)
from runtime.kernels.crew import (
    WIDTH,
    crew_heads_out,
    crew_linears,
    crew_lora,
    crew_moe,
    heads_table,
)
from runtime.kernels.dequant import dequantize
from runtime.kernels.heads import HeadsMatmul
from runtime.kernels.quant_matmul import (
    Int4Weight,
    Q8Input,
    Q8Weight,
    SplitExpert,
    edges16,
    q8_input,
    routed_expert_int4,
    routed_expert_int4_q8,
    routed_layer_int4,
)
from runtime.layers import moe as moe_ops
from runtime.layers.swiglu import MLPWeights, fused, fused_q8, swiglu, swiglu_q8
from runtime.linear import Linear
from runtime.weights import ExpertSource, Guess, ResidentExperts

__all__ = ["KERNEL_MODES", "ExpertCompute", "KernelMode", "causal_edges"]

_WORKER_PREFIX = "colibri-expert"
SPLIT_MIN_MACS = 1 << 23
#: How long a thread waiting for the other parts of a split expert polls before it sleeps (us).
POLL_US = 2000.0
KernelMode = Literal["exact", "fast-int8"]
#: One-call SwiGLU weights: the exact int4 kernel's, or (fast-int8) the int8 kernel's.
Fused = tuple[
    tuple[Int4Weight, Int4Weight, Int4Weight] | None,
    tuple[Q8Weight, Q8Weight, Q8Weight] | None,
]
KERNEL_MODES: tuple[KernelMode, ...] = ("exact", "fast-int8")

F32Array = npt.NDArray[np.float32]
I64Array = npt.NDArray[np.int64]
R = TypeVar("R")
S = TypeVar("S")


class _MLPJobs(NamedTuple):
    """An MLP's crew job templates (:func:`runtime.crew.mlp_templates`)."""

    first: npt.NDArray[np.int64]  # activation feature ranges
    second: npt.NDArray[np.int64]  # output feature ranges
    n_f: int  # intermediate features


class _Many(NamedTuple):
    """``crew_linears``' arguments after ``x`` for weights of one input (``_many_jobs``)."""

    template: npt.NDArray[np.int64]  # [P, WIDTH] every weight's jobs
    job_out: npt.NDArray[np.int64]  # [P] each job's weight
    job_at: npt.NDArray[np.int64]  # [P] its first feature
    out_at: npt.NDArray[np.int64]  # [M] each weight's first column in the sum
    n_outs: npt.NDArray[np.int64]  # [M] its features
    nb: int  # packed bytes per row
    q8: bool  # the fast-int8 kernels' jobs


class _Stacked(NamedTuple):
    """A layer's routed experts' crew job templates stacked by expert id (``crew_moe``)."""

    first: npt.NDArray[np.int64]  # [E, P, WIDTH]
    second: npt.NDArray[np.int64]  # [E, P', WIDTH]
    n_f: npt.NDArray[np.int64]  # [E]


#: "no shared expert" as ``crew_moe`` takes it
_NO_MLP = _MLPJobs(np.zeros((0, WIDTH), np.int64), np.zeros((0, WIDTH), np.int64), 0)
#: "no routed expert" as ``crew_moe`` takes it: templates [0, 0, WIDTH], sizes [0]
_NO_EXPERTS = np.zeros((0, 0, WIDTH), np.int64)
_NO_NF = np.zeros(0, np.int64)
_NO_MASK = np.zeros(0, np.uint8)  # every key (the attention kernel only reads a mask)


class _Pool(ThreadPoolExecutor):
    """The compute pool; each submission first sends the crew's polling workers to sleep
    (``rest``): a pool job is Python, and a worker polling for crew runs would hold the CPU
    it needs (prefill on two vCPUs: a 64-token chunk 15% slower with both at once)."""

    def __init__(self, threads: int, rest: Callable[[], None] | None) -> None:
        super().__init__(threads, thread_name_prefix=_WORKER_PREFIX)
        self._rest = rest

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Future[R]:
        if self._rest is not None:
            self._rest()
        return super().submit(fn, *args, **kwargs)


def causal_edges(
    n_rows: int, keys: int, per_row: int, per_key: int, parts: int
) -> npt.NDArray[np.int64]:
    """``parts + 1`` ascending row edges from 0 to ``n_rows`` that split the last ``n_rows``
    queries over ``keys`` causal keys into ranges of about equal work: row ``i`` costs
    ``per_row + per_key * (keys - n_rows + i + 1)``."""
    seen = keys - n_rows + 1 + np.arange(n_rows, dtype=np.int64)  # keys row i sees
    work = np.cumsum(per_row + per_key * seen)  # [n_rows]
    targets = work[-1] * np.arange(1, parts, dtype=np.int64) // parts
    inner = np.searchsorted(work, targets, side="left") + 1
    edges = np.concatenate([[0], np.clip(inner, 1, n_rows), [n_rows]]).astype(np.int64)
    return np.maximum.accumulate(edges)


class ExpertCompute:
    """Thread pool + matmul choice for routed experts (and the fast path for dense MLPs)."""

    def __init__(
        self,
        threads: int = 1,
        *,
        fast_min_rows: int = 0,
        parallel_min_macs: int = 1 << 24,
        share: ExpertCompute | None = None,
        kernels: KernelMode = "exact",
        crew: bool = True,
    ) -> None:
        """``share``: use that instance's thread pool and crew (which it keeps owning) instead
        of starting them; ``threads`` and ``crew`` are then ignored. ``kernels``: see the
        module docstring. ``crew``: with ``threads > 1``, also start a job crew
        (:mod:`runtime.crew`) for the exact int4 / int8 matmuls of small steps."""
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {kernels!r}")
        self.kernels: KernelMode = kernels
        self.fast_int8 = kernels == "fast-int8"
        self.parallel_min_macs = parallel_min_macs
        # A one-token matmul splits its output features over the pool from this size (below,
        # the hand-off costs more than the second core saves: measured ~8M multiply-adds).
        self.split_min_macs = min(parallel_min_macs, SPLIT_MIN_MACS)
        self.fast_min_rows = max(0, fast_min_rows)
        self._owns_pool = share is None
        self.threads: int
        self._pool: ThreadPoolExecutor | None
        self._poll_iters: int
        self._crew: Crew | None
        self.crew_min_macs = CREW_MIN_MACS
        # per weight, its crew job templates (made at its first crew call; not in the weight,
        # whose resident size they would change)
        self._crew_kept: weakref.WeakKeyDictionary[object, dict[Any, Any]]
        # per resident expert source, its layers' stacked templates (:meth:`_crew_layer`)
        self._crew_layers: weakref.WeakKeyDictionary[ResidentExperts, dict[Any, Any]]
        if share is not None:
            self.threads = share.threads
            self._pool = share._pool
            self._poll_iters = share._poll_iters
            self._crew = share._crew
            self._crew_kept = share._crew_kept
            self._crew_layers = share._crew_layers
        else:
            self._crew_kept = weakref.WeakKeyDictionary()
            self._crew_layers = weakref.WeakKeyDictionary()
            self.threads = threads
            per_us = iterations_per_us() if threads > 1 else 0.0
            self._poll_iters = int(POLL_US * per_us)
            self._crew = (
                Crew(threads - 1, self._poll_iters, per_us) if threads > 1 and crew else None
            )
            self._pool = (
                _Pool(threads, self._crew.rest if self._crew is not None else None)
                if threads > 1
                else None
            )
        self._scratch = threading.local()  # per worker thread: one dequantized projection
        # per thread: True while the compute thread runs its share of a step's jobs (it then
        # splits nothing over the pool, like a worker)
        self._sharing = threading.local()
        self._lock = threading.Lock()
        self.fast_calls = 0  # projections computed by dequantize + BLAS
        self.parallel_steps = 0  # MoE steps spread over the pool
        self.split_calls = 0  # matmuls whose output features were split over the pool
        self.split_experts = 0  # routed experts computed in parts by several threads
        self.early_experts = 0  # ... of them, begun before their down projection landed
        self.layer_calls = 0  # steps whose routed experts ran as one kernel call (routed_layer)

    def close(self) -> None:
        """Stop the pool (when this instance started it); later steps run serially."""
        if self._pool is not None and self._owns_pool:
            self._pool.shutdown(wait=True)
        if self._crew is not None and self._owns_pool:
            self._crew.close()
        self._pool = None
        self._crew = None

    # ------------------------------------------------------------------ matmul choice
    def mm(self, lin: Linear, x: F32Array, q8: Q8Input | None = None) -> F32Array:
        """``lin(x)`` with this compute's kernels, on the calling thread (``q8``: ``x`` already
        rounded for the fast-int8 kernels)."""
        return lin(x, fast_int8=self.fast_int8, q8=q8)

    def _q8(self, lin: Linear, x: F32Array) -> Q8Input | None:
        """``x`` rounded once for fast-int8 (None when ``lin`` takes the exact kernel)."""
        if not self.fast_int8 or not lin.has_int8:
            return None
        return q8_input(x)

    def _mlp_mm(self, split: bool) -> Callable[[Linear, F32Array], F32Array]:
        """The matmul one ``swiglu`` call uses (:meth:`linear` when ``split``, else :meth:`mm`).
        Under fast-int8 it rounds an input once for every weight that takes it (the gate and
        up projections): it keeps the rounding of the last ``x`` by identity, which is safe
        only within that one call, where ``x`` does not change."""
        call = self.linear if split else self.mm
        if not self.fast_int8:
            return call
        kept: list[tuple[F32Array, Q8Input | None]] = []

        def mm(lin: Linear, x: F32Array) -> F32Array:
            if not kept or kept[0][0] is not x:
                kept[:] = [(x, self._q8(lin, x))]
            return call(lin, x, kept[0][1])

        return mm

    def _dense(self, lin: Linear, x: F32Array) -> F32Array:
        """``x @ W.T`` through a dequantized scratch and BLAS."""
        n = lin.out_features * lin.in_features
        buf: F32Array | None = getattr(self._scratch, "buf", None)
        if buf is None or buf.size < n:
            buf = np.empty(n, dtype=np.float32)
            self._scratch.buf = buf
        w = dequantize(lin.q, buf)  # [O, I]
        y: F32Array = np.matmul(x, w.T)  # [T, O]
        with self._lock:
            self.fast_calls += 1
        return y

    def row_blocks(
        self, n_rows: int, macs_per_row: int, causal: tuple[int, int, int] | None = None
    ) -> list[tuple[int, int]] | None:
        """Row ranges to run on the pool, one per thread, or None when one thread should do it
        (no pool, few rows, or less work than ``parallel_min_macs``). Only for the compute
        thread: a worker must not wait on the pool it runs in.

        ``causal`` = (keys, multiply-adds per row, per key): the rows are the last ``n_rows``
        queries over ``keys`` causal keys (row ``i`` sees ``keys - n_rows + i + 1``), and the
        ranges hold about equal work instead of equal rows (a fresh prompt's last half of the
        rows has three times the keys of its first: it set the pace of the whole step)."""
        if (
            self._pool is None
            or n_rows < 2 * self.threads
            or n_rows * macs_per_row < self.parallel_min_macs
            or self._on_worker()
        ):
            return None
        if causal is None:
            edges = np.linspace(0, n_rows, self.threads + 1).astype(int)
        else:
            edges = causal_edges(n_rows, *causal, self.threads)
        return [(int(a), int(b)) for a, b in itertools.pairwise(edges) if b > a]

    def _on_worker(self) -> bool:
        """Whether this thread is one of the pool's workers, or the compute thread running its
        share of a step's jobs (:meth:`_share`): either must not wait on the pool."""
        return threading.current_thread().name.startswith(_WORKER_PREFIX) or bool(
            getattr(self._sharing, "on", False)
        )

    def _share(self, jobs: Sequence[Callable[[], R]]) -> list[R]:
        """``[job() for job in jobs]`` on this thread and ``threads - 1`` pool workers, each
        taking the next job in order until none is left: one hand-off per worker instead of
        one per job, and this thread computes instead of waiting. A job's error is raised once
        every runner has stopped."""
        assert self._pool is not None
        results: list[Any] = [None] * len(jobs)
        todo = iter(range(len(jobs)))
        lock = threading.Lock()

        def runner() -> None:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                results[i] = jobs[i]()

        helpers = [self._pool.submit(runner) for _ in range(min(self.threads, len(jobs)) - 1)]
        self._sharing.on = True
        try:
            runner()
        finally:
            self._sharing.on = False
            for f in helpers:
                # a worker that has not begun would find no job left: it is not waited for
                # (on a busy CPU it may be scheduled long after this thread did every job)
                if not f.cancel():
                    f.result()
        return results

    def _part_jobs(self, parts: SplitExpert) -> list[Callable[[], None]]:
        """:meth:`_share` jobs computing ``parts``: the activation ranges, then the output
        ranges, each of which first waits for every activation range. Runners take jobs in
        order and finish what they took, so the wait always ends (a failed range counts as
        finished; its error is what the step raises)."""
        n_h = len(parts.f_edges) - 1
        ready = Countdown(n_h, self._poll_iters)

        def h(i: int) -> None:
            ok = False
            try:
                parts.h_part(i)
                ok = True
            finally:
                ready.tick(ok)

        def out(i: int) -> None:
            ready.wait()
            if not ready.failed:
                parts.out_part(i)

        with self._lock:
            self.split_experts += 1
        jobs: list[Callable[[], None]] = [functools.partial(h, i) for i in range(n_h)]
        jobs += [functools.partial(out, i) for i in range(len(parts.d_edges) - 1)]
        return jobs

    def _parts_here(
        self, fn: Callable[[int, MLPWeights], R], split: Callable[[int, MLPWeights], Any]
    ) -> Callable[[int, MLPWeights], R]:
        """``fn`` for ``map_arrivals``: on a worker as it is; on the compute thread (the step's
        last arrival, which a source computes there once every other expert is done) in parts
        on every thread when ``split`` gives them, instead of on one thread while the others
        idle. The same result either way."""

        def run(e: int, w: MLPWeights) -> R:
            parts = None if self._on_worker() else split(e, w)
            if parts is None:
                return fn(e, w)
            self._share(self._part_jobs(parts))
            got: R = parts.result()
            return got

        return run

    def _early(
        self, split: Callable[[int, MLPWeights], SplitExpert | None]
    ) -> Callable[[int, MLPWeights], Callable[[], Any] | None]:
        """``early`` for ``map_arrivals``: given an expert whose gate and up projections
        landed (its down projection not yet), compute its activation ranges on every thread
        now and return what computes its output ranges once the rest landed: with the ranges
        of :meth:`_part_jobs`, so the result is :meth:`_parts_here`'s, bit for bit. None
        when ``split`` gives no parts."""

        def start(e: int, w: MLPWeights) -> Callable[[], Any] | None:
            parts = split(e, w)
            if parts is None:
                return None
            with self._lock:
                self.split_experts += 1
                self.early_experts += 1
            n_h, n_d = len(parts.f_edges) - 1, len(parts.d_edges) - 1
            self._share([functools.partial(parts.h_part, i) for i in range(n_h)])

            def finish() -> Any:
                self._share([functools.partial(parts.out_part, i) for i in range(n_d)])
                return parts.result()

            return finish

        return start

    def map_rows(self, blocks: Sequence[tuple[int, int]], fn: Callable[[int, int], R]) -> list[R]:
        """``[fn(a, b) for each block]`` on this thread and the pool (:meth:`_share`), in block
        order."""
        return self._share([functools.partial(fn, a, b) for a, b in blocks])

    def _splits(self, lin: Linear, n_rows: int) -> bool:
        """Whether :meth:`linear` splits ``lin``'s output features over the pool for
        ``n_rows`` rows."""
        return not (
            self._pool is None
            or n_rows * lin.in_features * lin.out_features < self.split_min_macs
            or lin.out_features < 64 * self.threads
            or self._on_worker()
        )

    def linear(self, lin: Linear, x: F32Array, q8: Q8Input | None = None) -> F32Array:
        """``x @ W.T`` [T, O]; for a few rows of a big weight (one token through ``lm_head``, a
        shared expert, a dense layer) the output features are split over the pool, one range
        per thread. Bit-identical to ``lin(x)``: every output feature is computed by the same
        kernel code from the same row (:meth:`runtime.linear.Linear.split`). Under fast-int8
        the ranges share one rounding of ``x`` (``q8``, made here when not given)."""
        if q8 is None:
            got = self._crew_linear(lin, x)
            if got is not None:
                return got
        pool = self._pool
        if pool is None or not self._splits(lin, x.shape[0]):
            return self.mm(lin, x, q8)
        xx = np.ascontiguousarray(x, dtype=np.float32)
        if q8 is None:
            q8 = self._q8(lin, xx)
        first, *rest = lin.split(self.threads)
        futures = [pool.submit(self.mm, part, xx, q8) for _, _, part in rest]
        head = self.mm(first[2], xx, q8)  # this thread computes the first range meanwhile
        with self._lock:
            self.split_calls += 1
        return np.concatenate([head, *(f.result() for f in futures)], axis=1)  # [T, O]

    def swiglu(self, x: F32Array, w: MLPWeights) -> F32Array:
        """``down(silu(gate(x)) * up(x))`` [T, D]; BLAS when fast and ``T >= fast_min_rows``,
        else the exact kernels, with the rows split over the pool when that pays, or, for a few
        rows, each projection's output features (bit-identical either way: the kernels are
        batch-invariant, a row's result does not depend on the other rows, and an output
        feature does not depend on the others)."""
        got = self._crew_swiglu(x, w)
        if got is not None:
            return got
        f = self._fused_for(w, x.shape[0])
        if f is not None:  # int4: one fused kernel call
            return swiglu_q8(x, f[1]) if f[1] is not None else swiglu(x, w)
        if not self.fast_min_rows or x.shape[0] < self.fast_min_rows:
            blocks = self.row_blocks(x.shape[0], 3 * w.gate.in_features * w.gate.out_features)
            if blocks is None:
                return swiglu(x, w, self._mlp_mm(split=self._pool is not None))
            xx = np.ascontiguousarray(x, dtype=np.float32)
            mm = self._mlp_mm(split=False) if self.fast_int8 else None
            return np.concatenate(self.map_rows(blocks, lambda a, b: swiglu(xx[a:b], w, mm)))
        return swiglu(np.ascontiguousarray(x, dtype=np.float32), w, self._dense)  # [T, D]

    def expert_output(
        self, x: F32Array, ids: npt.NDArray[np.int64], gates: F32Array, e: int, w: MLPWeights
    ) -> tuple[npt.NDArray[np.intp], F32Array]:
        """Expert ``e`` on the rows routed to it: (rows [n], gate-weighted output [n, D]).
        An int4 expert that :meth:`swiglu` would compute in one fused call for all ``T`` rows
        (so for any ``n <= T`` of them) is one kernel call with the row selection, the gather
        and the gate product in it: the same bits."""
        f = self._fused_for(w, x.shape[0])
        if f is not None:
            if f[1] is not None:
                return routed_expert_int4_q8(x, ids, gates, e, *f[1])
            assert f[0] is not None
            return routed_expert_int4(x, ids, gates, e, *f[0])
        return moe_ops.expert_output(x, ids, gates, e, w, self.swiglu)

    def routed_layer(
        self,
        source: ExpertSource,
        layer: int,
        x: F32Array,
        ids: npt.NDArray[np.int64],
        gates: F32Array,
        macs: int,
    ) -> F32Array | None:
        """The routed experts of a step in one kernel call (``routed_layer_int4``: each
        expert's rows through the exact int4 kernels, summed per row in ascending expert id:
        the bits of :meth:`expert_output` per expert and ``moe.combine``), when the step would
        run serially (no pool, or ``macs`` below ``parallel_min_macs``) on the exact kernels
        and every expert of the layer is resident int4; else None (the step runs expert by
        expert). Saves the per-expert Python of small steps: a batched decode step of the
        demo model routes ~18 experts per layer."""
        if (
            not isinstance(source, ResidentExperts)
            or self.fast_int8
            or (self._pool is not None and macs >= self.parallel_min_macs)
            or (self.fast_min_rows and x.shape[0] >= self.fast_min_rows)
        ):
            return None
        table = source.int4_layer(layer)
        if table is None:
            return None
        with self._lock:
            self.layer_calls += 1
        return routed_layer_int4(x, ids, gates, table)

    def split_expert(
        self, x: F32Array, ids: npt.NDArray[np.int64], gates: F32Array, e: int, w: MLPWeights
    ) -> SplitExpert | None:
        """:meth:`expert_output` in parts for every thread of the pool (the same bits), or None
        when it is not one exact int4 kernel call (see :meth:`_fused_for`) or there is no
        pool."""
        if self._pool is None:
            return None
        f = self._fused_for(w, x.shape[0], in_job=True)
        if f is None or f[0] is None:
            return None
        return SplitExpert(x, ids, gates, e, *f[0], self.threads)

    def _fused_for(self, w: MLPWeights, n_rows: int, *, in_job: bool = False) -> Fused | None:
        """How :meth:`swiglu` runs ``n_rows`` rows (or fewer) of ``w`` as one kernel call on
        this thread (``in_job``: as a job of a step on the pool would, where nothing splits):
        (``fused(w)``, None) with the exact kernels, (None, ``fused_q8(w)``) under fast-int8
        when all three projections have the int8 kernel. None when it does not: another
        format, the BLAS path, rows split over the pool or a projection's features split."""
        if self.fast_min_rows and n_rows >= self.fast_min_rows:
            return None
        if not in_job:
            macs = 3 * w.gate.in_features * w.gate.out_features
            if self.row_blocks(n_rows, macs) is not None:
                return None
            if any(self._splits(lin, n_rows) for lin in w):
                return None
        if self.fast_int8:
            q = fused_q8(w)
            return None if q is None else (None, q)
        f = fused(w)
        return None if f is None else (f, None)

    # ------------------------------------------------------------------ the job crew
    def _crew_for(self, n_rows: int, macs: int) -> Crew | None:
        """The crew when a matmul of ``macs`` multiply-adds on ``n_rows`` rows runs on it:
        exact kernels, not on a pool worker, enough work, not the BLAS path's rows, and the
        crew not standing aside (its workers kept off their CPUs, :meth:`Crew.usable`)."""
        crew = self._crew
        if (
            crew is None
            or macs < self.crew_min_macs
            or not crew.usable()
            or (self.fast_min_rows and n_rows >= self.fast_min_rows)
            or self._on_worker()
        ):
            return None
        return crew

    def _kept(self, lin: object) -> dict[Any, Any]:
        """What the crew keeps for ``lin`` (its job templates), dropped with ``lin``."""
        got = self._crew_kept.get(lin)
        if got is None:
            got = self._crew_kept[lin] = {}
        return got

    def router_logits(self, lin: Linear, x: F32Array) -> F32Array:
        """A MoE router's logits ``lin(x)`` [T, E]: on the crew where it takes the matmul
        (GLM-5's float32 [256, 6144] router, 6.3 MB a layer, read from DRAM on one thread
        took ~0.45 ms of every MoE layer's step), else the call itself. The same bits either
        way; never the pool or BLAS, whose hand-off or rounding a router does not pay for."""
        got = self._crew_linear(lin, x)
        return got if got is not None else lin(x)

    def _crew_linear(self, lin: Linear, x: F32Array) -> F32Array | None:
        """:meth:`linear` as one crew run of output-feature ranges (int4 with the fused
        kernel's walk, int8 on 16 lanes, float32), or None where the crew does not take it.
        The same bits: each feature is computed by the same kernel code from the same row."""
        n_tok, n_out = x.shape[0], lin.out_features
        crew = self._crew_for(n_tok, n_tok * lin.in_features * n_out)
        if crew is None or n_tok == 0:
            return None
        if lin.int4 is not None:
            got = self._crew_linears(crew, (lin,), x)
            return None if got is None else got[0]
        jobs = _linear_jobs(lin, 2 * self.threads, self._kept(lin))
        if jobs is None:
            return None
        _, template, starts = jobs
        xx = np.ascontiguousarray(x, dtype=np.float32)
        buf = np.empty(n_tok * n_out, np.float32)  # range by range, each [T, b - a]
        table = template.copy()
        prepared = f32_prepared if lin.q.fmt.kind == "f32" else i8_prepared
        xp = prepared(xx, lin.in_features)
        table[:, 1] = addr(xp)
        table[:, 2] = n_tok
        table[:, 3] = xp.size // n_tok
        table[:, 8] = addr(buf) + starts * (4 * n_tok)
        crew.run(table, judged=n_tok == 1)
        with self._lock:
            self.split_calls += 1
        if n_tok == 1:
            return buf.reshape(1, n_out)
        edges = [*starts.tolist(), n_out]
        return np.concatenate(
            [
                buf[n_tok * a : n_tok * b].reshape(n_tok, b - a)
                for a, b in itertools.pairwise(edges)
            ],
            axis=1,
        )

    def linears(self, lins: Sequence[Linear], x: F32Array) -> list[F32Array]:
        """``[lin(x) for lin in lins]``: int4 weights of the same input width in one crew run
        (one preparation of ``x``, every weight's feature ranges in one table: the attention's
        ``q_a_proj`` and ``kv_a_proj_with_mqa``), else one :meth:`linear` each. The same bits
        either way."""
        n_tok = x.shape[0]
        macs = n_tok * sum(lin.in_features * lin.out_features for lin in lins)
        crew = self._crew_for(n_tok, macs) if len(lins) > 1 else None
        if crew is not None and n_tok:
            got = self._crew_linears(crew, lins, x)
            if got is not None:
                return got
        return [self.linear(lin, x) for lin in lins]

    def lora(
        self, q_a: Linear, kv_a: Linear, norm_w: F32Array, eps: float, q_b: Linear, x: F32Array
    ) -> tuple[F32Array, F32Array, F32Array] | None:
        """``q_resid = rms_norm(q_a(x), norm_w, eps)``, ``kv_a(x)`` and ``q_b(q_resid)`` (an MLA
        projection's matmuls) in one numba call of two crew runs (``crew_lora``), or None
        where the crew does not take them. The bits of the calls one by one."""
        n_tok = x.shape[0]
        macs = n_tok * sum(lin.in_features * lin.out_features for lin in (q_a, kv_a, q_b))
        crew = self._crew_for(n_tok, macs)
        if (
            crew is None
            or not n_tok
            or norm_w.dtype != np.float32
            or norm_w.shape != (q_a.out_features,)
        ):
            return None
        first = self._many(crew, (q_a, kv_a))
        second = self._many(crew, (q_b,))
        if first is None or second is None:
            return None
        got = crew.call(
            crew_lora, 2, np.ascontiguousarray(x, dtype=np.float32), tuple(first), norm_w,
            np.float32(eps), tuple(second), judged=n_tok == 1,
        )  # fmt: skip
        with self._lock:
            self.split_calls += 2
        q_resid, kv, q = got
        return q_resid, kv, q

    def _crew_linears(
        self, crew: Crew, lins: Sequence[Linear], x: F32Array
    ) -> list[F32Array] | None:
        """:meth:`linears` on the crew (``crew_linears``), or None where it does not take
        them (not all int4 of one packed row width, too few features; under fast-int8, some
        with the int8-activation kernel and some without)."""
        jobs = self._many(crew, lins)
        if jobs is None:
            return None
        n_tok = x.shape[0]
        flat = crew.call(
            crew_linears, 1, np.ascontiguousarray(x, dtype=np.float32), *jobs,
            judged=n_tok == 1,
        )  # fmt: skip
        with self._lock:
            self.split_calls += 1
        return [
            flat[n_tok * a : n_tok * (a + o)].reshape(n_tok, o)
            for a, o in zip(jobs.out_at.tolist(), jobs.n_outs.tolist(), strict=True)
        ]

    def _many(self, crew: Crew, lins: Sequence[Linear]) -> _Many | None:
        """``_many_jobs`` of ``lins`` for this compute's threads and kernels, made once (kept
        with the first weight)."""
        many = self._kept(lins[0]).setdefault("many", {})
        key = (len(lins), self.threads, self.fast_int8)
        got = many.get(key)
        if got is None or any(a is not b for a, b in zip(got[0], lins, strict=True)):
            kept_each = [self._kept(lin) for lin in lins]
            got = (tuple(lins), _many_jobs(lins, 2 * self.threads, kept_each, self.fast_int8))
            many[key] = got
        jobs: _Many | None = got[1]
        return jobs

    def _crew_swiglu(self, x: F32Array, w: MLPWeights) -> F32Array | None:
        """:meth:`swiglu` as two crew runs (activation feature ranges, then output feature
        ranges) for int4 projections (under fast-int8, with the int8-activation kernels), or
        None where the crew does not take it."""
        n_tok = x.shape[0]
        crew = self._crew_for(n_tok, 3 * n_tok * w.gate.in_features * w.gate.out_features)
        if crew is None or n_tok == 0:
            return None
        jobs = self._mlp_jobs(w)
        if jobs is None:
            return None
        # the crew's MoE step with no routed expert and ``w`` as the shared one
        _, out = crew.call(
            crew_moe, 2, np.ascontiguousarray(x, dtype=np.float32),
            np.zeros((n_tok, 0), np.int64), np.zeros((n_tok, 0), np.float32),
            _NO_EXPERTS, _NO_EXPERTS, jobs.first, jobs.second, _NO_NF, jobs.n_f,
            self.fast_int8, judged=n_tok == 1,
        )  # fmt: skip
        out_: F32Array = out
        return out_

    def crew_step(
        self,
        source: ExpertSource,
        layer: int,
        x: F32Array,
        ids: npt.NDArray[np.int64],
        gates: F32Array,
        shared: MLPWeights | None,
        macs: int,
    ) -> tuple[F32Array, F32Array | None] | None:
        """A MoE step over resident int4 experts on the crew: (the routed experts' outputs
        summed per row in ascending expert id [T, D], as ``moe.combine`` sums
        :meth:`expert_output`'s, and the ``shared`` expert's output, None when there is
        none), the same bits (under fast-int8, those of its kernels); None where the crew
        does not take the step (streamed experts, another format, a small step)."""
        if not isinstance(source, ResidentExperts):
            return None
        crew = self._crew_for(x.shape[0], macs)
        if crew is None:
            return None
        # many experts (a prefill chunk): the pool's whole-expert jobs (each gathers its own
        # rows on its thread) were 3-5% faster than two runs of ranges here, whose gather and
        # sum run on this thread alone
        most = 4 * self.threads - (shared is not None)
        if ids.size >= most and len(set(ids.ravel().tolist())) >= most:
            return None
        stacked = self._crew_layer(source, layer)
        s_jobs = None if shared is None else self._mlp_jobs(shared)
        if stacked is None or (shared is not None and s_jobs is None):
            return None
        first, second, n_f = stacked
        if s_jobs is None:
            s_jobs = _NO_MLP
        routed, side = crew.call(
            crew_moe, 2,
            np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(ids, np.int64),
            np.ascontiguousarray(gates, dtype=np.float32), first, second, s_jobs.first,
            s_jobs.second, n_f, s_jobs.n_f, self.fast_int8, judged=x.shape[0] == 1,
        )  # fmt: skip
        with self._lock:
            self.parallel_steps += 1
        return routed, (side if shared is not None else None)

    def mla_heads(
        self,
        uk: HeadsMatmul,
        uv: HeadsMatmul | None,
        o_proj: Linear,
        q_nope: F32Array,
        q_rope: F32Array,
        latent: F32Array,
        k_rope: F32Array,
        allowed: npt.NDArray[np.bool_] | None,
        scale: float,
    ) -> F32Array | None:
        """Absorbed MLA attention of one query row (``q_nope`` [1, NH, N], ``q_rope`` [1, NH,
        R]) over its keys (``latent`` [S, C], ``k_rope`` [S, R], ``allowed`` [1, S] or None:
        all), through ``W_UK`` (``uk``), ``W_UV`` (``uv``) and ``o_proj`` (its bias left to
        the caller): [1, D], its head ranges on the crew and then ``o_proj``'s feature ranges
        (one numba call, ``crew_heads_out``), or None where the crew does not take it (several
        rows, per-head weights, too little work). Every head's the bits of
        ``absorb_queries``, ``latent_attention`` and ``unabsorb_values`` (the same kernels run
        on it, ``_job_mla_heads``), the projection's those of :meth:`linear`."""
        if (
            q_nope.shape[0] != 1
            or uv is None
            or uk.kind not in ("axpy", "axpy_int4")
            or uv.kind != "int4"
            or uk.spec[0] < 8
        ):
            return None
        nh, n, c = uk.spec[:3]
        v = uv.spec[3]
        s_all, r = latent.shape[0], k_rope.shape[1]
        crew = self._crew_for(1, nh * (n * c + s_all * (2 * c + r) + c * v))
        if crew is None:
            return None
        kept = self._kept(uk)
        got = kept.get("heads")
        if got is None or got[0] is not uv:
            got = kept["heads"] = (uv, heads_template(uk, uv, 2 * self.threads))
        if got[1] is None:  # (an int4 W_UK the job cannot read with W_UV's walk)
            return None
        qn = np.ascontiguousarray(q_nope, dtype=np.float32)
        qr = np.ascontiguousarray(q_rope, dtype=np.float32)
        lat = np.ascontiguousarray(latent, dtype=np.float32)
        kr = np.ascontiguousarray(k_rope, dtype=np.float32)
        mask = _NO_MASK if allowed is None else np.ascontiguousarray(allowed[0]).view(np.uint8)
        q_lat = np.empty(nh * c, np.float32)
        o_lat = np.empty(nh * c, np.float32)
        out = np.empty((1, nh * v), np.float32)
        # (filled in one numba call: a dozen column stores and address lookups from Python
        # took ~20 us of every decode layer)
        table = heads_table(
            got[1], qn, qr, lat, kr, mask, int(np.float32(scale).view(np.uint32)), q_lat, o_lat,
            out,
        )  # fmt: skip
        o_jobs = self._many(crew, (o_proj,))
        if o_jobs is None:
            crew.run(table)
            return self.linear(o_proj, out)
        y = crew.call(crew_heads_out, 2, table, out, *o_jobs)
        with self._lock:
            self.split_calls += 1
        got_y: F32Array = y.reshape(1, -1)
        return got_y

    def _mlp_jobs(self, w: MLPWeights) -> _MLPJobs | None:
        return _mlp_jobs(w, self.threads, self._kept(w.gate), self.fast_int8)

    def _crew_layer(self, source: ResidentExperts, layer: int) -> _Stacked | None:
        """Every routed expert of ``layer`` as the crew's MoE step takes them (their job
        templates stacked by expert id, and their intermediate sizes), made on first use and
        kept while ``source`` lives; None when an expert is missing or has no crew jobs."""
        kept = self._crew_layers.get(source)
        if kept is None:
            kept = self._crew_layers[source] = {}
        key = (layer, self.threads, self.fast_int8)
        if key not in kept:
            found = source.layer_experts(layer)
            jobs = [] if found is None else [self._mlp_jobs(w) for w in found]
            got = None
            if jobs and all(j is not None for j in jobs):
                firsts = [j.first for j in jobs if j is not None]
                seconds = [j.second for j in jobs if j is not None]
                if len({a.shape for a in firsts}) == 1 and len({a.shape for a in seconds}) == 1:
                    got = _Stacked(
                        np.stack(firsts),
                        np.stack(seconds),
                        np.asarray([j.n_f for j in jobs if j is not None], np.int64),
                    )
            kept[key] = got
        out: _Stacked | None = kept[key]
        return out

    # ------------------------------------------------------------------ scheduling
    @contextlib.contextmanager
    def _blas_single(self) -> Iterator[None]:
        """Workers each run single-threaded BLAS (the pool is the parallelism)."""
        if not self.fast_min_rows:
            yield
            return
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1, user_api="blas"):
            yield

    def run(
        self,
        source: ExpertSource,
        layer: int,
        experts: Sequence[int],
        fn: Callable[[int, MLPWeights], R],
        macs: int,
        guess: Guess | None = None,
    ) -> dict[int, R]:
        """``{e: fn(e, weights_e)}`` for every expert of the step, as they arrive from
        ``source``; on the pool when there is one and the step has ``macs >= parallel_min_macs``
        multiply-adds (``source.map_arrivals``), else serially in arrival order. ``guess``: a
        prediction of a later layer's experts whose reads queue behind the step's own (see
        :meth:`run_step`)."""
        return self.run_step(source, layer, experts, fn, macs, guess, None)[0]

    def run_step(
        self,
        source: ExpertSource,
        layer: int,
        experts: Sequence[int],
        fn: Callable[[int, MLPWeights], R],
        macs: int,
        guess: Guess | None,
        side: Callable[[], S] | None,
        split: Callable[[int, MLPWeights], SplitExpert | None] | None = None,
    ) -> tuple[dict[int, R], S | None]:
        """:meth:`run`, plus ``side`` (the shared expert: work that needs no routed expert)
        computed while the step's reads are in flight rather than after its last arrival: on a
        worker once the step's first read is on the device (``started``), or serially right
        after the first expert. Returns the outputs
        and ``side()``'s result (None without ``side``).

        ``guess``: the next layer's prediction, not made yet. On the pool it is made on a
        worker once the step's reads are queued (``source.map_arrivals``), so its router is off
        the path that decides when the step's first read starts; serially it is made here
        first and goes to ``source.arrivals`` with the step.

        ``split``: an expert in parts (:meth:`split_expert` with the step's rows: the parts
        give ``fn``'s result, bit for bit). When every expert is resident and the jobs do not
        divide evenly over the threads, the last expert runs in parts on all of them, so no
        thread idles through a whole expert at the step's end; when experts stream in, so does
        the last arrival (:meth:`_parts_here`), which may begin with its gate and up
        projections while its down projection is still being read (:meth:`_early`)."""
        if self._pool is None or macs < self.parallel_min_macs:
            out: dict[int, R] = {}
            extra: S | None = None
            lookahead = guess() if guess is not None else None
            for e, w in source.arrivals(layer, experts, lookahead):
                out[e] = fn(e, w)
                if side is not None and len(out) == 1:
                    extra = side()
            return out, extra
        with self._lock:
            self.parallel_steps += 1
        with self._blas_single():
            if isinstance(source, ResidentExperts):  # every weight here: jobs, no arrivals
                ws = list(source.get(layer, experts).items())
                jobs: list[Callable[[], Any]] = [side] if side is not None else []
                jobs += [functools.partial(fn, e, w) for e, w in ws]
                parts = None
                if split is not None and ws and len(jobs) % self.threads:
                    parts = split(*ws[-1])
                if parts is None:
                    got = self._share(jobs)
                else:  # the last expert's job becomes its parts' jobs
                    whole = jobs[:-1]
                    got = self._share(whole + self._part_jobs(parts))[: len(whole)]
                    got.append(parts.result())
                routed = got[1:] if side is not None else got
                return dict(zip([e for e, _ in ws], routed, strict=True)), (
                    got[0] if side is not None else None
                )
            pool = self._pool
            side_job: list[Future[S]] = []

            def started() -> None:
                # A worker busy from the step's start can hold up the event loop sending the
                # step's first read (the scheduler may queue the loop behind it on the same
                # CPU: 2.4 ms, a shared expert's length, in a quarter of the steps measured on
                # the 2-vCPU guest): the side job goes once that read is on the device.
                if side is not None:
                    side_job.append(pool.submit(side))

            try:
                if split is None:
                    out = source.map_arrivals(layer, experts, fn, pool, guess, started=started)
                else:
                    run, early = self._parts_here(fn, split), self._early(split)
                    out = source.map_arrivals(
                        layer, experts, run, pool, guess, early, started=started
                    )
            finally:
                extra = side_job[0].result() if side_job else None
            assert side is None or side_job  # every source calls ``started`` once
            return out, extra

    @property
    def crew_runs(self) -> int:
        """Tables of jobs run on the job crew (0 without one)."""
        return self._crew.runs if self._crew is not None else 0

    @property
    def crew_stood_aside(self) -> int:
        """Times the crew stood aside for its workers' CPUs being taken (:meth:`Crew.usable`)."""
        return self._crew.contended if self._crew is not None else 0

    def as_dict(self) -> dict[str, int | str]:
        return {
            "threads": self.threads,
            "fast_min_rows": self.fast_min_rows,
            "fast_calls": self.fast_calls,
            "parallel_steps": self.parallel_steps,
            "split_calls": self.split_calls,
            "split_experts": self.split_experts,
            "early_experts": self.early_experts,
            "layer_calls": self.layer_calls,
            "crew_runs": self.crew_runs,
            "crew_stood_aside": self.crew_stood_aside,
            "kernels": self.kernels,
        }


def _int8_rows(lin: Linear, kept: dict[Any, Any]) -> Int8Rows | None:
    """``lin`` as the crew's int8 job takes it (int8 on 16 lanes), or None. Made once (kept
    in ``kept``, what the compute keeps for ``lin``)."""
    if "int8" in kept:
        known: Int8Rows | None = kept["int8"]
        return known
    got = None
    q = lin.q
    if q.fmt.kind == "int8" and lin.lanes == 16 and q.scales is not None:
        data = np.asarray(q.data).reshape(-1).view(np.uint8)
        scales = np.ascontiguousarray(q.scales, dtype=np.float32).reshape(-1)
        if data.flags.c_contiguous and scales.size == lin.out_features:
            got = Int8Rows(data, scales, lin.out_features, lin.in_features)
    kept["int8"] = got
    return got


def _f32_rows(lin: Linear, kept: dict[Any, Any]) -> F32Rows | None:
    """``lin`` as the crew's float32 job takes it, or None (another format, or elements that
    are not one contiguous float32 array: the call itself copies those). Made once (kept in
    ``kept``, with the scale array every template of it points at)."""
    if "f32" in kept:
        known: F32Rows | None = kept["f32"]
        return known
    got = None
    q = lin.q
    data = np.asarray(q.data)
    if q.fmt.kind == "f32" and data.dtype == np.float32 and data.flags.c_contiguous:
        got = F32Rows(data.reshape(-1), lin.out_features, lin.in_features)
    kept["f32"] = got
    return got


def _linear_jobs(
    lin: Linear, parts: int, kept: dict[Any, Any]
) -> tuple[Int4Weight | None, I64Array, I64Array] | None:
    """``lin``'s crew jobs in ``parts`` ranges of output features: (its int4 weight, or None
    for int8 and float32, the jobs' template, each range's first feature), or None where the
    crew does not take ``lin`` (another format, too few features). Made once per ``parts``
    (kept in ``kept``)."""
    cache: dict[int, Any] = kept.setdefault("jobs", {})
    if parts not in cache:
        got: tuple[Int4Weight | None, I64Array, I64Array] | None = None
        edges = edges16(lin.out_features, parts)
        w4 = lin.int4
        w8 = None if w4 is not None else _int8_rows(lin, kept)
        w32 = None if w4 is not None or w8 is not None else _f32_rows(lin, kept)
        if len(edges) >= 3 and w4 is not None:
            got = (w4, i4_rows_template(w4, edges), np.asarray(edges[:-1], np.int64))
        elif len(edges) >= 3 and w8 is not None:
            got = (None, i8_rows_template(w8, edges), np.asarray(edges[:-1], np.int64))
        elif len(edges) >= 3 and w32 is not None:
            got = (None, f32_rows_template(w32, edges), np.asarray(edges[:-1], np.int64))
        cache[parts] = got
    out: tuple[Int4Weight | None, I64Array, I64Array] | None = cache[parts]
    return out


def _many_jobs(
    lins: Sequence[Linear], parts: int, kept: Sequence[dict[Any, Any]], fast_int8: bool = False
) -> _Many | None:
    """``crew_linears``' arguments for ``lins`` of one input width, each in ``parts`` ranges
    with the kernel a call of it takes (under ``fast_int8``, the int8-activation one where
    the weight has it); None where one of them has no int4 jobs, the widths differ, or the
    weights would take different kernels."""
    q8 = fast_int8 and lins[0].has_int8
    if any(fast_int8 and lin.has_int8 != q8 for lin in lins):
        return None
    tables, job_out, job_at = [], [], []
    nbs = set()
    for m, (lin, k) in enumerate(zip(lins, kept, strict=True)):
        if q8:
            w8 = lin.q8
            if w8 is None:
                return None
            edges = edges16(lin.out_features, parts)
            starts = np.asarray(edges[:-1], np.int64)
            template = k.get(("q8", parts))
            if template is None:
                template = k[("q8", parts)] = q8_rows_template(w8, edges)
            nbs.add(lin.in_features)
        else:
            jobs = _linear_jobs(lin, parts, k)
            if jobs is None:
                return None
            w4, template, starts = jobs
            if w4 is None:
                return None
            nbs.add(int(w4.walk[2]))
        tables.append(template)
        job_out += [m] * len(starts)
        job_at += starts.tolist()
    if len(nbs) != 1:
        return None
    n_outs = np.asarray([lin.out_features for lin in lins], np.int64)
    out_at = np.concatenate([[0], np.cumsum(n_outs)[:-1]]).astype(np.int64)
    return _Many(
        np.ascontiguousarray(np.concatenate(tables)),
        np.asarray(job_out, np.int64),
        np.asarray(job_at, np.int64),
        out_at,
        n_outs,
        int(nbs.pop()),
        q8,
    )


def _mlp_jobs(w: MLPWeights, parts: int, kept: dict[Any, Any], q8: bool = False) -> _MLPJobs | None:
    """An int4 MLP's crew jobs (:func:`runtime.crew.mlp_templates`, or with ``q8``
    :func:`runtime.crew.q8_mlp_templates`: in ranges for each phase) and its intermediate
    size, or None where it has no fused kernel of that kind. Made once per ``parts`` (kept
    in ``kept``, what the compute keeps for its gate projection, with the up and down
    projections it was made for)."""
    cache: dict[Any, Any] = kept.setdefault("mlp", {})
    got = cache.get((parts, q8))
    if got is None or got[0] is not w.up or got[1] is not w.down:
        jobs = None
        if q8:
            fq = fused_q8(w)
            if fq is not None:
                jobs = _MLPJobs(*q8_mlp_templates(fq, parts), fq[0].n_out)
        else:
            f = fused(w)
            if f is not None:
                jobs = _MLPJobs(*mlp_templates(f, parts), f[0].walk[0])
        got = (w.up, w.down, jobs)
        cache[(parts, q8)] = got
    out: _MLPJobs | None = got[2]
    return out

"""The token path: one MoE step, and the batcher that gathers steps into forward calls.

Read this file top to bottom to follow a token.

1. :func:`moe_step` is the MoE half of one layer for every row of a call (a decode token, a
   prefill chunk, speculative verify rows, the rows of several sequences at once):
   route -> union -> place -> compute as arrivals land -> combine (+ the shared expert).
2. :class:`Scheduler` owns the compute thread: one forward at a time under its limiter, prefill
   in chunks, and the decode steps of every active generation gathered into one
   ``forward_batch`` (each step contributes one row, or a speculative round's verify rows), so
   each layer reads the union of their experts once; so are the prefill chunks of prompts that
   arrive together (up to ``prefill_chunk`` rows a step). Rows are bit-identical to solo
   decoding and to a prompt prefilled alone.

The model supplies the math (``forward_batch``), the expert source the bytes (resident RAM or the
tiered store on the event loop), :class:`~runtime.context.StepContext` how to compute. The
engine (``colibri/_engine.py``) keeps lifecycle, sampling and the public API.

Shape legend: T rows of the call, D hidden, K experts per token, V vocab.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from runtime.cluster.source import ClusterExperts
from runtime.kv import KVCache
from runtime.layers import moe as moe_ops
from runtime.settle import run_settled, settle, settled
from runtime.speculative.drafts import HeadGen, HeadRows, run_heads
from runtime.weights import Guess, Lookahead
from storage.errors import ColibriError

if TYPE_CHECKING:
    from runtime.context import Observer, StepContext
    from runtime.experts import ExpertStore
    from runtime.kernels.quant_matmul import SplitExpert
    from runtime.layers.moe import MoEWeights
    from runtime.models._decoder import LogitsOut
    from runtime.speculative import SpeculativeDecoder
    from runtime.weights import ExpertSource, ExpertWeights

__all__ = [
    "BatchModel",
    "Scheduler",
    "SchedulerStats",
    "StepRequest",
    "moe_step",
    "next_guess",
    "predict_next",
]

F32Array = npt.NDArray[np.float32]
R = TypeVar("R")


def moe_step(
    ctx: StepContext,
    experts: ExpertSource,
    layer: int,
    moe: MoEWeights,
    x: F32Array,
    expert_macs: int,
    next_moe: MoEWeights | None = None,
) -> F32Array:
    """The MoE half of ``layer`` for rows ``x`` [T, D] (post-attention normed): [T, D].

    1. **Route**: the router picks K experts per row and their gate weights.
    2. **Lookahead**: when the source wants it, layer L+1's router (``next_moe``) applied to
       this layer's state predicts the next layer's experts, on a pool worker while this
       step's reads are in flight (serially: before them); their reads queue behind the
       step's demand reads, most likely first (a hint: it never changes a result).
    3. **Union**: the unique experts over all rows are requested once.
    4. **Place + compute as arrivals land**: the source yields resident experts first, then
       misses as their reads complete; each is applied to its rows (on the compute pool when
       the step is big enough). ``expert_macs`` is one row's multiply-adds per expert.
    5. **Combine**: routed outputs summed per row in ascending expert id, then the shared
       expert, so neither arrival order nor thread count changes a bit.
    """
    t0 = time.perf_counter()
    comp = ctx.compute
    ids, gates = moe_ops.route(moe, x, comp.router_logits)  # [T, K], [T, K]
    ctx.observe("route", layer, ids)
    # made while this step's reads are in flight; its reads queue behind them
    guess = next_guess(experts, layer, next_moe, x)

    def one(e: int, w: ExpertWeights) -> tuple[npt.NDArray[np.intp], F32Array]:
        return comp.expert_output(x, ids, gates, e, w)

    if isinstance(experts, ClusterExperts):
        # Owned by cluster workers: every request out, the shared expert computed while they
        # work, then their outputs (or, for a failed worker, ours) combined in the same order.
        pending = experts.send(layer, moe_ops.union(ids), x, ids, gates)
        t1 = time.perf_counter()
        shared = moe_ops.shared(moe, x, comp.swiglu)
        t2 = time.perf_counter()
        outputs = experts.collect(pending, comp, one, expert_macs)
        routed = moe_ops.combine(x, ids, outputs)
        ctx.timing.moe_s += time.perf_counter() - t0 - (t2 - t1)
        return routed + shared

    def shared_out() -> F32Array:
        return moe_ops.shared(moe, x, comp.swiglu)

    # a small step over resident experts: every routed expert in one kernel call (same bits)
    whole = comp.routed_layer(experts, layer, x, ids, gates, ids.size * expert_macs)
    if whole is not None:
        y = whole + shared_out()
        ctx.timing.moe_s += time.perf_counter() - t0
        return y

    # bigger steps over resident int4 experts: with the shared expert, two runs of the job
    # crew (the same bits)
    crewed = comp.crew_step(experts, layer, x, ids, gates, moe.shared, ids.size * expert_macs)
    if crewed is not None:
        routed, side = crewed
        y = routed + (side if side is not None else shared_out())
        ctx.timing.moe_s += time.perf_counter() - t0
        return y

    def parts(e: int, w: ExpertWeights) -> SplitExpert | None:
        return comp.split_expert(x, ids, gates, e, w)

    # the shared expert is computed while the step's reads are in flight
    outputs, side = comp.run_step(
        experts, layer, moe_ops.union(ids), one, ids.size * expert_macs, guess, shared_out, parts
    )
    routed = moe_ops.combine(x, ids, outputs)
    ctx.timing.moe_s += time.perf_counter() - t0
    assert side is not None
    return routed + side


def predict_next(
    experts: ExpertSource, layer: int, next_moe: MoEWeights | None, x: F32Array
) -> Lookahead | None:
    """Layer L+1's router (``next_moe``) applied to layer L's MLP input ``x`` [T, D]: the
    experts L+1 will probably route to, most likely first; None when there is no MoE layer
    next or the source would not read ahead for it now. A dense layer L calls it too (and
    hands the result to ``experts.prefetch``), so the first MoE layer's reads start while
    the dense layer computes."""
    guess = next_guess(experts, layer, next_moe, x)
    return None if guess is None else guess()


def next_guess(
    experts: ExpertSource, layer: int, next_moe: MoEWeights | None, x: F32Array
) -> Guess | None:
    """:func:`predict_next` not made yet (None when it would not be made): ``moe_step`` hands
    it to the compute, which makes it on a pool worker while the step's reads are in flight.
    The prediction's ``cpu_s`` is its router's time, wherever it ran."""
    if next_moe is None or not experts.wants_lookahead(layer + 1):
        return None

    router = next_moe

    def guess() -> Lookahead:
        t0 = time.perf_counter()
        ranked = moe_ops.ranked_union(*moe_ops.route(router, x))
        return Lookahead(layer + 1, ranked, time.perf_counter() - t0)

    return guess


# ----------------------------------------------------------------------------- the batcher

# How many event-loop turns the batcher waits, without a new request, for the other decoding
# generations to queue their next step (each needs a few turns: wake, sample, hand the token to
# its consumer) before it runs the requests it has.
GATHER_TURNS = 3
# Before a prefill step that has room for more prompts, the batcher waits this share of a
# prefill step's measured mean time (at most PREFILL_WAIT_MAX_S) for other prompts: a
# server's concurrent requests reach the queue milliseconds apart (parsing, admission,
# tokenizing: eight at once spread over 5-50 ms on a 2-vCPU guest), and a prompt that just
# misses a step waits a whole prefill step for the next. Only while other generations decode
# or several prompts are queued: a lone user's prompt never waits.
PREFILL_WAIT_SHARE = 0.05
PREFILL_WAIT_MAX_S = 0.05


@dataclass
class TimeBreakdown:
    """Where the wall time of the forwards went (seconds, summed over calls).

    * ``read_wait_demand_s``: the compute thread waited for an expert a demand read brings;
    * ``read_wait_lookahead_s``: it waited for an expert a lookahead read was already bringing;
    * ``expert_compute_s``: routing and the routed experts (their thread-pool dispatch and the
      hand-back of their buffers included), and the shared experts, which are computed while
      the routed experts' reads are in flight;
    * ``dense_compute_s``: everything else in the forward (attention, dense MLPs, norms,
      LM head, MTP drafts);
    * ``other_s``: getting onto and off the compute thread (event loop, thread hand-off).
    """

    read_wait_demand_s: float = 0.0
    read_wait_lookahead_s: float = 0.0
    expert_compute_s: float = 0.0
    dense_compute_s: float = 0.0
    other_s: float = 0.0

    def minus(self, before: TimeBreakdown) -> TimeBreakdown:
        """The time spent since ``before`` (a copy taken earlier)."""
        return TimeBreakdown(
            *(getattr(self, f.name) - getattr(before, f.name) for f in dataclasses.fields(self))
        )


@dataclass
class SchedulerStats:
    """Compute-side counters since open (``Engine.stats()`` reports them)."""

    forward_calls: int = 0
    compute_seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_chunks: int = 0
    # the forwards that computed them: one step holds the chunks of every prompt queued
    # together (up to ``prefill_chunk`` rows), and its seconds and reads count once
    prefill_steps: int = 0
    prefill_seconds: float = 0.0
    prefill_bytes_read: int = 0
    prefill_expert_reads: int = 0
    decode_batches: int = 0
    # decode steps that carried queued prefill chunks too (counted in both)
    mixed_steps: int = 0
    decode_batched_rows: int = 0
    decode_batched_sequences: int = 0
    # MTP head calls made for the drafts of batched steps, and the drafts they served (several
    # generations' drafts share a call: drafts / calls > 1)
    draft_head_calls: int = 0
    draft_head_drafts: int = 0
    time: TimeBreakdown = dataclasses.field(default_factory=TimeBreakdown)

    def copy(self) -> SchedulerStats:
        return dataclasses.replace(self, time=dataclasses.replace(self.time))

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dataclasses.asdict(self)

        def ratio(a: float, b: float) -> float | None:  # None until there is something to divide
            return a / b if b else None

        # always present (None before the first prompt), so a caller can read them at any time
        d["prefill_tokens_per_s"] = ratio(self.prefill_tokens, self.prefill_seconds)
        d["prefill_bytes_per_token"] = ratio(self.prefill_bytes_read, self.prefill_tokens)
        d["prefill_expert_reads_per_chunk"] = ratio(self.prefill_expert_reads, self.prefill_chunks)
        d["prefill_chunks_per_step"] = ratio(self.prefill_chunks, self.prefill_steps)
        return d


class BatchModel(Protocol):
    """What the scheduler needs of a model (``runtime.models``' classes are one)."""

    def forward_batch(
        self,
        batch: Sequence[npt.NDArray[np.integer]],
        caches: Sequence[KVCache],
        *,
        last_only: bool | Sequence[bool] = False,
        ctx: StepContext | None = None,
    ) -> list[Any]: ...


PrefillHook = Callable[[npt.NDArray[np.int64], F32Array], None]


@dataclass(eq=False)
class StepRequest:
    """One generation's rows for the next batched step: ``ids`` (a decode token), or
    ``prepare`` (a speculative round drafts on the compute thread right before the step; it
    is told how many rows the step's other generations have, and how many generations), or
    (``prefill``) a prompt chunk: only its last row's logits are computed, and ``hook`` sees
    its rows' hidden states. A prefill chunk queued while others decode rides in their decode
    step when prefill and decode share one context (:meth:`Scheduler._mixes`); else prefill
    chunks go in steps of their own, under the scheduler's prefill context."""

    cache: KVCache
    done: anyio.Event
    ids: npt.NDArray[np.int64] | None = None
    prepare: Callable[[int, int], HeadGen[npt.NDArray[np.int64]]] | None = None
    prefill: bool = False
    hook: PrefillHook | None = None
    logits: F32Array | None = None  # [T, V]
    hidden: F32Array | None = None  # [T, D]
    shared: bool = False  # other generations' rows were in the same forward
    # (rows, seconds, sequences) of the step's forward, on its first speculative request only
    # (the cost model learns a wide step's cost once per step)
    step: tuple[int, float, int] | None = None
    unions: list[int] = dataclasses.field(default_factory=list)  # a lone round's, streaming
    error: BaseException | None = None


@dataclass(eq=False)
class Ahead:
    """A generation's next step, queued before the caller needs it (:meth:`Scheduler.
    decode_ahead`, :meth:`Scheduler.round_ahead`). Exactly one of :meth:`logits` (a decode
    step), :meth:`rows` (a speculative round) or :meth:`abandon` ends it."""

    sched: Scheduler
    req: StepRequest
    start: int  # the cache's length when it was queued
    spec: SpeculativeDecoder | None = None
    ended: bool = False  # taken (logits, rows) or abandoned
    _abandoning: anyio.Event | None = None  # set once an abandon has finished

    def __post_init__(self) -> None:
        self.req.cache.step_ahead = self

    def _end(self) -> None:
        self.ended = True
        if self.req.cache.step_ahead is self:
            self.req.cache.step_ahead = None

    async def logits(self) -> F32Array:
        """The decode step's logits [V] (waits for its step)."""
        self._end()
        await self.sched._finish(self.req)
        assert self.req.logits is not None
        row: F32Array = self.req.logits[-1]
        return row

    async def rows(self) -> list[tuple[int, F32Array]]:
        """The speculative round's emitted (token, logits row) pairs (waits for its step,
        then accepts or resamples the drafts). A cancelled caller keeps the round's first
        row (its token was emitted) and never unchecked drafts."""
        spec, req, cache = self.spec, self.req, self.req.cache
        assert spec is not None
        self._end()
        try:
            await self.sched._finish(req)
        except BaseException:
            spec.abandon()
            if req.ids is not None and cache.length > self.start + 1:
                cache.truncate(self.start + 1)  # keep `tok` (emitted), never unchecked drafts
            raise
        assert req.logits is not None and req.hidden is not None
        return spec.accept(
            req.logits, req.hidden, shared=req.shared, step=req.step, unions=req.unions
        )

    async def abandon(self) -> None:
        """The caller stopped before needing this step (a consumer that closed the generation
        after its last token): the step leaves the queue, or (already running) finishes, and
        its rows are cut from the cache, which is as if it had never been queued. Once only:
        the next generation on the cache may have abandoned it already (its caller broke out
        of the loop and the generation was closed later), and the cache is that one's now."""
        if self._abandoning is not None:  # abandoned elsewhere: wait until it is done
            await settled(self._abandoning)
            return
        if self.ended:
            return
        self._abandoning = anyio.Event()
        sched, req = self.sched, self.req
        pending: BaseException | None = None
        try:
            if req in sched._pending:
                sched._pending.remove(req)
            else:
                # to the step's end, an asyncio task.cancel() included (it went through the
                # shield: the cache was declared free with the step still writing into it)
                pending = await settle(req.done)
                if req.cache.length > self.start:
                    req.cache.truncate(self.start)
            if self.spec is not None:
                self.spec.abandon()
        finally:
            self._end()  # the cache is free only now: its step has left or been cut
            self._abandoning.set()
        if pending is not None:
            raise pending


class Scheduler:
    """Runs every forward of one model: one at a time on the compute thread, prefill in chunks,
    concurrent decode steps batched. Start :meth:`serve` in a task group before decoding."""

    def __init__(
        self,
        model: BatchModel,
        *,
        ctx: StepContext,
        prefill_ctx: StepContext | None = None,
        prefill_chunk: int,
        max_batch: int = 1,
        store: ExpertStore | None = None,
        prefill_wait: float | None = None,
    ) -> None:
        """``ctx`` computes decode steps, verify rows and whole-sequence forwards;
        ``prefill_ctx`` (default ``ctx``) prefill chunks (``--fast-prefill``'s BLAS path).
        ``store``: the streaming expert store, when experts stream (prefill admission and
        prefill read counters)."""
        self.model = model
        self.ctx = ctx
        self.prefill_ctx = prefill_ctx if prefill_ctx is not None else ctx
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        # seconds a prefill step with room waits for more prompts (None: PREFILL_WAIT_SHARE of
        # the measured mean prefill step, at most PREFILL_WAIT_MAX_S)
        self.prefill_wait = prefill_wait
        self.store = store
        self.stats = SchedulerStats()
        self.limiter = anyio.CapacityLimiter(1)  # one call at a time (held by the caller)
        self._thread = anyio.CapacityLimiter(1)  # the worker thread a call runs on
        # calls on the compute thread now (set there; read on the loop by wait_idle)
        self._running = 0
        self._calls = 0  # calls in run() (on the loop, until their result is back)
        self._running_lock = threading.Lock()
        self._pending: list[StepRequest] = []
        self._wake = anyio.Event()
        self._decoding = 0  # generations in their decode loop (they may queue steps)
        self._closed: BaseException | None = None  # close(): what every later step raises

    def close(self, error: BaseException) -> None:
        """No more steps: every queued request fails with ``error`` now, and so does every
        step asked for later (the generations waiting on them end with it instead of waiting
        for a batcher that is gone). A step already on the compute thread finishes."""
        self._closed = error
        pending, self._pending = self._pending, []
        for r in pending:
            r.error = error
            r.done.set()
        self._wake.set()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise self._closed

    @contextlib.contextmanager
    def observing(self, observer: Observer) -> Iterator[None]:
        """Forwards started inside also call ``observer`` (telemetry, tests, benchmarks)."""
        ctx, pre = self.ctx, self.prefill_ctx
        self.ctx = ctx.observing(observer)
        self.prefill_ctx = self.ctx if pre is ctx else pre.observing(observer)
        try:
            yield
        finally:
            self.ctx, self.prefill_ctx = ctx, pre

    # ---- the compute thread
    async def run(self, fn: Callable[..., R], *args: Any, ran: list[bool] | None = None) -> R:
        """``fn(*args)`` on the compute thread, after every forward queued before it; its time
        goes into ``stats.time`` (:class:`TimeBreakdown`). ``ran[0]`` is set True when it
        runs (a caller cancelled before its turn: it never does)."""
        self._check_open()
        # The wait for the compute thread (calls queued before this one) is theirs, not this
        # call's: timed from the moment the thread is this call's (it was counted, and
        # compute_seconds ran ahead of the wall clock with calls queued).
        async with self.limiter:
            self._check_open()  # (it may have closed while this call waited for the thread)
            t0 = time.perf_counter()
            inside = [0.0]  # seconds on the compute thread (the rest is the hand-off)
            self._calls += 1
            # (a call cancelled before its thread took it never runs)
            flag = ran if ran is not None else [False]

            def call() -> R:
                flag[0] = True
                return self._timed(fn, args, inside)

            try:
                # to its end whatever cancels the caller (an asyncio task.cancel() made
                # to_thread return with its forward still running, and the next one start
                # beside it: two forwards on one expert store hung the engine)
                return await run_settled(call, limiter=self._thread)
            finally:
                self._calls -= 1
                if flag[0]:  # (one that never ran is no call: it was counted all the same)
                    wall = time.perf_counter() - t0
                    self.stats.compute_seconds += wall
                    self.stats.forward_calls += 1
                    self.stats.time.other_s += max(0.0, wall - inside[0])

    async def wait_idle(self, poll_s: float = 0.005) -> None:
        """Until nothing runs on the compute thread. A forward whose caller was torn down
        without waiting for it (a server's request task cancelled by the event loop's own
        shutdown) goes on running there, and it hops to the loop: the loop must outlive it,
        or that thread waits forever on a loop that is gone (and the process with it). The
        engine's close waits here, after closing the reader, so such a forward ends quickly
        (its reads fail)."""
        # ... and until the call that ran it is back on the loop with its rows (the engine's
        # close cancels the batcher next: a step done on the thread but not yet handed back
        # failed its generations with "the engine stopped")
        while self._running or self._calls:
            await anyio.sleep(poll_s)

    def _timed(self, fn: Callable[..., R], args: tuple[Any, ...], inside: list[float]) -> R:
        """Compute thread: ``fn(*args)``, its seconds (also left in ``inside[0]``) split into
        read waits (by reason), expert compute and dense compute."""
        timing, tiers = self.ctx.timing, None if self.store is None else self.store.stats
        t0, moe0 = time.perf_counter(), timing.moe_s
        dem0 = tiers.read_wait_demand_s if tiers is not None else 0.0
        la0 = tiers.read_wait_lookahead_s if tiers is not None else 0.0
        with self._running_lock:
            self._running += 1
        try:
            return fn(*args)
        finally:
            with self._running_lock:
                self._running -= 1
            t = self.stats.time
            total, moe = time.perf_counter() - t0, timing.moe_s - moe0
            inside[0] = total
            dem = tiers.read_wait_demand_s - dem0 if tiers is not None else 0.0
            la = tiers.read_wait_lookahead_s - la0 if tiers is not None else 0.0
            t.read_wait_demand_s += dem
            t.read_wait_lookahead_s += la
            t.expert_compute_s += max(0.0, moe - dem - la)
            t.dense_compute_s += max(0.0, total - moe)

    async def forward(self, ids: npt.NDArray[np.int64], cache: KVCache) -> LogitsOut:
        """Every row of ``ids`` after ``cache`` (logits [T, V], hidden [T, D]), in steps of
        ``prefill_chunk`` rows: the same bits as one step (rows are batch-invariant), while
        other generations' steps run between the chunks and a cancelled caller stops at the
        next one (the chunks computed stay in ``cache``)."""
        outs: list[LogitsOut] = []
        for i in range(0, int(ids.size), self.prefill_chunk):
            part = ids[i : i + self.prefill_chunk]
            # counted as a prompt's prefill (its steps, seconds, reads and tokens): it is one
            chunk = StepRequest(cache, anyio.Event(), ids=part, prefill=True)
            with self._as_prefill([chunk]) as ran:
                outs.append(
                    await self.run(
                        lambda p=part: self.model.forward_batch([p], [cache], ctx=self.ctx)[0],
                        ran=ran,
                    )
                )
            self.stats.prefill_chunks += 1
            self.stats.prefill_tokens += int(part.size)
        if len(outs) == 1:
            return outs[0]
        return outs[0]._replace(
            logits=np.concatenate([o.logits for o in outs]),
            hidden=np.concatenate([o.hidden for o in outs]),
        )

    # ---- prefill
    async def prefill(
        self, ids: npt.NDArray[np.int64], cache: KVCache, hook: PrefillHook | None = None
    ) -> F32Array:
        """Prefill ``ids`` in chunks; returns the last position's logits [V].

        Each chunk is one expert-major step per layer: every token of the chunk is routed, the
        union of experts is read once and applied to all its rows. With the batcher
        (``max_batch`` > 1) a chunk waits in the queue like a decode step, and the chunks of
        prompts queued together share one step (up to ``prefill_chunk`` rows and ``max_batch``
        prompts): their expert reads are unioned too, and each prompt's rows are the bits of
        its prefill alone. The KV of each chunk is committed before the next, so an
        interrupted prefill keeps what it finished. While prefilling, the LRU admits only into
        free slots (a chunk touches most experts once and would otherwise flush the decode hot
        set). ``hook(ids, hidden [T, D])`` sees every chunk (the speculative decoder feeds them
        to the MTP head)."""
        last: F32Array | None = None
        for i in range(0, int(ids.size), self.prefill_chunk):
            part = ids[i : i + self.prefill_chunk]
            req = StepRequest(cache, anyio.Event(), ids=part, prefill=True, hook=hook)
            if self.max_batch > 1:
                await self._submit(req)
            else:
                await self._prefill_run([req])
                if req.error is not None:
                    raise req.error
            assert req.logits is not None
            last = req.logits[-1]
        assert last is not None
        return last

    async def _prefill_run(self, batch: list[StepRequest]) -> None:
        """Event loop: one prefill step over ``batch`` (:meth:`_prefill_step`), counted as
        prefill (:meth:`_as_prefill`)."""
        with self._as_prefill(batch) as ran:
            await self.run(self._prefill_step, batch, ran=ran)

    @contextlib.contextmanager
    def _as_prefill(self, chunks: Sequence[StepRequest]) -> Iterator[list[bool]]:
        """A step that computes prefill ``chunks``: the store's prefill admission on while it
        runs (when a chunk has several rows), its time and expert reads counted once in the
        prefill counters, if it ran (the ``ran`` flag it gives goes to :meth:`run`: a step
        whose caller was cancelled before its turn was counted all the same)."""
        ran = [False]
        store, st = self.store, self.stats
        t0 = time.perf_counter()
        bytes0 = store.stats.bytes_read if store is not None else 0
        reads0 = store.stats.experts_read if store is not None else 0
        try:
            if store is not None and any(r.ids is not None and r.ids.size > 1 for r in chunks):
                store.prefill = True
            yield ran
        finally:
            if store is not None:
                store.prefill = False
            if ran[0]:
                st.prefill_steps += 1
                st.prefill_seconds += time.perf_counter() - t0
            if store is not None:
                st.prefill_bytes_read += store.stats.bytes_read - bytes0
                st.prefill_expert_reads += store.stats.experts_read - reads0

    def _prefill_step(self, batch: list[StepRequest]) -> None:
        """Compute thread: the prefill chunks of ``batch`` in one ``forward_batch`` (the last
        row's logits of each), then each one's hook. When the shared forward fails, each chunk
        runs again alone from where its cache was, so that only a chunk that fails by itself
        fails its generation."""
        starts = [r.cache.length for r in batch]
        try:
            outs = self.model.forward_batch(
                [r.ids for r in batch if r.ids is not None],
                [r.cache for r in batch],
                last_only=True,
                ctx=self.prefill_ctx,
            )
        except Exception:
            if len(batch) == 1:
                raise
            self._each_alone([], batch, starts)
            return
        self._chunks_done(batch, outs)

    def _chunks_done(self, chunks: Sequence[StepRequest], outs: Sequence[Any]) -> None:
        """Compute thread: each prefill chunk's last-row logits from its step's output, and
        its hook called with its rows' hidden states (a failing hook fails its generation
        only). Its tokens are counted here, when computed (a prefill cancelled or failed after
        some chunks counted their steps and reads, never their tokens)."""
        for r, o in zip(chunks, outs, strict=True):
            self.stats.prefill_chunks += 1
            self.stats.prefill_tokens += 0 if r.ids is None else int(r.ids.size)
            r.logits = o.logits
            if r.hook is not None:
                try:
                    r.hook(r.ids, o.hidden)  # type: ignore[arg-type]
                except Exception as exc:
                    r.error = exc

    def _last_row(self, ids: npt.NDArray[np.int64], cache: KVCache) -> F32Array:
        """Compute thread: the logits [V] of ``ids``' last row (a decode step without the
        batcher)."""
        out = self.model.forward_batch([ids], [cache], last_only=True, ctx=self.ctx)[0]
        logits: F32Array = out.logits[-1]
        return logits

    # ---- decode
    @contextlib.asynccontextmanager
    async def decoding(self) -> AsyncIterator[None]:
        """Held by a generation while it decodes: the batcher waits for its next step."""
        self._decoding += 1
        try:
            yield
        finally:
            self._decoding -= 1

    async def decode(self, cache: KVCache, tok: int) -> F32Array:
        """Logits [V] after feeding ``tok``. With ``max_batch`` > 1 the step joins the decode
        steps of every other active generation in one forward (their expert reads unioned);
        rows are bit-identical to a solo step."""
        ids = np.array([tok], dtype=np.int64)
        if self.max_batch <= 1:
            return await self.run(self._last_row, ids, cache)
        return await self.decode_ahead(cache, tok).logits()

    def decode_ahead(self, cache: KVCache, tok: int) -> Ahead:
        """Queue the decode step of ``tok`` now and return at once (``max_batch`` > 1): the
        caller hands out the token it just sampled while the step waits for, or runs in, the
        next batched step; :meth:`Ahead.logits` then waits for its row. Without this every
        generation's step waited for the consumer of its last token (a server's text, JSON
        and socket work), one generation after the other, before a step could start."""
        if self.max_batch <= 1:
            raise RuntimeError("decode_ahead needs the batcher (max_batch > 1)")
        req = StepRequest(cache, anyio.Event(), ids=np.array([tok], dtype=np.int64))
        ahead = Ahead(self, req, cache.length)
        self._queue(req)
        return ahead

    async def speculative_round(
        self, spec: SpeculativeDecoder, cache: KVCache, tok: int, remaining: int
    ) -> list[tuple[int, F32Array]]:
        """One speculative round of ``spec``: alone on the compute thread (no batcher), or
        (:meth:`round_ahead`) its drafts computed right before a batched step and its k + 1
        verify rows in that step, next to any other generations' rows (bit-identical to
        running them alone)."""
        if self.max_batch <= 1:
            return await self.run(spec.step, tok, remaining)
        return await self.round_ahead(spec, cache, tok, remaining).rows()

    def round_ahead(
        self, spec: SpeculativeDecoder, cache: KVCache, tok: int, remaining: int
    ) -> Ahead:
        """Queue a speculative round after ``tok`` now (as :meth:`decode_ahead`); its drafts
        are made on the compute thread right before the step, :meth:`Ahead.rows` accepts."""
        if self.max_batch <= 1:
            raise RuntimeError("round_ahead needs the batcher (max_batch > 1)")

        def prepare(others: int, other_seqs: int) -> HeadGen[npt.NDArray[np.int64]]:
            return spec.draft_steps(tok, remaining, others, other_seqs)

        req = StepRequest(cache, anyio.Event(), prepare=prepare)
        ahead = Ahead(self, req, cache.length, spec)
        self._queue(req)
        return ahead

    def _queue(self, req: StepRequest) -> None:
        if self._closed is not None:
            req.error = self._closed
            req.done.set()
            return
        self._pending.append(req)
        self._wake.set()

    async def _submit(self, req: StepRequest) -> None:
        """Queue ``req`` for the batcher and wait for its rows (:meth:`_finish`)."""
        self._queue(req)
        await self._finish(req)

    async def _finish(self, req: StepRequest) -> None:
        """Wait for the rows of ``req`` (queued). A cancelled caller leaves the queue, or (its
        step already running) waits for the step to finish with its cache."""
        try:
            await req.done.wait()
        except BaseException:
            if req in self._pending:
                self._pending.remove(req)
            else:
                await settle(req.done)  # its step writes into the cache: to its end
            raise
        if req.error is not None:
            # a caller cancelled meanwhile (what holds the engine was: its step failed for
            # that) ends with its cancellation, not with the step's error
            await anyio.lowlevel.checkpoint()
            raise req.error

    async def serve(self) -> None:
        """The batcher: runs queued steps together, one ``forward_batch`` per group of up to
        ``max_batch`` generations (run it in a task group for the model's lifetime)."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while True:
                # Before every step, not only after a wake: the generations the last step
                # woke queue their next step before it starts, so they stay in one batch
                # (else one that queued while the step ran goes alone next, and the others
                # after it: two half batches per token from then on).
                await self._gather()
                mixing = self._mixes()
                if self._pending and self._pending[0].prefill and not mixing:
                    await self._gather_prefill()
                if not self._pending:  # (a caller cancelled while it waited)
                    break
                batch = self._take(decode_first=mixing)
                chunks: list[StepRequest] = []
                try:
                    if batch[0].prefill:
                        await self._prefill_run(batch)
                        continue
                    if mixing:
                        chunks = self._take_chunks()
                    live = await self._decode_run(batch, chunks)
                    self.stats.decode_batches += 1
                    self.stats.decode_batched_sequences += len(live)
                    self.stats.decode_batched_rows += sum(
                        0 if r.ids is None else int(r.ids.size) for r in live
                    )
                except Exception as exc:  # delivered to every generation of the step
                    for r in batch + chunks:
                        if r.error is None:
                            r.error = exc
                except BaseException:
                    # the batcher itself cancelled (whatever holds the engine was): the step's
                    # generations end with an error, not as if their rows had come back
                    for r in batch + chunks:
                        if r.error is None:
                            r.error = ColibriError(
                                "the engine stopped (cancelled) before this step finished"
                            )
                    raise
                finally:
                    for r in batch + chunks:
                        r.done.set()

    async def _gather_prefill(self) -> None:
        """Before a prefill step: wait a little for more prompts (``prefill_wait``), until the
        step would be full (``max_batch`` prompts or ``prefill_chunk`` rows) or the wait is
        over. By default only when other generations are decoding or several prompts are
        already queued (a lone user's prompt never waits), and only once a prefill step has
        been measured."""
        st = self.stats
        wait = self.prefill_wait
        if wait is None:
            queued = sum(r.prefill for r in self._pending)
            if not st.prefill_steps or (self._decoding == 0 and queued < 2):
                return
            wait = min(
                PREFILL_WAIT_MAX_S, PREFILL_WAIT_SHARE * st.prefill_seconds / st.prefill_steps
            )
        deadline = time.perf_counter() + wait
        while True:
            chunks = [r for r in self._pending if r.prefill]
            rows = sum(0 if r.ids is None else int(r.ids.size) for r in chunks)
            left = deadline - time.perf_counter()
            if len(chunks) >= self.max_batch or rows >= self.prefill_chunk or left <= 0:
                return
            await anyio.sleep(min(left, 0.0005))

    def _mixes(self) -> bool:
        """Whether the next step takes queued prefill chunks beside its decode rows: both are
        queued, and they compute alike (``--fast-prefill`` runs prefill on its own context).
        A new prompt's chunk then rides in the decoding generations' step instead of stopping
        them for a step of its own: its rows' experts are read once for both, and every row
        keeps its bits (rows are independent)."""
        return (
            self.prefill_ctx is self.ctx
            and any(r.prefill for r in self._pending)
            and any(not r.prefill for r in self._pending)
        )

    def _take(self, *, decode_first: bool = False) -> list[StepRequest]:
        """The next step's requests, out of the queue: of the oldest request's kind (decode
        rows when ``decode_first`` and there are any), in queue order, up to ``max_batch`` of
        them; decode rows, or prefill chunks (:meth:`_take_chunks`)."""
        if decode_first or not self._pending[0].prefill:
            batch = [r for r in self._pending if not r.prefill][: self.max_batch]
            for r in batch:
                self._pending.remove(r)
            return batch
        return self._take_chunks()

    def _take_chunks(self) -> list[StepRequest]:
        """Queued prefill chunks out of the queue, in queue order: up to ``max_batch`` of them
        and ``prefill_chunk`` rows in all, at least one chunk (none when none is queued)."""
        batch: list[StepRequest] = []
        rows = 0
        for r in self._pending:
            if not r.prefill:
                continue
            n = 0 if r.ids is None else int(r.ids.size)
            if batch and (len(batch) == self.max_batch or rows + n > self.prefill_chunk):
                break
            batch.append(r)
            rows += n
        for r in batch:
            self._pending.remove(r)
        return batch

    async def _decode_run(
        self, batch: list[StepRequest], chunks: list[StepRequest]
    ) -> list[StepRequest]:
        """Event loop: one decode step over ``batch`` (:meth:`_batch_step`), with the prefill
        ``chunks`` in it when given: then also a prefill step (:meth:`_as_prefill`)."""
        if not chunks:
            return await self.run(self._batch_step, batch)
        self.stats.mixed_steps += 1
        with self._as_prefill(chunks) as ran:
            return await self.run(self._batch_step, batch, chunks, ran=ran)

    def _each_alone(
        self, live: list[StepRequest], chunks: Sequence[StepRequest], starts: list[int]
    ) -> None:
        """Compute thread: a shared step failed. Each of its generations runs its rows again
        alone, from where its cache was (rows are the same bits alone or batched), so that only
        one that fails by itself fails (one sequence's overflowing activations, a damaged
        cache) and the others go on."""
        for r, start in zip([*live, *chunks], starts, strict=True):
            if r.cache.length > start:
                r.cache.truncate(start)
        for r in live:
            assert r.ids is not None
            try:
                (o,) = self.model.forward_batch([r.ids], [r.cache], ctx=self.ctx)
            except Exception as exc:
                r.error = exc
                continue
            r.logits, r.hidden, r.shared = o.logits, o.hidden, False
        for r in chunks:
            try:
                self._prefill_step([r])
            except Exception as exc:
                r.error = exc

    def _drafts(self, batch: list[StepRequest]) -> None:
        """Set ``ids`` of every request that prepares them (speculative rounds). Their drafts
        run in step: each runs until it needs the MTP head, then one batched head call
        (:func:`run_heads`) serves all that wait, until every draft is done. Each draft is
        told the rows of the step's other generations: the rows planned so far, one for each
        request after it."""
        waiting: list[tuple[StepRequest, HeadGen[npt.NDArray[np.int64]], HeadRows]] = []
        planned = 0
        for i, r in enumerate(batch):
            if r.prepare is None:
                planned += 0 if r.ids is None else int(r.ids.size)
                continue
            others = planned + len(batch) - i - 1
            try:
                gen = r.prepare(others, len(batch) - 1)
                ask = next(gen)
            except StopIteration as done:
                r.ids = done.value
                planned += int(done.value.size)
            except Exception as exc:
                r.error = exc
            else:
                waiting.append((r, gen, ask))
                planned += ask.planned
        ctx = self.ctx
        while waiting:
            self.stats.draft_head_calls += 1
            self.stats.draft_head_drafts += len(waiting)
            try:
                outs = run_heads(self.model, ctx, [ask for _, _, ask in waiting])
            except Exception as exc:  # the shared call failed: each draft winds down with it
                for r, gen, _ in waiting:
                    try:
                        gen.throw(exc)
                    except StopIteration as done:
                        r.ids = done.value
                    except Exception as err:
                        r.error = err
                return
            still = []
            for (r, gen, _), out in zip(waiting, outs, strict=True):
                try:
                    ask = gen.send(out)
                except StopIteration as done:
                    r.ids = done.value
                except Exception as exc:
                    r.error = exc
                else:
                    still.append((r, gen, ask))
            waiting = still

    async def _gather(self) -> None:
        """Let the generations woken by the last step queue their next one: wait until every
        decoding generation has queued (or a full batch is there), or until ``GATHER_TURNS``
        loop turns passed without a new request."""
        quiet = 0
        while quiet < GATHER_TURNS:
            n = sum(not r.prefill for r in self._pending)  # prefill chunks go in other steps
            if n >= min(self._decoding, self.max_batch):
                return
            await anyio.sleep(0)
            quiet = 0 if sum(not r.prefill for r in self._pending) > n else quiet + 1

    def _batch_step(
        self, batch: list[StepRequest], chunks: Sequence[StepRequest] = ()
    ) -> list[StepRequest]:
        """Compute thread: prepare each request's rows (a failed draft fails only its own
        generation; the MTP head calls of every draft run together, :meth:`_drafts`), then
        one ``forward_batch`` over all of them and the prefill ``chunks`` (their last rows'
        logits; each one's hook sees its hidden states); returns the decode requests that
        ran."""
        self._drafts(batch)
        live = [r for r in batch if r.error is None and r.ids is not None]
        if not live and not chunks:
            return live
        ids = []
        for r in [*live, *chunks]:
            assert r.ids is not None  # set at creation or by prepare
            ids.append(r.ids)
        ctx = self.ctx
        unions: list[int] = []
        lone = live[0] if len(live) == 1 and live[0].prepare is not None and not chunks else None
        if lone is not None and self.store is not None and ids[0].size > 1:
            # a lone verify round, streaming: the cost model learns how wide its routing was
            n_main = int(getattr(getattr(self.model, "config", None), "num_hidden_layers", 0))

            def observe(event: str, layer: int, arr: Any) -> None:
                if event == "route" and layer < n_main:
                    unions.append(int(np.unique(arr).size))

            ctx = ctx.observing(observe)
        t0 = time.perf_counter()
        caches = [r.cache for r in [*live, *chunks]]
        lasts = [False] * len(live) + [True] * len(chunks)
        starts = [c.length for c in caches]
        try:
            outs = self.model.forward_batch(
                ids, caches, last_only=lasts if chunks else False, ctx=ctx
            )
        except Exception:
            if len(caches) == 1:
                raise
            self._each_alone(live, chunks, starts)
            return [r for r in live if r.error is None]
        step = (sum(int(x.size) for x in ids), time.perf_counter() - t0, len(live))
        if lone is not None:
            lone.unions = unions
        for r, o in zip(live, outs[: len(live)], strict=True):
            r.logits = o.logits
            r.hidden = o.hidden
            r.shared = len(live) + len(chunks) > 1
        self._chunks_done(chunks, outs[len(live) :])
        first = next((r for r in live if r.prepare is not None), None)
        if first is not None and not chunks:  # (a step with a prompt's rows is no decode cost)
            first.step = step
        return live

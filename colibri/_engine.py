"""The public engine: an async API (anyio: asyncio or trio) and a thin sync facade.

Model math runs in worker threads (numba kernels release the GIL) through
``anyio.to_thread.run_sync`` with an explicit limiter, so the event loop never blocks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import numpy.typing as npt
import structlog

from colibri._config import EngineOptions
from colibri._logging import default_library_logging
from colibri._stats import ComputeStats, EngineStats, ExpertsStats
from runtime.cluster.source import ClusterExperts
from runtime.compute import ExpertCompute
from runtime.context import Observer, StepContext
from runtime.grammar import GrammarMatcher, GrammarSpec, TokenGrammar
from runtime.kernels.isa import kernel_info
from runtime.kv import KVCache
from runtime.planner import choose_prefill_chunk
from runtime.sampling import (
    LogitNorm,
    Sampler,
    SamplingParams,
    log_softmax,
    logit_norm,
    top_ids,
)
from runtime.scheduler import Ahead, Scheduler
from runtime.settle import run_in_task, run_settled
from runtime.speculative import CostModel, DraftPolicy, SpecStats, SpeculativeDecoder
from runtime.speculative.drafts import MAX_PENDING as MTP_HISTORY
from storage.atomic import remove_leftovers
from storage.container import Container
from storage.errors import ColibriError, ModelError, OptionsError
from storage.usage import UsageCounts

if TYPE_CHECKING:
    from runtime.cluster.ray_backend import RayCluster
    from runtime.experts import ExpertStore, StoreLayout
    from runtime.models import DecoderStack

ENGINE_ID = "colibri-py-1"
R = TypeVar("R")
# After Ctrl-C, how long SyncModel.call waits for the cancelled work to wind down.
CANCEL_WAIT_S = 30.0
#: how long a cancelled open waits for its cluster start to stop the Ray it started (a
#: ``ray.init`` under way is not interruptible: seconds on a loaded machine)
CLUSTER_STOP_WAIT_S = 30.0
USAGE_FILE = ".coli_usage"
_log = structlog.get_logger("colibri.engine")

__all__ = ["DoneEvent", "Engine", "GenerationEvent", "SyncModel", "TokenEvent", "open_model"]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token. ``top``: the ``top_logprobs`` most likely (token id, logprob) pairs
    at this position, most likely first (empty unless ``generate(top_logprobs=N)`` asked)."""

    token_id: int
    index: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """The end of a generation: why it stopped, every token, and the turn's counters."""

    reason: Literal["length", "stop", "cancelled"]
    tokens: list[int]
    stats: dict[str, Any] = field(default_factory=dict)


GenerationEvent = TokenEvent | DoneEvent


def _as_ids(token_ids: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
    """``token_ids`` as int64 [T]: a 1-D sequence of integers (never floats, bools or text,
    which numpy would silently truncate or reject with its own error)."""
    if isinstance(token_ids, str | bytes):
        raise ModelError("token ids must be integers; encode text with the tokenizer first")
    try:
        raw = np.asarray(token_ids)
    except (TypeError, ValueError) as exc:  # ragged nesting, objects numpy cannot hold
        raise ModelError(f"token ids must be a 1-D sequence of integers: {exc}") from None
    if raw.size == 0:
        raise ModelError("token_ids is empty: give at least one token")
    if raw.ndim != 1:
        raise ModelError(f"token ids must be a 1-D sequence, got shape {raw.shape}")
    if raw.dtype.kind not in "iu":  # bool is its own kind ("b"), floats "f", text "U"
        raise ModelError(f"token ids must be integers, got {raw.dtype} values")
    if not isinstance(token_ids, np.ndarray) and any(
        isinstance(t, bool | np.bool_) for t in token_ids
    ):  # [True, 2] is an int64 array to numpy: True would have run as token 1
        raise ModelError("token ids must be integers, got a bool among them")
    if raw.dtype.kind == "u" and raw.size and int(raw.max()) > np.iinfo(np.int64).max:
        raise ModelError(f"token id {int(raw.max())} is out of range")
    return raw.astype(np.int64, copy=False)


_CLOSED = (
    "this engine is closed (the `with colibri.open_model(...)` or `async with "
    "Engine.open(...)` block that opened it has ended); open the model again"
)


def _loop_token() -> object | None:
    try:
        return anyio.lowlevel.current_token()
    except RuntimeError:  # made outside an event loop (tests building one by hand)
        return None


def _in_vocab(what: str, ids: npt.NDArray[np.int64], vocab: int) -> None:
    """A :class:`ModelError` naming the first id of ``ids`` outside ``0..vocab-1``."""
    if ids.size and not (0 <= ids.min() and ids.max() < vocab):
        bad = int(ids[(ids < 0) | (ids >= vocab)][0])
        raise ModelError(f"{what} token ids must be in 0..{vocab - 1}, got {bad}")


def _id_list(name: str, value: object) -> list[Any]:
    """``value``, a collection of token ids (a list, tuple, set, numpy array, iterator), as a
    list; a single id or text is a :class:`ModelError` naming ``name``."""
    if (
        isinstance(value, str | bytes | int | np.integer)
        or not isinstance(value, Iterable)
        or (isinstance(value, np.ndarray) and value.ndim == 0)
    ):
        raise ModelError(f"{name} must be a collection of token ids, got {value!r}")
    return list(value)


def _count(name: str, value: object, minimum: int = 0) -> int:
    """An integer argument ``>= minimum`` (never a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ModelError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ModelError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_finite(logits: npt.NDArray[np.float32], i: int) -> LogitNorm:
    """NaN or inf logits mean damaged weights (or a kernel bug): stop instead of emitting a
    token drawn from garbage. Returns the row's :class:`LogitNorm` (its token's logprob)."""
    norm = logit_norm(logits)
    if not norm.finite:
        raise ModelError(
            f"the model produced non-finite logits (NaN or inf) for output token {i}: the "
            "weights are probably damaged; check them with `coli doctor --verify` (a mirror's "
            "copies: `coli mirror verify`)"
        )
    return norm


def _token_event(
    tok: int, index: int, logits: npt.NDArray[np.float32], top_logprobs: int, norm: LogitNorm
) -> TokenEvent:
    """The event for ``tok`` chosen from ``logits`` [V] (its logprob and the top list);
    ``norm``: the row's :func:`logit_norm` (the whole log-softmax only for a top list)."""
    top: tuple[tuple[int, float], ...] = ()
    if top_logprobs > 0:
        lsm = log_softmax(logits)  # [V]
        best = top_ids(lsm, top_logprobs)  # (a stable argsort's first ids, not sorting all)
        top = tuple((int(t), float(lsm[t])) for t in best)
    return TokenEvent(tok, index, norm.logprob(logits, tok), top)


class Engine:
    """A loaded model. Create with ``async with Engine.open(path) as engine``."""

    def __init__(
        self,
        container: Container,
        model: DecoderStack,
        options: EngineOptions,
        scheduler: Scheduler,
    ) -> None:
        self.container = container
        self.options = options
        self._model = model
        self._scheduler = scheduler
        self._lock = anyio.Lock()
        self._usage: UsageCounts | None = None
        self._cache_shape: tuple[Any, ...] | None = None  # what generate(cache=...) must match
        # the counts as this process last loaded or saved them (what it adds on top of the
        # file's at the next save)
        self._usage_base: UsageCounts | None = None
        # speculative decoding: telemetry and the cost model live as long as the engine
        self._spec_stats = SpecStats()
        self._spec_cost: CostModel | None = None
        self._grammar_tok: TokenGrammar | None = None
        self._usage_warned = False  # "usage not saved" said once (_end_turn)
        # one grammar compiles at a time (a big schema takes seconds of CPU: several at once
        # starved every generation's steps); copies of compiled ones wait behind it too
        self._grammar_limiter = anyio.CapacityLimiter(1)
        # which kernel variant runs on which CPU ISA, and whether the lossy fast-int8 is on
        self._kernels = kernel_info(mode=options.kernels)
        self._cluster: RayCluster | None = None  # --ray: the expert workers
        self._tg: anyio.abc.TaskGroup | None = None  # the engine's own tasks (Engine.open's)
        self._counters: dict[str, float] = {
            "prompt_tokens": 0,
            "prompt_tokens_reused": 0,
            "generated_tokens": 0,
        }
        self._closed = False  # set when Engine.open's block is left
        self._loop = _loop_token()  # the event loop it serves (_check_loop)

    def _check_open(self) -> None:
        if self._closed:
            raise ColibriError(_CLOSED)

    def check_draft(self, policy: DraftPolicy) -> None:
        """Raise :class:`ModelError` when this model cannot draft as ``policy`` asks: drafting
        pinned to the MTP head (``mtp``, ``mtp:N``) needs the head (a model without its weights
        would otherwise decode without drafts and say nothing). :meth:`generate` checks it; a
        server checks a request's before it starts."""
        if policy.mode != "off" and policy.source == "mtp" and not self._model.has_mtp:
            layers = self.container.arch.num_mtp_layers
            why = (
                f"its config declares {layers} MTP layer(s) but the container has no MTP "
                "weights (a missing MTP shard?)"
                if layers
                else "it has no MTP layer"
            )
            raise ModelError(
                f"draft {policy} needs the model's MTP head, and {why}; use draft 'lookup' or "
                "'auto' (--draft on the command line)"
            )

    def _draft_policy(self, draft: str | int | None, params: SamplingParams) -> DraftPolicy:
        """The drafting a generation with ``params`` runs: its ``draft`` (else the engine's),
        fitted to seeded sampling (:meth:`DraftPolicy.for_sampling`)."""
        policy = DraftPolicy.parse(self.options.draft if draft is None else draft)
        return policy.for_sampling(seeded=not params.greedy and params.seed is not None)

    def _check_loop(self) -> None:
        """An engine serves the event loop that opened it: its batcher, locks and events live
        there. Awaited from another loop (a thread's own ``asyncio.run``) a generation would
        wait for a wake-up that never reaches it."""
        if self._loop is not None and anyio.lowlevel.current_token() != self._loop:
            raise ColibriError(
                "this engine belongs to the event loop that opened it; call it from there "
                "(from another thread: open_model()'s methods, or anyio.from_thread)"
            )

    @property
    def _store(self) -> ExpertStore | None:
        """The streaming expert store (None: every expert is resident)."""
        return self._scheduler.store

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        ram_budget: int | str | None = None,
        options: EngineOptions | Mapping[str, Any] | None = None,
        progress: LoadProgress | None = None,
    ) -> AsyncIterator[Engine]:
        """Open a model directory (default: the bundled demo model).

        With no RAM budget the experts are all read into RAM when they fit in 88% of the
        available memory, else the budget is that 88%. With a budget, dense weights, the KV
        reserve and every expert slot are carved out of it and routed experts stream.

        ``progress(step, done, total)`` follows the load ("dense weights", "experts" read
        into RAM, "pinned experts"; possibly from a worker thread); each step is also one
        log line at info level when it ends."""
        default_library_logging()
        if isinstance(options, Mapping):  # the fields as a dict: the same options
            options = EngineOptions(**options)
        elif options is not None and not isinstance(options, EngineOptions):
            raise OptionsError(
                f"options must be an EngineOptions (or a dict of its fields), got "
                f"{type(options).__name__}"
            )
        opts = options or EngineOptions()
        upd: dict[str, Any] = {}
        if path is not None:
            upd["model"] = Path(path)
        if ram_budget is not None:
            upd["ram_budget"] = ram_budget
        if upd:
            opts = EngineOptions(**{**opts.model_dump(), **upd})
        container = await run_settled(
            lambda: Container.open(opts.resolved_model(), shard_dirs=opts.model_dirs)
        )
        unknown = [n for n in container.names() if container.entry(n).role is None]
        if unknown:
            # (ignored, as transformers ignores them; a bias the model has no place for
            # changes nothing here and would there: said once, `coli doctor` lists them all)
            _log.warning(
                "tensors colibri does not know are ignored (`coli doctor` lists them)",
                count=len(unknown),
                first=unknown[:5],
            )
        report = _LoadReport(progress)
        model, plan, usage = await _plan(container, opts, report)
        store = None
        cluster: RayCluster | None = None
        engine: Engine | None = None
        scheduler: Scheduler | None = None
        error: BaseException | None = None
        async with anyio.create_task_group() as tg:
            compute = ExpertCompute(opts.resolved_threads(), kernels=opts.kernels)
            if opts.kernels != "exact":
                _log.warning(
                    "lossy kernels: activations are rounded to int8 digits for int4 weights; "
                    "output differs from the exact kernels (greedy tokens may change)",
                    kernels=opts.kernels,
                )
            try:
                if plan is not None:
                    store = await _start_store(container, model, opts, plan, tg, report)
                if opts.ray is not None:
                    cluster = await _start_cluster(container, model, opts)
                # Absorbed attention for every step keeps prefill chunks, decode and verify rows
                # bit-identical (batch-invariant); reconstruction is faster for long prefills.
                ctx = StepContext(
                    compute, attention_mode="auto" if opts.fast_prefill else "absorbed"
                )
                if usage is not None:
                    ctx = ctx.observing(_usage_observer(usage))
                prefill_ctx = (
                    ctx.replace(
                        compute=ExpertCompute(
                            fast_min_rows=opts.fast_prefill_rows,
                            share=compute,
                            kernels=opts.kernels,
                        )
                    )
                    if opts.fast_prefill
                    else ctx
                )
                scheduler = Scheduler(
                    model,
                    ctx=ctx,
                    prefill_ctx=prefill_ctx,
                    prefill_chunk=opts.prefill_chunk
                    or choose_prefill_chunk(
                        container.arch.hidden_size,
                        container.arch.top_k,
                        streaming=store is not None,
                        ram_budget=opts.ram_budget,
                        context=int(model.config.max_position_embeddings),
                    ),
                    max_batch=opts.max_batch,
                    store=store,
                )
                engine = cls(container, model, opts, scheduler)
                engine.check_draft(DraftPolicy.parse(opts.draft))
                engine._usage = usage
                engine._usage_base = None if usage is None else usage.copy()
                engine._cluster = cluster
                engine._tg = tg
                tg.start_soon(scheduler.serve)
                yield engine
            except BaseException as exc:  # re-raised below, unwrapped by the task group
                error = exc
            finally:
                if engine is not None:
                    engine._closed = True
                if scheduler is not None:
                    # a generation still running (another task, another thread of the sync
                    # API) ends with this error at its next step instead of waiting forever
                    # for a batcher that is about to stop
                    scheduler.close(ColibriError(_CLOSED))

                async def close() -> None:
                    if cluster is not None:
                        wait = max(1.0, min(30.0, opts.expert_timeout))
                        await anyio.to_thread.run_sync(lambda: cluster.close(wait))
                    if store is not None:
                        store.begin_close(ColibriError(_CLOSED))
                        await store.reader.aclose()
                    if scheduler is not None:  # a forward left running ends while the loop runs
                        await scheduler.wait_idle()
                    await anyio.to_thread.run_sync(compute.close)

                # to its end, a second asyncio task.cancel() meanwhile included (it cut the
                # close short: the reader, its ring and descriptors, and the compute pool
                # stayed open, a forward could outlive the loop)
                try:
                    await run_in_task(tg, close)
                except BaseException as exc:
                    error = error if error is not None else exc
                tg.cancel_scope.cancel()
        if error is not None:
            raise error

    # ------------------------------------------------------------------ learning
    async def _end_turn_settled(self) -> None:
        """:meth:`_end_turn` as a task of the engine's own, awaited to its end: a caller's
        asyncio task.cancel() went through anyio's shield and cut the usage save (its counts
        then merged twice) or a re-pin (its reads in flight) short; an outer deadline that
        cancels the engine's task group too does not cut it either (shielded). Its error is
        raised here; a cancellation that came meanwhile after it."""
        await run_in_task(None if self._closed else self._tg, self._end_turn)

    async def _end_turn(self) -> None:
        """Turn end: save `.coli_usage` atomically (off the loop) and, when enabled, re-pin."""
        from storage.usage import merge_save_usage

        if self._usage is None:
            return
        path = self.options.resolved_state_dir() / USAGE_FILE
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # this process's new counts go on top of the file's (another process on the same
            # state directory may have saved its own since): the sum comes back
            snap = self._usage.copy()
            since = self._usage_base or UsageCounts(snap.n_layers, snap.n_experts)
            total = await anyio.to_thread.run_sync(merge_save_usage, path, snap, since, ENGINE_ID)
            self._usage.shift(total.counts - snap.counts)  # (counting went on meanwhile)
            self._usage_base = total
        except (ColibriError, OSError) as exc:
            # once: a read-only or full state dir would say it at every turn end (in a chat,
            # in the middle of the reply being printed)
            if not self._usage_warned:
                self._usage_warned = True
                _log.warning("usage not saved", path=str(path), error=str(exc))
        if self._store is not None and self.options.repin:
            async with self._scheduler.limiter:  # no forward may run while pinned slots change
                await self._store.repin(self._usage.counts)

    # ------------------------------------------------------------------ compute
    async def forward(
        self, token_ids: Sequence[int] | npt.NDArray[np.integer]
    ) -> npt.NDArray[np.float32]:
        """Logits float32 [T, vocab] for ``token_ids`` in a fresh context (at most
        :attr:`context_length` of them)."""
        ids = _as_ids(token_ids)
        self._check_open()
        self._check_loop()
        if ids.size > self.context_length:
            raise ModelError(
                f"this model's context is {self.context_length} tokens, but {ids.size} were "
                "given; shorten them"
            )
        async with self._lock:
            out = await self._scheduler.forward(ids, self._model.new_cache())
        return np.asarray(out.logits, dtype=np.float32)

    async def generate(
        self,
        prompt_ids: Sequence[int] | npt.NDArray[np.integer],
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Iterable[int] | None = None,
        cache: KVCache | None = None,
        top_logprobs: int = 0,
        grammar: GrammarSpec | None = None,
        draft: str | int | None = None,
    ) -> AsyncIterator[GenerationEvent]:
        """Stream ``TokenEvent`` s, then one ``DoneEvent``.

        ``cache`` (from :meth:`new_cache`) continues a kept context instead of a fresh one: its
        longest common token prefix with ``prompt_ids`` (:meth:`reusable_prefix`) is reused, the
        rest of the prompt is prefilled, and afterwards it holds the prompt and the generated
        tokens (all but the last, which was never fed back). The caller owns it and must not use
        it from two generations at once. ``top_logprobs`` > 0 fills ``TokenEvent.top``.

        ``grammar`` (a :class:`~runtime.grammar.GrammarSpec`: JSON object, JSON Schema, GBNF,
        ...) constrains sampling: every token is drawn from the logits masked to what the
        grammar allows, and spans it forces are verified as free drafts. ``draft`` overrides
        ``EngineOptions.draft`` for this call (speculative decoding, docs/speculative.md)."""
        ids = _as_ids(prompt_ids)
        self._check_open()
        self._check_loop()
        max_new_tokens = _count("max_new_tokens", max_new_tokens)
        top_logprobs = _count("top_logprobs", top_logprobs)
        ctx_len = self.context_length
        if ids.size >= ctx_len:
            raise ModelError(
                f"this model's context is {ctx_len} tokens, but the prompt has {ids.size} "
                "tokens; shorten it"
            )
        # the context bounds the generation: past it the model was never trained (the server
        # refuses such a request; here the generation ends there, reason "length")
        max_new_tokens = min(max_new_tokens, ctx_len - int(ids.size))
        sampler = Sampler(SamplingParams(temperature, top_p, top_k, seed))
        vocab = self.container.arch.vocab_size
        # Checked here, alone: a token id past the vocabulary found inside a batched step
        # would fail every generation sharing that step.
        _in_vocab("prompt", ids, vocab)
        if grammar is not None and not isinstance(grammar, GrammarSpec):
            raise ModelError(
                f"grammar must be a GrammarSpec (GrammarSpec.json_schema(...), .json_object(), "
                f".regex(...), .gbnf(...), .lark(...)), got {type(grammar).__name__}"
            )
        if cache is not None:
            self._check_cache(cache)
        if stop_token_ids is None:
            stops = set(self.container.eos_token_ids)
        else:
            stop_list = _id_list("stop_token_ids", stop_token_ids)
            stop_ids = _as_ids(stop_list) if stop_list else np.zeros(0, np.int64)
            _in_vocab("stop", stop_ids, vocab)
            stops = {int(t) for t in stop_ids}
        if grammar is not None:
            # Under a grammar the model's end-of-sequence token is only allowed once the output
            # is complete and then nothing else is: it ends the generation even when the stop
            # ids leave it out (ignore_eos), instead of end-of-sequence tokens to max_tokens.
            stops |= set(self.container.eos_token_ids)
        out_tokens: list[int] = []
        reason: Literal["length", "stop", "cancelled"] = "length"
        t0 = time.perf_counter()
        reused = 0
        # Compute is serialised by the scheduler; decode steps of concurrent generations are
        # batched (runtime/scheduler.py).
        sched = self._scheduler
        time0 = dataclasses.replace(sched.stats.time)
        policy = self._draft_policy(draft, sampler.params)
        self.check_draft(policy)
        if cache is None:
            cache = self._model.new_cache()
        else:
            if cache.step_ahead is not None:
                # The last generation on this cache queued its next step and was left with a
                # `break` (its generator is closed later, by the event loop): that step leaves
                # the queue, or finishes and is cut, before this one reads the cache.
                await cache.step_ahead.abandon()  # (settled: a cancellation waits for it)
            reused = self._mtp_history_bound(
                self.reusable_prefix(cache, ids), ids.size, sampler, policy
            )
            cache.truncate(reused)
        self._counters["prompt_tokens"] += int(ids.size)
        self._counters["prompt_tokens_reused"] += reused
        # The next step is queued before a token is handed out (with the batcher), and the
        # generation then lets the loop turn once, so that the others woken by the same step
        # queue theirs too and the batcher starts the shared step: every consumer's work on
        # its token (a server's text, JSON and socket writes) overlaps the step, instead of
        # all but the last consumer's work running before it. A consumer that stops early
        # leaves the queued step to ``ahead.abandon``.
        pipelined = sched.max_batch > 1
        ahead: Ahead | None = None
        try:
            spec = None
            if max_new_tokens > 0:
                spec = await self._speculator(ids, cache, sampler, stops, grammar, policy)
            if spec is not None:
                logits = await sched.prefill(ids[reused:], cache, spec.prefill_hook)
                rows = [(spec.first(logits), logits)]
                i = 0
                async with sched.decoding():
                    while rows:
                        # the rows handed out: up to a stop token or the limit
                        n = 0
                        for tok, _ in rows:
                            n += 1
                            if tok in stops or i + n >= max_new_tokens:
                                break
                        last = rows[n - 1][0]
                        more = last not in stops and i + n < max_new_tokens
                        if more and pipelined:
                            ahead = sched.round_ahead(spec, cache, last, max_new_tokens - i - n)
                            await anyio.lowlevel.checkpoint()
                        for tok, row in rows[:n]:
                            norm = _check_finite(row, i)
                            out_tokens.append(tok)
                            self._counters["generated_tokens"] += 1
                            yield _token_event(tok, i, row, top_logprobs, norm)
                            i += 1
                        if not more:
                            reason = "stop" if last in stops else reason
                            break
                        if ahead is not None:
                            nxt, ahead = ahead, None
                            rows = await nxt.rows()
                        else:
                            rows = await sched.speculative_round(
                                spec, cache, last, max_new_tokens - i
                            )
            elif max_new_tokens > 0:
                logits = await sched.prefill(ids[reused:], cache)
                async with sched.decoding():
                    for i in range(max_new_tokens):
                        norm = _check_finite(logits, i)
                        tok = sampler.sample(logits)
                        out_tokens.append(tok)
                        self._counters["generated_tokens"] += 1
                        more = tok not in stops and i + 1 < max_new_tokens
                        if more and pipelined:
                            ahead = sched.decode_ahead(cache, tok)
                            await anyio.lowlevel.checkpoint()
                        yield _token_event(tok, i, logits, top_logprobs, norm)
                        if not more:
                            reason = "stop" if tok in stops else reason
                            break
                        if ahead is not None:
                            nxt, ahead = ahead, None
                            logits = await nxt.logits()
                        else:
                            logits = await sched.decode(cache, tok)
        except anyio.get_cancelled_exc_class():
            reason = "cancelled"
            raise
        finally:
            try:
                if ahead is not None:
                    await ahead.abandon()  # (a native cancel that came meanwhile: raised)
            finally:
                await self._end_turn_settled()
        dt = time.perf_counter() - t0
        yield DoneEvent(
            reason,
            out_tokens,
            {
                "seconds": dt,
                "tokens": len(out_tokens),
                "prompt_tokens": int(ids.size),
                "prompt_tokens_reused": reused,
                "prompt_tokens_computed": int(ids.size) - reused,
                # where the forwards' time went while this generation ran (other generations'
                # forwards included when several run at once)
                "time": dataclasses.asdict(sched.stats.time.minus(time0)),
            },
        )

    async def check_grammar(self, grammar: GrammarSpec) -> None:
        """Compile ``grammar`` against this model's tokenizer now: a :class:`GrammarError`
        (invalid or unsatisfiable) here rather than once a generation streams (the server
        answers 400 before its stream starts). Off the event loop."""
        await self._grammar_matcher(grammar)

    async def _grammar_matcher(self, grammar: GrammarSpec) -> GrammarMatcher:
        if self._grammar_tok is None:
            path = self.container.tokenizer_path()
            if path is None:
                raise ModelError("structured output needs the model's tokenizer.json")
            self._grammar_tok = await run_settled(
                TokenGrammar,
                path,
                int(self._model.config.vocab_size),
                list(self.container.eos_token_ids),
            )
        # compiled off the loop: a big grammar takes seconds (a 3.6 MB regex ~1.8 s)
        matcher: GrammarMatcher = await run_settled(
            self._grammar_tok.matcher, grammar, limiter=self._grammar_limiter
        )
        return matcher

    async def _speculator(
        self,
        ids: npt.NDArray[np.int64],
        cache: KVCache,
        sampler: Sampler,
        stops: set[int],
        grammar: GrammarSpec | None,
        policy: DraftPolicy,
    ) -> SpeculativeDecoder | None:
        """The round-by-round decoder for this generation, or None for plain decoding (drafting
        off and no grammar)."""
        if policy.mode == "off" and grammar is None:
            return None
        matcher = None if grammar is None else await self._grammar_matcher(grammar)
        if self._spec_cost is None:
            cfg = self._model.config
            self._spec_cost = CostModel(
                top_k=int(cfg.num_experts_per_tok),
                n_experts=int(cfg.n_routed_experts),
                moe_layers=sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)),
                max_k=DraftPolicy().k,
            )
        store = self._store
        params = sampler.params
        return SpeculativeDecoder(
            self._model,
            cache,
            sampler,
            prompt=ids,
            policy=policy,
            cost=self._spec_cost,
            stats=self._spec_stats,
            grammar=matcher,
            stop_ids=sorted(stops),
            store_stats=None if store is None else (lambda: store.stats),
            # the auto schedule follows timings: seeded sampling must not depend on them
            reproducible=policy.mode == "auto" and not params.greedy and params.seed is not None,
            ctx=self._scheduler.ctx,
        )

    def _mtp_history_bound(
        self, reused: int, n_prompt: int, sampler: Sampler, policy: DraftPolicy
    ) -> int:
        """``reused`` lowered, when MTP drafts are pinned and sampling is seeded, so that the
        last :data:`MTP_HISTORY` + 1 prompt positions run again: the MTP head's history is
        the main model's hidden states of the latest prompt rows computed in the call (each
        paired with the next token), and those of a context taken from a cache were never
        computed in it. With them rerun, the head's drafts, and with them the seeded draws,
        are those of the whole prompt computed afresh (greedy output never depends on the
        drafts; ``auto`` keeps model drafts off for seeded sampling)."""
        params = sampler.params
        if (
            policy.mode != "fixed"
            or policy.source == "lookup"
            or not self._model.has_mtp
            or params.greedy
            or params.seed is None
        ):
            return reused
        # the head's pairs (hidden j, token j + 1) of the latest MTP_HISTORY positions need
        # the hidden states of the MTP_HISTORY + 1 last prompt rows
        return min(reused, max(0, n_prompt - MTP_HISTORY - 1))

    @property
    def context_length(self) -> int:
        """The model's context in tokens (``max_position_embeddings``): a prompt must be
        shorter, and a generation ends when prompt + output reach it."""
        return int(self._model.config.max_position_embeddings)  # parsed and checked at load

    def new_cache(self) -> KVCache:
        """An empty KV cache for :meth:`generate` (``cache=``): a context a caller keeps."""
        cache: KVCache = self._model.new_cache()
        return cache

    def _check_cache(self, cache: object) -> None:
        """``generate(cache=...)`` takes a cache of this model's shape (from a
        :meth:`new_cache` of an engine on the same model): anything else is a ModelError
        before any step (a cache of another model's shape failed inside the step with a
        numpy broadcast error)."""
        if not isinstance(cache, KVCache):
            raise ModelError(
                f"cache must be a KV cache from engine.new_cache(), got {type(cache).__name__}"
            )
        if self._cache_shape is None:  # (a new cache zeroes its arrays: made once)
            self._cache_shape = self._model.new_cache().shape
        if cache.shape != self._cache_shape:
            raise ModelError(
                "this cache was made for another model (its KV shape differs from this "
                "model's); take one from this engine's new_cache()"
            )

    @staticmethod
    def reusable_prefix(cache: KVCache, prompt_ids: Sequence[int] | npt.NDArray[np.integer]) -> int:
        """Tokens of ``prompt_ids`` that ``generate(cache=cache)`` takes from the cache: the
        longest common prefix with ``cache.tokens``, less one when it covers the whole prompt
        (the last prompt token must run again to give the next token's logits)."""
        ids = _as_ids(prompt_ids)
        held = cache.tokens
        ahead = cache.step_ahead
        if ahead is not None and not ahead.ended:
            # a step a generation left with `break` queued: the next generation cuts its rows
            # before it reads the cache (Ahead.abandon)
            held = held[: ahead.start]
        n = min(held.size, ids.size - 1)
        diff = np.flatnonzero(held[:n] != ids[:n])
        return int(diff[0]) if diff.size else int(n)

    def prompt_reuse(
        self,
        cache: KVCache,
        prompt_ids: Sequence[int] | npt.NDArray[np.integer],
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        draft: str | int | None = None,
    ) -> int:
        """Tokens of ``prompt_ids`` that :meth:`generate` with these settings takes from
        ``cache`` (the rest it computes): :meth:`reusable_prefix`, less what pinned MTP drafts
        with seeded sampling run again (the head's history). What a server or chat reports as
        cached before the generation's own ``prompt_tokens_reused`` arrives."""
        params = SamplingParams(temperature=temperature, seed=seed)
        policy = self._draft_policy(draft, params)
        ids = _as_ids(prompt_ids)
        return self._mtp_history_bound(
            self.reusable_prefix(cache, ids), int(ids.size), Sampler(params), policy
        )

    def snapshot(self) -> EngineStats:
        """Counters since open as typed, frozen dataclasses (see :mod:`colibri._stats`)."""
        sched = self._scheduler
        comp, pre = sched.ctx.compute, sched.prefill_ctx.compute
        compute = ComputeStats(
            threads=comp.threads,
            parallel_steps=comp.parallel_steps + (0 if pre is comp else pre.parallel_steps),
            prefill_chunk=sched.prefill_chunk,
            fast_prefill=self.options.fast_prefill,
            fast_prefill_matmuls=pre.fast_calls,
            kernels=self._kernels.as_dict(),
            split_matmuls=comp.split_calls + (0 if pre is comp else pre.split_calls),
            split_experts=comp.split_experts + (0 if pre is comp else pre.split_experts),
            early_experts=comp.early_experts + (0 if pre is comp else pre.early_experts),
            layer_calls=comp.layer_calls + (0 if pre is comp else pre.layer_calls),
            crew_runs=comp.crew_runs,  # one crew, shared by the prefill compute
            crew_stood_aside=comp.crew_stood_aside,
        )
        store = self._store
        if store is None:
            experts = ExpertsStats("resident")
        else:
            placement = store.placement
            experts = ExpertsStats(
                "streaming",
                reader=store.reader.name,
                reader_reason=store.reader.reason,
                slots_bytes=store.nbytes,
                lru_slots_per_layer=store.layout.lru_slots_per_layer,
                pinned=len(store.layout.pinned),
                transient_slots=store.layout.transient_slots,
                fixed_buffers=store.fixed_buffers,
                hugepages=store.hugepage_report(),
                tiers=dataclasses.replace(store.stats),
                devices=None if placement is None else tuple(placement.copy_stats()),
                placement=None if placement is None else placement.summary(),
            )
        return EngineStats(
            scheduler=sched.stats.copy(),
            prompt_tokens=int(self._counters["prompt_tokens"]),
            prompt_tokens_reused=int(self._counters["prompt_tokens_reused"]),
            generated_tokens=int(self._counters["generated_tokens"]),
            compute=compute,
            speculative={
                "policy": self.options.draft,
                **self._spec_stats.as_dict(),
                "cost_model": None if self._spec_cost is None else self._spec_cost.snapshot(),
            },
            experts=experts,
            cluster=self._cluster_stats(),
        )

    def _cluster_stats(self) -> dict[str, Any] | None:
        """``stats()["cluster"]`` under ``--ray`` (None without)."""
        src = self._model.experts
        if self._cluster is None or not isinstance(src, ClusterExperts):
            return None
        return {**self._cluster.describe(), **src.as_dict()}

    def stats(self) -> dict[str, Any]:
        """Counters since open (compute, tokens, and the expert store's tiers when present):
        :meth:`snapshot` as plain JSON data."""
        return self.snapshot().as_dict()

    async def enable_replica(self, which: int | str | os.PathLike[str]) -> dict[str, Any]:
        """Re-enable a copy of the model that a read error demoted (see docs/tuning.md
        "Several SSDs"): ``which`` is its index (0: the primary, then each mirror in order) or
        its directory. It gets its declared/probed weight back and a fresh throughput estimate.
        Returns that copy's entry of ``stats()["experts"]["devices"]``; ColibriError when the
        experts do not stream or no copy matches."""
        store = self._store
        placement = None if store is None else store.placement
        if store is None or placement is None:
            raise ColibriError("the experts are resident in RAM: there is no copy to re-enable")
        idx = placement.index_of(which)
        # its files are opened anew: the documented repair, `coli mirror stage`, renames
        # fresh files into place, and the open ones are the damaged files that demoted it
        store.reader.reopen(placement.copies[idx].files.values())
        placement.enable(idx)
        stats: dict[str, Any] = placement.stats()[idx]
        return stats

    def expert_map(self) -> dict[str, Any]:
        """Where each routed expert lives now, and how often it was routed (for dashboards).

        ``layers``: the MoE layer indices; ``tiers[i][e]``: "ram" (every expert resident),
        "pinned", "lru" or "disk" (streaming), "worker" (``--ray``: an expert worker holds it;
        ``owners[i][e]`` says which, by its index); ``counts[i][e]``: routing selections from
        the `.coli_usage` history (None when not kept)."""
        layers = list(self.container.expert_layers())
        n_experts = int(self.container.arch.n_routed_experts)
        store = self._store
        cluster = self._cluster
        if cluster is not None:
            # the workers hold the experts (the coordinator's own store only serves a failed
            # worker's: describing it showed a --ray server's experts all "disk")
            owners = [
                [int(cluster.owners.get((layer, e), (-1,))[0]) for e in range(n_experts)]
                for layer in layers
            ]
            return {
                "mode": "cluster",
                "layers": layers,
                "n_experts": n_experts,
                "tiers": [["worker"] * n_experts for _ in layers],
                "owners": owners,
                "counts": self._usage_rows(layers),
            }
        if store is None:
            tiers = [["ram"] * n_experts for _ in layers]
        else:
            where = store.tiers()
            tiers = [[where.get((layer, e), "disk") for e in range(n_experts)] for layer in layers]
        return {
            "mode": "resident" if store is None else "streaming",
            "layers": layers,
            "n_experts": n_experts,
            "tiers": tiers,
            "counts": self._usage_rows(layers),
        }

    def _usage_rows(self, layers: list[int]) -> list[list[int]] | None:
        """Routing selections per expert of each of ``layers`` (None: no usage kept)."""
        usage = self._usage
        if usage is None:
            return None
        return [
            [int(c) for c in usage.counts[layer]] if layer < usage.n_layers else []
            for layer in layers
        ]


def _usage_observer(usage: UsageCounts) -> Observer:
    """Counts routing selections per (layer, expert) for `.coli_usage` (learned pinning)."""

    def observe(event: str, layer: int, arr: npt.NDArray[Any]) -> None:
        if event == "route" and layer < usage.n_layers:
            usage.add(layer, np.asarray(arr).ravel())

    return observe


LoadProgress = Callable[[str, int, int], None]


class _LoadReport:
    """Feeds a load's steps to a ``progress`` callback and one info line per finished step."""

    def __init__(self, progress: LoadProgress | None) -> None:
        self._progress = progress
        self._t0: dict[str, float] = {}

    def __call__(self, step: str, done: int, total: int) -> None:
        self._t0.setdefault(step, time.perf_counter())
        if self._progress is not None:
            self._progress(step, done, total)
        if done >= total:
            _log.info(
                "loaded",
                step=step,
                items=total,
                seconds=round(time.perf_counter() - self._t0[step], 2),
            )

    def step(self, name: str) -> Callable[[int, int], None]:
        return lambda done, total: self(name, done, total)


async def _plan(
    container: Container, opts: EngineOptions, report: _LoadReport | None = None
) -> tuple[DecoderStack, StoreLayout | None, UsageCounts | None]:
    """Load the dense part and decide the expert tiers inside the RAM budget.

    Returns (model, layout, usage counts) where layout None means every expert is read into
    RAM now. The split is :func:`runtime.planner.make_plan`'s (what `coli plan` shows); the
    pinned set comes from `.coli_usage` once it holds enough history."""
    from runtime.models import load_model
    from runtime.planner import make_plan
    from runtime.weights import ResidentExperts
    from storage.usage import UsageCounts, load_usage

    arch = container.arch
    report = report if report is not None else _LoadReport(None)
    usage = None
    removed = await run_settled(remove_leftovers, opts.resolved_state_dir())
    if removed:
        _log.info("removed temp files of interrupted saves", files=[p.name for p in removed])
    if opts.learn:
        usage = await run_settled(
            load_usage,
            opts.resolved_state_dir() / USAGE_FILE,
            arch.total_layers,
            arch.n_routed_experts,
            ENGINE_ID,
        )
        if usage is None:
            usage = UsageCounts(arch.total_layers, arch.n_routed_experts)
    plan = await run_settled(
        lambda: make_plan(
            container,
            opts.ram_budget,
            kv_reserve_tokens=opts.kv_reserve_tokens,
            pin=opts.pin,
            pin_fraction=opts.pin_fraction,
            pin_min_selections=opts.pin_min_selections,
            usage_counts=usage.counts if usage is not None else None,
        )
    )
    for warning in plan.warnings:
        _log.warning("RAM plan", problem=warning)
    # The plan (and so a budget that cannot work) is decided from the container's sizes before
    # anything heavy is read; then the dense part loads, without experts, attached below.
    report("dense weights", 0, 1)
    model = await run_settled(load_model, container, ResidentExperts(container, []))
    report("dense weights", 1, 1)
    if opts.ray is not None:
        # Experts live on the cluster's workers: this process keeps only the transient slots
        # it needs to compute a failed worker's experts from its own reads.
        from runtime.experts import plan_layout

        full = plan_layout(container, None, top_k=arch.top_k)
        floor = full.transient_slots * full.slot_bytes
        return model, plan_layout(container, floor, top_k=arch.top_k), usage
    if plan.layout is None:
        checksums = None
        if opts.verify_reads:
            from storage.integrity import load_checksums

            checksums = await run_settled(load_checksums, container.path)
        model.experts = await run_settled(
            lambda: ResidentExperts(container, checksums=checksums, progress=report.step("experts"))
        )
    return model, plan.layout, usage


async def _start_store(
    container: Container,
    model: DecoderStack,
    opts: EngineOptions,
    layout: StoreLayout,
    tg: anyio.abc.TaskGroup,
    report: _LoadReport,
) -> ExpertStore:
    from runtime.experts import ExpertStore, StreamingExperts
    from storage.multidisk.probing import open_placement
    from storage.reader import open_reader

    extents = container.expert_extents()
    reader = await open_reader(opts.reader, probe_path=extents[0].path if extents else None)
    try:
        # Which copy (primary or --mirror) serves each expert; a single copy without mirrors.
        placement = await open_placement(
            container,
            opts.mirror,
            weights=opts.disk_weights,
            adapt=opts.disk_adapt,
            stripe_min_bytes=opts.stripe_min_bytes,
            state_dir=opts.resolved_state_dir() if opts.mirror else None,
            direct=reader.direct,
        )
        checksums = None
        if opts.verify_reads:
            from storage.integrity import load_checksums

            checksums = await run_settled(load_checksums, container.path)
        store = ExpertStore(
            container,
            reader,
            layout,
            prefetch=opts.prefetch,
            placement=placement,
            checksums=checksums,
        )
        await store.start(tg, progress=report.step("pinned experts") if layout.pinned else None)
    except BaseException:
        # (cancelled or failed part-way: Engine.open never got the store to close, and the
        # ring, its eventfd and the shards' descriptors stayed open for the process's life)
        with anyio.CancelScope(shield=True):
            await reader.aclose()
        raise
    model.experts = StreamingExperts(store)
    return store


async def _start_cluster(
    container: Container, model: DecoderStack, opts: EngineOptions
) -> RayCluster:
    """``--ray``: start the expert workers and make the model's expert source the cluster (the
    store started before stays as the fallback for a failed worker's experts)."""
    from runtime.cluster.ray_backend import start_cluster

    assert opts.ray is not None
    worker_model = opts.worker_model if opts.worker_model is not None else opts.resolved_model()
    cancelled, finished = threading.Event(), threading.Event()
    started: list[RayCluster] = []

    def start() -> RayCluster:
        try:
            started.append(
                start_cluster(
                    opts.ray or "local",
                    opts.expert_workers,
                    container,
                    model=str(worker_model),
                    model_dirs=[str(d) for d in opts.model_dirs],
                    mirrors=[str(m) for m in opts.mirror],
                    reader=opts.reader,
                    worker_ram=opts.worker_ram,
                    worker_threads=opts.worker_threads,
                    state_dir=str(opts.resolved_state_dir() / "cluster"),
                    kernels=opts.kernels,
                    verify_reads=opts.verify_reads,
                    cancelled=cancelled,
                )
            )
            return started[0]
        finally:
            finished.set()

    try:
        # (abandoned on cancellation: the wait below is what stops it)
        cluster = await anyio.to_thread.run_sync(start, abandon_on_cancel=True)
    except BaseException:
        # Cancelled (Ctrl-C, SIGTERM, a deadline) while Ray started or the workers loaded:
        # the start stops its workers and the Ray it began before the open ends. Left running
        # in its thread, the process exited under it and Ray's processes outlived it (its
        # agents for a minute); a start that finished meanwhile is closed here.
        cancelled.set()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(finished.wait, CLUSTER_STOP_WAIT_S)
            if started:
                await anyio.to_thread.run_sync(lambda: started[0].close(1.0))
        raise
    mine = kernel_info(mode=opts.kernels).as_dict()
    for info in cluster.infos:
        theirs = info.get("kernels", {})
        if (theirs.get("variant"), theirs.get("isa"), theirs.get("mode")) != (
            mine["variant"],
            mine["isa"],
            mine["mode"],
        ):
            _log.warning(
                "an expert worker runs another kernel variant or ISA: its outputs may differ "
                "from this host's in the last bits",
                worker_host=info.get("host"),
                worker=theirs,
                here=mine,
            )
    model.experts = ClusterExperts(
        cluster.links,
        cluster.owners,
        model.experts,
        load_args=cluster.load_args,
        infos=cluster.infos,
        deadline_s=opts.expert_timeout,
    )
    return cluster


class SyncModel:
    """Blocking facade over :class:`Engine` for scripts and the CLI."""

    def __init__(self, portal: anyio.from_thread.BlockingPortal, engine: Engine) -> None:
        self._portal = portal
        self.engine = engine

    @property
    def container(self) -> Container:
        return self.engine.container

    def _check_thread(self) -> None:
        """A blocking method called on the engine's own event loop (from a coroutine that
        :meth:`call` runs) would wait for that loop forever: say so instead."""
        if getattr(self._portal, "_event_loop_thread_id", None) == threading.get_ident():
            raise ColibriError(
                "a SyncModel method blocks: it cannot run inside a coroutine on the model's "
                "own event loop (one that model.call() runs); await model.engine's methods "
                "there instead"
            )

    def call(self, fn: Callable[..., Awaitable[R]], *args: Any) -> R:
        """``await fn(*args)`` on the engine's event loop, from this (blocking) thread.

        Ctrl-C (KeyboardInterrupt) while it runs cancels it there and waits for it to end (a
        forward on the compute thread finishes its step first, reads in flight land, a turn's
        `.coli_usage` is saved) before the interrupt goes on, so closing the model afterwards
        never pulls the reader from under a running step. A second Ctrl-C stops waiting."""
        self.engine._check_open()  # the portal's loop is gone with the engine
        self._check_thread()
        task = _PortalTask(self._portal, fn, *args)
        try:
            return task.future.result()
        except KeyboardInterrupt:
            task.cancel_and_wait()
            raise

    def forward(
        self, token_ids: Sequence[int] | npt.NDArray[np.integer]
    ) -> npt.NDArray[np.float32]:
        """Logits float32 [T, vocab] for ``token_ids`` in a fresh context."""
        return self.call(self.engine.forward, token_ids)

    def generate(
        self,
        prompt_ids: Sequence[int] | npt.NDArray[np.integer],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        **kw: Any,
    ) -> list[int]:
        """New token ids (the prompt excluded)."""

        async def collect() -> list[int]:
            toks: list[int] = []
            async for ev in self.engine.generate(
                prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, **kw
            ):
                if isinstance(ev, TokenEvent):
                    toks.append(ev.token_id)
            return toks

        return self.call(collect)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def snapshot(self) -> EngineStats:
        """:meth:`Engine.snapshot` (typed counters)."""
        return self.engine.snapshot()

    def enable_replica(self, which: int | str | os.PathLike[str]) -> dict[str, Any]:
        """Re-enable a demoted copy (see :meth:`Engine.enable_replica`)."""
        result: dict[str, Any] = self.call(self.engine.enable_replica, which)
        return result


@contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold a Ctrl-C or SIGTERM that arrives inside the block until it ends (then act on it):
    for steps that must complete as a whole, such as starting the portal's thread (an
    interrupt in the middle leaves a loop thread nobody can stop, and the process waits for it
    forever). Only in the main thread, where Python runs signal handlers. SIGINT and SIGTERM
    are blocked in this thread meanwhile, so threads started inside never receive them.

    Both are held by swapping their handlers, not only by the mask: a signal sent to the
    process is delivered to any thread that does not block it (one started before, such as the
    CLI's re-send timer), and Python then runs the handler in the main thread all the same: a
    SIGTERM did, inside the portal's start, and the process hung. At the end a held SIGINT is
    a KeyboardInterrupt; a held SIGTERM is raised again for the handler it had (the CLI's
    raises its Terminated; without one, the default ends the process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        held.append(signum)

    stop = (signal.SIGINT, signal.SIGTERM)
    # (a handler installed outside Python reads as None: that signal is left alone)
    previous = {s: h for s in stop if (h := signal.getsignal(s)) is not None}
    for s in previous:
        signal.signal(s, hold)
    # Threads started inside (the portal's loop thread, and every thread it starts in turn:
    # compute, expert pool, readers) inherit this mask, so SIGINT / SIGTERM always reach the
    # main thread, the one that acts on them (delivered to another thread while the main one
    # waits on a lock, a signal could go unnoticed until the work ended).
    mask = (
        signal.pthread_sigmask(signal.SIG_BLOCK, set(stop))
        if hasattr(signal, "pthread_sigmask")
        else None
    )
    try:
        yield
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a blocked signal lands now
        for s, h in previous.items():
            signal.signal(s, h)
    if signal.SIGTERM in held:
        signal.raise_signal(signal.SIGTERM)  # its handler decides (ignored: nothing happens)
    if signal.SIGINT in held:
        raise KeyboardInterrupt


class _PortalTask(Generic[R]):
    """``await fn(*args)`` started on a portal, cancellable from the blocking thread at any
    moment, before it began running too (``cancel_and_wait``)."""

    def __init__(
        self, portal: anyio.from_thread.BlockingPortal, fn: Callable[..., Awaitable[R]], *args: Any
    ) -> None:
        self._portal = portal
        self._scope: anyio.CancelScope | None = None
        self._cancelled = False

        async def run() -> R:
            self._scope = anyio.CancelScope()
            if self._cancelled:
                self._scope.cancel()
            with self._scope:
                return await fn(*args)
            raise anyio.get_cancelled_exc_class()  # cancelled: nothing to return

        self.future: concurrent.futures.Future[R] = portal.start_task_soon(run)

    def _cancel(self) -> None:  # on the loop
        self._cancelled = True
        if self._scope is not None:
            self._scope.cancel()

    def cancel_and_wait(self) -> None:
        """Cancel it on the loop and wait (``CANCEL_WAIT_S`` at most) for it to unwind; a
        second Ctrl-C stops waiting."""
        self._portal.call(self._cancel)
        with contextlib.suppress(concurrent.futures.CancelledError, TimeoutError):
            self.future.exception(timeout=CANCEL_WAIT_S)


class _EngineHost:
    """The portal task that keeps an :class:`Engine` open for :func:`open_model` (the engine's
    task group must be entered and left by one task). Ctrl-C while the model loads cancels the
    load there and waits for it to unwind, so nothing is left running."""

    def __init__(self, portal: anyio.from_thread.BlockingPortal, open_cm: Any) -> None:
        self._portal = portal
        self._open_cm = open_cm
        self._ready: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        self._stop: anyio.Event | None = None
        self._task: _PortalTask[None] | None = None

    async def _run(self) -> None:
        self._stop = anyio.Event()
        async with self._open_cm as engine:
            self._ready.set_result(engine)
            await self._stop.wait()

    def start(self) -> Engine:
        task = self._task = _PortalTask(self._portal, self._run)
        try:
            both: list[concurrent.futures.Future[Any]] = [self._ready, task.future]
            concurrent.futures.wait(both, return_when=concurrent.futures.FIRST_COMPLETED)
        except KeyboardInterrupt:
            task.cancel_and_wait()
            raise
        if self._ready.done():
            return self._ready.result()
        task.future.result()  # the open failed: its error
        raise ModelError("the engine stopped before it opened")

    def stop(self) -> None:
        """Close the engine (reader, threads, files) and re-raise what closing raised."""
        assert self._task is not None and self._stop is not None
        self._portal.call(self._stop.set)
        self._task.future.result()


@contextmanager
def open_model(
    path: str | os.PathLike[str] | None = None,
    ram_budget: int | str | None = None,
    progress: LoadProgress | None = None,
    **options: Any,
) -> Iterator[SyncModel]:
    """``with colibri.open_model(path) as model:`` — the sync API (see :class:`SyncModel`).

    Ctrl-C is safe at any moment: while the model loads, the load is cancelled and unwound;
    inside :meth:`SyncModel.call` (``generate``, ``forward``) the running work is cancelled
    first; either way the engine closes cleanly and the KeyboardInterrupt goes on."""
    opts = EngineOptions(**options)
    with contextlib.ExitStack() as stack:
        with _sigint_deferred():
            portal = stack.enter_context(anyio.from_thread.start_blocking_portal())
        host = _EngineHost(
            portal, Engine.open(path, ram_budget=ram_budget, options=opts, progress=progress)
        )
        engine = host.start()
        try:
            yield SyncModel(portal, engine)
        finally:
            # Closing reaps the reads in flight and saves state; an interrupt here still waits
            # for it (the portal's exit waits for the engine's task).
            host.stop()

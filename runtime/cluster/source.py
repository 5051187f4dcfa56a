"""The coordinator's side of a cluster: routed experts computed by the workers that own them.

:class:`ClusterExperts` is the model's expert source when experts live on cluster workers.
Per MoE layer and step (:func:`runtime.scheduler.moe_step`):

1. :meth:`ClusterExperts.send`: the step's expert union is split by owner; each live worker
   gets **one** request with the rows routed to its experts (the union over every sequence of
   the step; a prefill chunk whole) and those experts. Every request is out before any reply is
   awaited; the coordinator computes the shared expert meanwhile.
2. :meth:`ClusterExperts.collect`: experts whose owner is down are computed here from the
   coordinator's own reads of the model files; then each reply is awaited until the step's
   deadline. A worker that failed or missed the deadline is marked down, its experts of this
   step are computed here (the answer unchanged, the event counted), and it is probed again
   later: when it answers (Ray restarted it, or it caught up) it is given its share again and
   rejoins.
3. The caller combines every expert's output in ascending expert id, as for local experts, so
   greedy tokens and logits are bit-identical to a single process.

The transport is a :class:`WorkerLink` (:mod:`runtime.cluster.ray_backend` implements it on Ray
actors); this module never imports Ray.

Shape legend: T rows of the step, D hidden, K experts per token, n rows sent to one worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import structlog

from runtime.cluster.wire import pack_request, unpack_reply
from runtime.weights import ExpertSource, ExpertWeights, Guess, Lookahead
from storage.errors import ColibriError

if TYPE_CHECKING:
    from runtime.compute import ExpertCompute

__all__ = ["ClusterExperts", "PendingStep", "WorkerFailed", "WorkerLink", "WorkerState"]

_log = structlog.get_logger(__name__)

Key = tuple[int, int]
F32Array = npt.NDArray[np.float32]
R = TypeVar("R")
ExpertResult = tuple[npt.NDArray[np.intp], F32Array]


class WorkerFailed(ColibriError):
    """A worker call failed: the worker died, is restarting, raised, or missed its deadline
    (``timed_out``)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class WorkerLink(Protocol):
    """One worker as the coordinator reaches it (calls are asynchronous)."""

    name: str

    def call(self, method: str, *args: Any) -> Any:
        """Start ``method(*args)`` on the worker; returns a handle for :meth:`result`."""
        ...

    def result(self, handle: Any, timeout: float) -> Any:
        """The call's value, waiting at most ``timeout`` seconds; raises :class:`WorkerFailed`."""
        ...

    def done(self, handle: Any) -> bool:
        """Whether the call has finished (its :meth:`result` will not wait)."""
        ...


@dataclass
class WorkerState:
    """The coordinator's view of one worker (``stats()["cluster"]["workers"]``)."""

    name: str
    share: int  # keys it owns
    alive: bool = True
    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    rejoins: int = 0
    experts: int = 0  # expert computations it answered
    rows: int = 0  # rows sent to it
    call_s: float = 0.0  # submit -> reply in hand, summed over answered calls
    remote_s: float = 0.0  # of it, the worker's own compute time
    fallback_experts: int = 0  # its experts the coordinator computed instead
    last_error: str = ""
    remote: dict[str, Any] = field(default_factory=dict)  # its own counters, store stats, mode
    probe: Any = None  # an in-flight health check
    reload: Any = None  # an in-flight reload of its share (after a restart)
    probed_at: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        store = self.remote
        return {
            "name": self.name,
            "alive": self.alive,
            "experts_owned": self.share,
            "calls": self.calls,
            "failures": self.failures,
            "timeouts": self.timeouts,
            "rejoins": self.rejoins,
            "experts_computed": self.experts,
            "rows": self.rows,
            "call_ms_mean": 1e3 * self.call_s / self.calls if self.calls else 0.0,
            "overhead_ms_mean": (
                1e3 * (self.call_s - self.remote_s) / self.calls if self.calls else 0.0
            ),
            "fallback_experts": self.fallback_experts,
            "hits": int(store.get("hits", 0)),
            "misses": int(store.get("misses", 0)),
            "reads": int(store.get("reads", 0)),
            "bytes_read": int(store.get("bytes_read", 0)),
            "mode": self.remote.get("mode", ""),
            "kernels": dict(self.remote.get("kernels", {})),  # its variant, ISA and mode
            "last_error": self.last_error,
        }


def _remember(ws: WorkerState, info: Mapping[str, Any]) -> None:
    """Keep a worker's own report (``info()`` / ``load()``: mode, counters, store stats)."""
    ws.remote.update(info.get("counters", {}))
    ws.remote.update(info.get("store", {}))
    for key in ("mode", "kernels"):
        if key in info:
            ws.remote[key] = info[key]


@dataclass
class _Sent:
    worker: int
    experts: list[int]
    rows: npt.NDArray[np.intp]
    handle: Any
    t0: float


@dataclass
class PendingStep:
    """One layer's requests in flight (from :meth:`ClusterExperts.send`)."""

    layer: int
    x: F32Array
    ids: npt.NDArray[np.int64]
    gates: F32Array
    sent: list[_Sent]
    local: list[int]  # experts whose owner was down at send time
    deadline: float


class ClusterExperts:
    """Expert source whose routed experts are computed by the workers owning them."""

    def __init__(
        self,
        links: Sequence[WorkerLink],
        owners: Mapping[Key, Sequence[int]],
        local: ExpertSource,
        *,
        load_args: Sequence[tuple[Any, ...]],
        infos: Sequence[Mapping[str, Any]] = (),
        deadline_s: float = 10.0,
        probe_every_s: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``owners``: each key's workers best first (:func:`runtime.cluster.placement.assign`);
        the first owns it. ``local``: the coordinator's own reads (fallback). ``load_args``:
        per worker, the arguments of its ``load`` call (resent when it comes back empty);
        ``infos``: what each worker reported when it loaded."""
        self.links = list(links)
        self.owner = {k: int(v[0]) for k, v in owners.items()}
        self.local = local
        self.load_args = list(load_args)
        self.deadline_s = deadline_s
        self.probe_every_s = probe_every_s
        self._clock = clock
        counts = [0] * len(self.links)
        for w in self.owner.values():
            counts[w] += 1
        self.workers = [WorkerState(link.name, counts[i]) for i, link in enumerate(self.links)]
        for ws, info in zip(self.workers, infos, strict=False):
            _remember(ws, info)  # what each said when it loaded its share
        self.steps = 0
        self.fallback_experts = 0  # expert computations done here because a worker was down
        self.fallback_events = 0  # (worker, step) pairs that fell back
        self.wait_s = 0.0  # compute thread blocked on replies

    # ------------------------------------------------------------------ ExpertSource
    # Only fallbacks and lookahead hints reach these; routed experts go through send/collect.
    def wants_lookahead(self, layer: int) -> bool:
        return False  # the owners read their own experts

    def arrivals(
        self, layer: int, experts: Sequence[int], lookahead: Lookahead | None = None
    ) -> Iterator[tuple[int, ExpertWeights]]:
        return self.local.arrivals(layer, experts)  # (no lookahead for fallbacks)

    def map_arrivals(
        self,
        layer: int,
        experts: Sequence[int],
        fn: Callable[[int, ExpertWeights], R],
        pool: Executor,
        guess: Guess | None = None,
        early: Callable[[int, ExpertWeights], Callable[[], R] | None] | None = None,
        *,
        started: Callable[[], None] | None = None,
    ) -> dict[int, R]:
        return self.local.map_arrivals(layer, experts, fn, pool, early=early, started=started)

    def prefetch(self, layer: int, experts: Sequence[int], cpu_s: float = 0.0) -> None:
        """Lookahead hints are not forwarded (each worker reads its own)."""

    # ------------------------------------------------------------------ one layer's step
    def send(
        self,
        layer: int,
        union: Sequence[int],
        x: F32Array,
        ids: npt.NDArray[np.int64],
        gates: F32Array,
    ) -> PendingStep:
        """Send each live owner its experts of ``union`` and the rows routed to them."""
        self._heal()
        self.steps += 1
        by_worker: dict[int, list[int]] = {}
        local: list[int] = []
        down: set[int] = set()
        for e in union:
            w = self.owner.get((layer, int(e)))
            if w is None:
                raise ColibriError(f"layer {layer} expert {e} has no owner in the cluster")
            if self.workers[w].alive:
                by_worker.setdefault(w, []).append(int(e))
            else:
                local.append(int(e))
                # counted against the worker that was down too (its series counted only the
                # step it failed in, far below the total)
                self.workers[w].fallback_experts += 1
                down.add(w)
        self.fallback_events += len(down)
        sent = []
        t0 = self._clock()
        for w, experts in sorted(by_worker.items()):
            rows = np.nonzero(np.isin(ids, experts).any(axis=1))[0]  # [n]
            handle = self.links[w].call(
                "compute_packed", pack_request(layer, experts, x[rows], ids[rows], gates[rows])
            )
            self.workers[w].rows += int(rows.size)
            sent.append(_Sent(w, experts, rows, handle, t0))
        if local:
            self.fallback_experts += len(local)
        return PendingStep(layer, x, ids, gates, sent, local, t0 + self.deadline_s)

    def collect(
        self,
        step: PendingStep,
        comp: ExpertCompute,
        fn: Callable[[int, ExpertWeights], ExpertResult],
        macs_per_expert_row: int,
    ) -> dict[int, ExpertResult]:
        """Every expert's (rows, output) of ``step``: fallbacks computed here, replies awaited
        until the deadline (a failed worker's experts computed here too)."""
        out: dict[int, ExpertResult] = {}
        if step.local:
            out.update(self._local(comp, step, step.local, fn, macs_per_expert_row))
        for s in step.sent:
            ws, link = self.workers[s.worker], self.links[s.worker]
            t_wait = self._clock()
            try:
                reply, info = unpack_reply(link.result(s.handle, max(0.0, step.deadline - t_wait)))
            except WorkerFailed as exc:
                self.wait_s += self._clock() - t_wait
                self._down(s.worker, exc)
                ws.fallback_experts += len(s.experts)
                self.fallback_experts += len(s.experts)
                self.fallback_events += 1
                out.update(self._local(comp, step, s.experts, fn, macs_per_expert_row))
                continue
            now = self._clock()
            self.wait_s += now - t_wait
            ws.calls += 1
            ws.call_s += now - s.t0
            ws.remote_s += info["s"]
            ws.experts += len(reply)
            ws.remote.update(info)
            for e, rows, y in reply:
                out[int(e)] = (s.rows[rows], y)
        return out

    def _local(
        self,
        comp: ExpertCompute,
        step: PendingStep,
        experts: list[int],
        fn: Callable[[int, ExpertWeights], ExpertResult],
        macs_per_expert_row: int,
    ) -> dict[int, ExpertResult]:
        macs = int(np.isin(step.ids, experts).sum()) * macs_per_expert_row
        return comp.run(self.local, step.layer, experts, fn, macs=macs)

    # ------------------------------------------------------------------ health
    def _down(self, w: int, exc: WorkerFailed) -> None:
        ws = self.workers[w]
        if exc.timed_out:
            ws.timeouts += 1
        else:
            ws.failures += 1
        ws.last_error = str(exc)
        if ws.alive:
            _log.warning(
                "expert worker down; its experts are computed here until it answers",
                worker=ws.name,
                error=str(exc),
            )
        ws.alive = False
        ws.probe = ws.reload = None
        ws.probed_at = self._clock()

    def _heal(self) -> None:
        """Probe down workers (at most every ``probe_every_s``); one that answers empty (Ray
        restarted it) gets its share again, one that answers with its share rejoins."""
        now = self._clock()
        for w, ws in enumerate(self.workers):
            if ws.alive:
                continue
            link = self.links[w]
            try:
                if ws.reload is not None:
                    if link.done(ws.reload):
                        info = link.result(ws.reload, 0.0)
                        ws.reload = None
                        self._rejoin(w, info)
                elif ws.probe is not None:
                    if link.done(ws.probe):
                        info = link.result(ws.probe, 0.0)
                        ws.probe = None
                        if info.get("experts") == ws.share and info.get("mode") != "empty":
                            self._rejoin(w, info)
                        else:
                            ws.reload = link.call("load", *self.load_args[w])
                elif now - ws.probed_at >= self.probe_every_s:
                    ws.probed_at = now
                    ws.probe = link.call("info")
            except WorkerFailed as exc:
                ws.probe = ws.reload = None
                ws.probed_at = now
                ws.last_error = str(exc)

    def _rejoin(self, w: int, info: Mapping[str, Any]) -> None:
        ws = self.workers[w]
        ws.alive = True
        ws.rejoins += 1
        _remember(ws, info)
        _log.info("expert worker rejoined", worker=ws.name, mode=info.get("mode"))

    # ------------------------------------------------------------------ report
    def as_dict(self) -> dict[str, Any]:
        return {
            "workers": [ws.as_dict() for ws in self.workers],
            "steps": self.steps,
            "fallback_experts": self.fallback_experts,
            "fallback_events": self.fallback_events,
            "wait_s": self.wait_s,
            "deadline_s": self.deadline_s,
        }

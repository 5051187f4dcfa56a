"""One expert worker of a cluster: its share of the routed experts, on its own host.

:class:`ExpertWorker` is plain Python (the Ray actor in :mod:`runtime.cluster.ray_backend`
wraps it): it opens the model files on its host, probes their read bandwidth, and once told
its share (:meth:`ExpertWorker.load`) keeps it in the normal expert store: all of the share in
RAM when it fits the worker's budget, else the tiered store (pinned set from the worker's own
``.coli_usage``, per-layer LRU, io_uring reads on its own disks and ``--mirror`` copies, which
must be at the same paths on every worker host).

:meth:`ExpertWorker.compute` is one MoE layer's request: the rows routed to the worker's
experts and the experts, answered with each expert's gate-weighted output on its rows,
computed by the same batch-invariant kernels the coordinator would use, so a row's result
does not depend on where it was computed (given the same kernel variant, which the
coordinator checks).

Shape legend: n rows sent, D hidden, K experts per token, key = (layer, expert).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from runtime.cluster.wire import pack_reply, unpack_request
from runtime.compute import ExpertCompute, KernelMode
from runtime.kernels.isa import kernel_info
from runtime.weights import ExpertSource, ResidentExperts
from storage.container import Container
from storage.errors import ColibriError
from storage.integrity import ExpertChecksums, load_checksums
from storage.kvfile import model_identity

__all__ = ["ExpertOutput", "ExpertWorker", "WorkerCounters"]

Key = tuple[int, int]
F32Array = npt.NDArray[np.float32]
# One expert's answer: (expert id, rows of the request it applies to [n_e], output [n_e, D]).
ExpertOutput = tuple[int, npt.NDArray[np.intp], F32Array]

WORKER_ENGINE_ID = "colibri-py-1"  # the .coli_usage header the coordinator's engine writes too
USAGE_SAVE_EVERY = 256  # requests between saves of the worker's .coli_usage
AUTO_FRACTION = 0.88  # of MemAvailable (shared by the workers of one host), as Engine.open


@dataclass
class WorkerCounters:
    """What a worker did since it started (sent back with every reply)."""

    requests: int = 0
    experts: int = 0
    rows: int = 0
    compute_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


class _StoreHost:
    """The tiered expert store on its own event loop (a blocking portal's thread)."""

    def __init__(
        self,
        container: Container,
        budget: int,
        reader: str,
        pinned: list[Key],
        mirrors: Sequence[Path] = (),
        state_dir: Path | None = None,
        *,
        checksums: ExpertChecksums | None = None,
    ) -> None:
        from runtime.experts import ExpertStore, StreamingExperts, plan_layout
        from storage.multidisk.probing import open_placement
        from storage.reader import open_reader

        self._cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._cm.__enter__()
        layout = plan_layout(container, budget, top_k=container.arch.top_k, pinned=pinned)
        self._stop: anyio.Event | None = None

        async def host(*, task_status: Any) -> None:
            extents = container.expert_extents()
            rd = await open_reader(reader, probe_path=extents[0].path if extents else None)  # type: ignore[arg-type]
            self._stop = anyio.Event()
            try:
                # this host's copies: the model dir and its --mirror dirs (reads spread, failover)
                placement = await open_placement(
                    container,
                    list(mirrors),
                    state_dir=state_dir if mirrors else None,
                    direct=rd.direct,
                )
                async with anyio.create_task_group() as tg:
                    store = ExpertStore(
                        container,
                        rd,
                        layout,
                        prefetch="off",
                        placement=placement,
                        checksums=checksums,
                    )
                    await store.start(tg)
                    task_status.started(store)
                    await self._stop.wait()
                    tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):
                    await rd.aclose()

        self._task, self.store = self.portal.start_task(host)
        self.source: ExpertSource = StreamingExperts(self.store)

    def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on a worker thread of the store's loop (what StreamingExperts needs)."""
        return self.portal.call(lambda: anyio.to_thread.run_sync(fn, *args))

    def close(self) -> None:
        if self._stop is not None:
            self.portal.call(self._stop.set)
        try:
            self._task.result(timeout=10)
        finally:
            self._cm.__exit__(None, None, None)


class ExpertWorker:
    """A share of a model's routed experts and the compute that applies them."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        model_dirs: Sequence[str | os.PathLike[str]] = (),
        mirrors: Sequence[str | os.PathLike[str]] = (),
        reader: str = "auto",
        state_dir: str | os.PathLike[str] | None = None,
        probe_s: float = 0.3,
        kernels: KernelMode = "exact",
        verify_reads: bool = False,
    ) -> None:
        """``kernels``: the coordinator's kernel mode (its lossy fast-int8 included): a worker
        on another mode gave logits that matched neither the exact nor the fast-int8 run.
        ``verify_reads`` (the coordinator's ``--verify-reads``): every expert this worker loads
        or reads is checked against the manifest's CRC-32 (a damaged copy on a worker's host
        gave wrong tokens with the coordinator's own reads checked)."""
        # the coordinator's --model-dir list, as far as this host has those directories: a
        # worker whose model directory holds every shard was refused for a directory only
        # the coordinator has (the identity check below still finds other files)
        dirs = [Path(d) for d in model_dirs if Path(d).is_dir()]
        self.container = Container.open(Path(model), shard_dirs=dirs)
        self.checksums: ExpertChecksums | None = None
        if verify_reads:
            self.checksums = load_checksums(self.container.path)
        # the fingerprint of this host's copy (the coordinator refuses a worker on another
        # model or another conversion: its experts would give other tokens, silently)
        self.identity = model_identity(
            self.container.path, shards=[sh.path for sh in self.container.shards]
        )
        self.kernel_mode: KernelMode = kernels
        self.arch = self.container.arch
        self.reader = reader
        self.mirrors = [Path(m) for m in mirrors]
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.kernels = kernel_info(mode=kernels).as_dict()
        self.read_bps = self._probe(probe_s)
        self.counters = WorkerCounters()
        self.keys: frozenset[Key] = frozenset()
        self.mode = "empty"
        self._source: ExpertSource | None = None
        self._host: _StoreHost | None = None
        self._compute = ExpertCompute(1, kernels=kernels)
        self._usage: Any = None
        self._since_save = 0

    def _probe(self, seconds: float) -> float:
        """Read bandwidth of this host's copy of the expert shards (bytes/s; 0: none)."""
        from storage.multidisk.probing import probe_read_bandwidth

        ext = self.container.expert_extents()
        if not ext or seconds <= 0:
            return 1.0
        try:
            return probe_read_bandwidth(
                Path(ext[0].path), ext[0].end - ext[0].start, seconds=seconds, max_reads=16
            )
        except OSError:
            return 0.0

    # ------------------------------------------------------------------ control
    def info(self) -> dict[str, Any]:
        """Who this worker is and what it holds (the coordinator's health check)."""
        from runtime.budget import mem_available

        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "model": str(self.container.path),
            "identity": self.identity,
            "verify_reads": self.checksums is not None,
            "mem_available": mem_available() or 0,
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1,
            "read_bps": self.read_bps,
            "kernels": self.kernels,
            "mode": self.mode,
            "experts": len(self.keys),
            "counters": self.counters.as_dict(),
            "store": self._store_stats(),
        }

    def load(self, keys: Sequence[Key], ram_budget: int | None, threads: int = 1) -> dict[str, Any]:
        """Hold ``keys``: in RAM when they fit ``ram_budget`` (None: 88% of MemAvailable), else
        streamed through the tiered store inside that budget. Replaces any earlier share."""
        from runtime.budget import mem_available

        self.close_share()
        keys = sorted((int(a), int(b)) for a, b in keys)
        ext = self.container.expert_extents()
        one = (
            ext[0].nbytes + sum(s.nbytes for s in ext[0].scales.values() if s is not None)
            if ext
            else 0
        )
        budget = ram_budget
        if budget is None:
            budget = int(AUTO_FRACTION * (mem_available() or 0))
        self._compute.close()
        self._compute = ExpertCompute(max(1, threads), kernels=self.kernel_mode)
        self._load_usage()
        if len(keys) * one <= budget:
            self._source = ResidentExperts(self.container, keys=keys, checksums=self.checksums)
            self.mode = "resident"
        else:
            pinned = self._pinned(keys, budget, one)
            self._host = _StoreHost(
                self.container,
                budget,
                self.reader,
                pinned,
                self.mirrors,
                self.state_dir,
                checksums=self.checksums,
            )
            self._source = self._host.source
            self.mode = "streaming"
        self.keys = frozenset(keys)
        self._warm_up()
        return self.info()

    def _warm_up(self) -> None:
        """Compile the kernels now, not inside the first (deadline-bound) requests: one row
        (a decode step) and several (batched steps and prefill chunks take other kernels;
        warmed on one row only, a fresh machine's workers compiled those inside the first
        prompt's requests and every one missed the default --expert-timeout)."""
        if not self.keys:
            return
        layer, e = min(self.keys)
        for rows in (1, 2, 8, 64):
            x = np.zeros((rows, self.arch.hidden_size), dtype=np.float32)
            ids = np.full((rows, 1), e, dtype=np.int64)
            gates = np.ones((rows, 1), dtype=np.float32)
            self.compute(layer, [e], x, ids, gates, count=False)

    def _load_usage(self) -> None:
        if self.state_dir is None or self._usage is not None:
            return
        from storage.usage import USAGE_FILE, UsageCounts, load_usage

        a = self.arch
        path = self.state_dir / USAGE_FILE
        try:
            self._usage = load_usage(path, a.total_layers, a.n_routed_experts, WORKER_ENGINE_ID)
        except ColibriError:
            self._usage = None
        if self._usage is None:
            self._usage = UsageCounts(a.total_layers, a.n_routed_experts)

    def _pinned(self, keys: Sequence[Key], budget: int, one: int) -> list[Key]:
        """The hottest experts of the share by this worker's own history (half the budget)."""
        from runtime.policies.pin import choose_pinned

        if self._usage is None or one <= 0:
            return []
        counts = np.zeros_like(self._usage.counts)
        for layer, e in keys:
            counts[layer, e] = self._usage.counts[layer, e]
        return choose_pinned(
            counts, self.container.expert_layers(), budget // 2 // one, min_total=5000
        )

    def save_usage(self) -> None:
        if self.state_dir is None or self._usage is None:
            return
        from storage.usage import USAGE_FILE, save_usage

        self.state_dir.mkdir(parents=True, exist_ok=True)
        save_usage(self.state_dir / USAGE_FILE, self._usage, WORKER_ENGINE_ID)
        self._since_save = 0

    def close_share(self) -> None:
        if self._host is not None:
            self._host.close()
        self._host = None
        self._source = None
        self.keys = frozenset()
        self.mode = "empty"

    def close(self) -> None:
        self.save_usage()
        self.close_share()
        self._compute.close()

    # ------------------------------------------------------------------ compute
    def compute(
        self,
        layer: int,
        experts: Sequence[int],
        x: F32Array,
        ids: npt.NDArray[np.int64],
        gates: F32Array,
        *,
        count: bool = True,
    ) -> tuple[list[ExpertOutput], dict[str, Any]]:
        """Experts ``experts`` of ``layer`` on the rows ``x`` [n, D] routed to them (``ids`` /
        ``gates`` [n, K] are those rows' routing): each expert's (rows, output), and this
        worker's counters."""
        if self._source is None:
            raise ColibriError("this worker holds no experts yet (load was not called)")
        missing = [e for e in experts if (layer, int(e)) not in self.keys]
        if missing:
            raise ColibriError(f"layer {layer}: experts {missing} are not in this worker's share")
        t0 = time.perf_counter()
        comp, src = self._compute, self._source
        wanted = [int(e) for e in experts]

        def run() -> dict[int, tuple[npt.NDArray[np.intp], F32Array]]:
            return comp.run(
                src,
                layer,
                wanted,
                lambda e, w: comp.expert_output(x, ids, gates, e, w),
                macs=int(ids.size) * 3 * self.arch.hidden_size * self.arch.moe_intermediate_size,
            )

        outs = self._host.call(run) if self._host is not None else run()
        dt = time.perf_counter() - t0
        if count:
            c = self.counters
            c.requests += 1
            c.experts += len(wanted)
            c.rows += int(x.shape[0])
            c.compute_s += dt
            if self._usage is not None:
                self._usage.add(layer, ids[np.isin(ids, wanted)])
                self._since_save += 1
                if self._since_save >= USAGE_SAVE_EVERY:
                    self.save_usage()
        reply = [(e, outs[e][0], outs[e][1]) for e in wanted]
        return reply, {"counters": self.counters.as_dict(), "store": self._store_stats(), "s": dt}

    def compute_packed(self, request: bytes) -> bytes:
        """:meth:`compute` over the wire format (:mod:`runtime.cluster.wire`)."""
        layer, experts, x, ids, gates = unpack_request(request)
        if not experts:
            return pack_reply([], {}, self.arch.hidden_size)
        reply, info = self.compute(layer, experts, x, ids, gates)
        flat = {**info["counters"], **info["store"], "s": info["s"]}
        return pack_reply(reply, flat, self.arch.hidden_size)

    def _store_stats(self) -> dict[str, Any]:
        """Hits, reads and bytes of this worker's expert store (a resident share only hits)."""
        if self._host is not None:
            store = self._host.store
            st = store.stats
            out: dict[str, Any] = {
                "hits": st.hits_pinned + st.hits_lru,
                "misses": st.misses,
                "reads": st.experts_read,
                "bytes_read": st.bytes_read,
            }
            if store.placement is not None and len(store.placement.copies) > 1:
                out["devices"] = [
                    {"root": c.root, "reads": c.reads, "bytes": c.bytes, "demoted": c.demoted}
                    for c in store.placement.copy_stats()
                ]
            return out
        return {"hits": self.counters.experts, "misses": 0, "reads": 0, "bytes_read": 0}

"""What ``Engine.snapshot()`` returns: the engine's counters as typed, frozen dataclasses.

``Engine.stats()`` is ``snapshot().as_dict()``: the one place they become JSON (the CLI's
``--stats``, the server's ``colibri`` objects and ``/profile``). ``/metrics``, ``/health`` and
the chat footer read the attributes. Each part is a copy taken at the call: later steps do not
change a snapshot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from runtime.policies.tiers import TierStats
from runtime.scheduler import SchedulerStats
from storage.multidisk.placement import CopyStats

__all__ = ["ComputeStats", "EngineStats", "ExpertsStats"]


@dataclass(frozen=True, slots=True)
class ComputeStats:
    """Threads and matmul choice (``stats()["compute"]``)."""

    threads: int
    parallel_steps: int  # MoE steps spread over the pool (decode and prefill)
    prefill_chunk: int
    fast_prefill: bool
    fast_prefill_matmuls: int  # projections computed by dequantize + BLAS
    kernels: dict[str, Any] | None = None  # runtime.kernels.isa.kernel_info(): variant, CPU ISA
    split_matmuls: int = 0  # one-token matmuls whose output features ran on every thread
    split_experts: int = 0  # routed experts computed in parts by every thread (uneven steps)
    early_experts: int = 0  # ... of them, streamed, begun before their down projection landed
    layer_calls: int = 0  # small resident MoE steps whose routed experts ran as one kernel call
    crew_runs: int = 0  # tables of kernel jobs run on the job crew (runtime/crew.py)
    crew_stood_aside: int = 0  # times the crew left its work to the pool (CPUs taken by others)


@dataclass(frozen=True, slots=True)
class ExpertsStats:
    """Where routed experts live and what the tiers served (``stats()["experts"]``)."""

    mode: Literal["resident", "streaming"]
    reader: str = ""
    reader_reason: str = ""
    slots_bytes: int = 0
    lru_slots_per_layer: int = 0
    pinned: int = 0
    transient_slots: int = 0
    fixed_buffers: bool = False
    tiers: TierStats | None = None  # streaming only
    devices: tuple[CopyStats, ...] | None = None  # with --mirror: one entry per copy
    placement: dict[str, Any] | None = None
    hugepages: dict[str, Any] | None = None  # streaming: THP mode, advice, huge-backed bytes

    def as_dict(self) -> dict[str, Any]:
        if self.mode == "resident":
            return {"mode": "resident"}
        d: dict[str, Any] = {
            "mode": self.mode,
            "reader": self.reader,
            "reader_reason": self.reader_reason,
            "slots_bytes": self.slots_bytes,
            "lru_slots_per_layer": self.lru_slots_per_layer,
            "pinned": self.pinned,
            "transient_slots": self.transient_slots,
            "fixed_buffers": self.fixed_buffers,
        }
        if self.hugepages is not None:
            d["hugepages"] = dict(self.hugepages)
        if self.tiers is not None:
            d.update(self.tiers.as_dict())
        if self.devices is not None:
            d["devices"] = [dataclasses.asdict(c) for c in self.devices]
            d["placement"] = self.placement
        return d


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters since open. ``scheduler``: forwards, prefill and batching; the prompt and
    generated-token counters; ``compute``; ``speculative`` (drafting telemetry and the cost
    model, plain data); ``experts``."""

    scheduler: SchedulerStats
    prompt_tokens: int
    prompt_tokens_reused: int
    generated_tokens: int
    compute: ComputeStats
    speculative: dict[str, Any]
    experts: ExpertsStats
    cluster: dict[str, Any] | None = None  # --ray: per-worker calls, hits, reads, failures

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape of ``Engine.stats()`` (scheduler counters at the top level)."""
        return {
            **self.scheduler.as_dict(),
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_reused": self.prompt_tokens_reused,
            "generated_tokens": self.generated_tokens,
            "compute": dataclasses.asdict(self.compute),
            "speculative": self.speculative,
            "experts": self.experts.as_dict(),
            **({} if self.cluster is None else {"cluster": self.cluster}),
        }

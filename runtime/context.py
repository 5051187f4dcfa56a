"""What one forward call computes with: a frozen per-call context.

A model holds its config, its weights and its expert source; it keeps no per-call settings.
Everything that may differ between two calls on the same model (decode and a prefill chunk under
``--fast-prefill``, a speculative verify that records its unions, a test that traces routing)
travels in a :class:`StepContext` passed to ``forward`` / ``forward_batch`` / ``mtp_step``:

* ``compute``: the :class:`~runtime.compute.ExpertCompute` (thread pool, matmul choice);
* ``observer``: called with routing and DSA decisions (telemetry, learned pinning, tests);
* ``attention_mode``: MLA evaluation order ("absorbed", the batch-invariant default; "auto",
  the labelled ``--fast-prefill`` choice per call; "reconstruct");
* ``timing``: where ``moe_step`` adds the seconds it took (for the time breakdown).

Contexts are immutable; :meth:`StepContext.replace` and :meth:`StepContext.observing` derive a
new one, so two calls can never see each other's settings.

Shape legend: no arrays (the settings of a call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy.typing as npt

from runtime.compute import ExpertCompute

__all__ = ["AttentionMode", "Observer", "StepContext", "StepTiming"]

AttentionMode = Literal["auto", "absorbed", "reconstruct"]
# observer(event, layer, array): "route" (expert ids [T, K]), "dsa_scores" ([T, S]),
# "dsa_select" (kept keys [T, S] bool); for telemetry and tests. MTP layers report their own
# layer index (num_hidden_layers + i).
Observer = Callable[[str, int, npt.NDArray[Any]], None]


@dataclass
class StepTiming:
    """Seconds the compute thread spent in ``moe_step`` (routing, expert compute and waiting
    for expert reads), accumulated over calls; the scheduler splits it (see
    ``runtime.scheduler.TimeBreakdown``). Shared by the contexts derived from one another."""

    moe_s: float = 0.0


@dataclass(frozen=True)
class StepContext:
    """The settings of one forward call (see the module docstring). The default is serial,
    exact, absorbed and unobserved: what a test or a one-off call wants."""

    compute: ExpertCompute = field(default_factory=ExpertCompute)
    observer: Observer | None = None
    attention_mode: AttentionMode = "absorbed"
    timing: StepTiming = field(default_factory=StepTiming)

    def replace(self, **changes: Any) -> StepContext:
        """A copy with ``changes`` (field names as keywords)."""
        return dataclasses.replace(self, **changes)

    def observing(self, observer: Observer) -> StepContext:
        """A copy that calls ``observer`` after this context's own observer (if any)."""
        prev = self.observer
        if prev is None:
            return self.replace(observer=observer)

        def both(event: str, layer: int, arr: npt.NDArray[Any]) -> None:
            prev(event, layer, arr)
            observer(event, layer, arr)

        return self.replace(observer=both)

    def observe(self, event: str, layer: int, arr: npt.NDArray[Any]) -> None:
        if self.observer is not None:
            self.observer(event, layer, arr)

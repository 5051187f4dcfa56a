"""Telemetry of speculative decoding across generations.

Shape legend: see ``runtime.speculative``; no arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.speculative._common import SOURCES


@dataclass
class SpecStats:
    """Counters across generations (``engine.stats()["speculative"]``)."""

    rounds: int = 0
    verify_steps: int = 0  # forwards with drafts
    plain_steps: int = 0  # forwards without
    tokens: int = 0  # tokens emitted by rounds
    probes: int = 0
    seconds: float = 0.0  # wall time of rounds (drafting + verify + acceptance)
    draft_seconds: float = 0.0
    plain_seconds: float = 0.0  # wall time of the rounds without drafts
    model_seconds: float = 0.0  # the cost model's estimate of all tokens decoded plainly
    # rounds whose verify forward shared the engine's batched step with other generations
    batched_rounds: int = 0
    batched_verify_rounds: int = 0  # of those, rounds with drafts
    batched_tokens: int = 0
    batched_proposed: int = 0
    batched_accepted: int = 0
    proposed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))

    def as_dict(self) -> dict[str, Any]:
        steps = self.verify_steps + self.plain_steps
        return {
            "rounds": self.rounds,
            "verify_steps": self.verify_steps,
            "plain_steps": self.plain_steps,
            "tokens": self.tokens,
            "probes": self.probes,
            "seconds": self.seconds,
            "draft_seconds": self.draft_seconds,
            "batched_rounds": self.batched_rounds,
            "batched_verify_rounds": self.batched_verify_rounds,
            "batched_tokens": self.batched_tokens,
            "batched_proposed": self.batched_proposed,
            "batched_accepted": self.batched_accepted,
            "proposed": dict(self.proposed),
            "accepted": dict(self.accepted),
            "acceptance": {
                s: self.accepted[s] / self.proposed[s] if self.proposed[s] else None
                for s in SOURCES
            },
            "tokens_per_forward": self.tokens / steps if steps else None,
            "estimated_speedup": self.estimated_speedup(),
        }

    def estimated_speedup(self) -> float | None:
        """Tokens/s of the rounds over plain decoding: the measured mean time of a plain round
        (once there are some) or else the cost model's estimate, times the tokens emitted,
        over the time the rounds took."""
        if self.seconds <= 0:
            return None
        if self.plain_steps >= 8:
            return self.tokens * (self.plain_seconds / self.plain_steps) / self.seconds
        return self.model_seconds / self.seconds

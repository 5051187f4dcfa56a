"""Token sampling: greedy, temperature, top-k, top-p with a seeded generator.

# V vocab
Same seed and same logits -> same tokens, on every machine (numpy PCG64, float64 probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Sampler", "SamplingParams", "log_softmax"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature == 0`` means greedy (argmax; ties -> lowest id, like numpy/torch argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def log_softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    x = logits.astype(np.float64)  # [V]
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


class Sampler:
    """Stateful sampler for one generation (owns its random generator)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.Generator(np.random.PCG64(params.seed))

    def probs(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
        """The distribution actually sampled from (after temperature, top-k, top-p)."""
        p = self.params
        x = logits.astype(np.float64) / max(p.temperature, 1e-6)  # [V]
        if p.top_k and p.top_k < x.size:
            # kth largest value; keep ties at the boundary out beyond k by stable order
            order = np.argsort(-x, kind="stable")
            mask = np.full(x.shape, -np.inf)
            mask[order[: p.top_k]] = 0.0
            x = x + mask
        x = x - x.max()
        e = np.exp(x)
        probs = e / e.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            keep = int(np.searchsorted(cum, p.top_p) + 1)  # smallest prefix with mass >= top_p
            kept = np.zeros_like(probs)
            kept[order[:keep]] = probs[order[:keep]]
            probs = kept / kept.sum()
        return probs

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        probs = self.probs(logits)
        u = self._rng.random()
        idx = int(np.searchsorted(np.cumsum(probs), u, side="right"))
        return min(idx, probs.size - 1)

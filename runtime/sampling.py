"""Token sampling: greedy, temperature, top-k, top-p with a seeded generator.

Same seed and same logits -> same tokens, on every machine (numpy PCG64, float64 probabilities).

Shape legend: V vocab.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from storage.errors import ModelError

__all__ = ["LogitNorm", "Sampler", "SamplingParams", "log_softmax", "logit_norm"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature == 0`` means greedy (argmax; ties -> lowest id, like numpy/torch argmax).

    ``top_k == 0`` and ``top_p == 1`` switch those filters off. ``seed`` None draws fresh
    entropy. Bad values raise :class:`~storage.errors.ModelError` (a ``ColibriError``)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        # `not (x >= 0)` also rejects NaN, which every plain comparison lets through.
        if not math.isfinite(self.temperature) or not self.temperature >= 0:
            raise ModelError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ModelError(f"top_p must be in (0, 1], got {self.top_p}")
        if _as_int(self.top_k) is None or self.top_k < 0:
            raise ModelError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (_as_int(self.seed) is None or self.seed < 0):
            raise ModelError(f"seed must be an integer >= 0 or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _as_int(x: object) -> int | None:
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)  # type: ignore[arg-type]  # int and numpy ints, not floats
    except TypeError:
        return None


@dataclass(frozen=True, slots=True)
class LogitNorm:
    """What a token's log-probability needs from its row of logits, in one scan
    (:func:`logit_norm`): whether every logit is finite, their max and ``log(sum(exp(x -
    max)))``."""

    finite: bool
    max: float
    log_sum: float

    def logprob(self, logits: npt.NDArray[np.float32], tok: int) -> float:
        """``log_softmax(logits)[tok]``, the same formula: ``(x[tok] - max) - log_sum``."""
        return (float(logits[tok]) - self.max) - self.log_sum


def logit_norm(logits: npt.NDArray[np.float32]) -> LogitNorm:
    """What one token's log-probability needs from ``logits`` [V] (any length >= 1): see
    :class:`LogitNorm`. The same arithmetic as :func:`log_softmax`, so ``logprob`` equals
    ``log_softmax(logits)[tok]`` bit for bit, without building the [V] result (about half
    its time: a max, a min and one exp-sum, numpy's vectorized ones)."""
    x = np.asarray(logits).reshape(-1)
    top, low = x.max(), x.min()  # NaN anywhere makes the max NaN
    if not (np.isfinite(top) and np.isfinite(low)):
        return LogitNorm(False, float(top), 0.0)
    x64 = x.astype(np.float64)
    m = np.float64(top)
    return LogitNorm(True, float(m), float(np.log(np.exp(x64 - m).sum())))


def log_softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    x = logits.astype(np.float64)  # [V]
    m = x.max()
    out: npt.NDArray[np.float64] = x - m - np.log(np.exp(x - m).sum())
    return out


class Sampler:
    """Stateful sampler for one generation (owns its random generator)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = None if params.seed is None else operator.index(params.seed)
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def probs(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
        """The distribution actually sampled from (after temperature, top-k, top-p)."""
        p = self.params
        x = logits.astype(np.float64) / max(p.temperature, 1e-6)  # [V]
        if p.top_k and p.top_k < x.size:
            # keep exactly k; ties at the boundary go to the lowest ids (stable order)
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
        out: npt.NDArray[np.float64] = probs
        return out

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        probs = self.probs(logits)
        cum = np.cumsum(probs)
        u = self._rng.random()
        idx = int(np.searchsorted(cum, u, side="right"))
        if idx >= probs.size:
            # u landed in the rounding gap above cum[-1] (< 1): take the last token that has
            # mass, never a filtered-out one
            idx = int(np.flatnonzero(probs)[-1])
        return idx

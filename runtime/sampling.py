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

__all__ = ["LogitNorm", "Sampler", "SamplingParams", "log_softmax", "logit_norm", "top_ids"]


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
        t = _as_real(self.temperature)
        if t is None or not math.isfinite(t) or not t >= 0:
            raise ModelError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        p = _as_real(self.top_p)
        if p is None or not 0 < p <= 1:
            raise ModelError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if _as_int(self.top_k) is None or self.top_k < 0:
            raise ModelError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (_as_int(self.seed) is None or self.seed < 0):
            raise ModelError(f"seed must be an integer >= 0 or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _as_real(x: object) -> float | None:
    """``x`` as a float when it is a real number (int, float, numpy scalar; never a bool, a
    string or None)."""
    if isinstance(x, bool) or not isinstance(x, int | float | np.integer | np.floating):
        return None
    return float(x)


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
    ``log_softmax(logits)[tok]`` bit for bit, without building the [V] result: a max, a min
    and one exp-sum, numpy's vectorized ones, in one float64 buffer (a fresh [V] temporary
    per operation cost 7x the arithmetic on a 155k vocabulary: new pages every time)."""
    x = np.asarray(logits).reshape(-1)
    top, low = x.max(), x.min()  # NaN anywhere makes the max NaN
    if not (np.isfinite(top) and np.isfinite(low)):
        return LogitNorm(False, float(top), 0.0)
    m = np.float64(top)
    e = x.astype(np.float64)
    e -= m
    np.exp(e, out=e)
    return LogitNorm(True, float(m), float(np.log(e.sum())))


def log_softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    x = logits.astype(np.float64)  # [V]
    x -= x.max()
    e = np.exp(x)
    x -= np.log(e.sum())
    return x


def top_ids(x: npt.NDArray[np.float64], n: int) -> npt.NDArray[np.intp]:
    """The first ``n`` ids of ``np.argsort(-x, kind="stable")`` (largest first, ties to the
    lowest id) without sorting all of ``x``: every id at or above a threshold that at least
    ``n`` values reach (so the ids of an upper part of that order, ties included), sorted
    stably. The threshold comes from an every-k-th sample of ``x`` (a guess: when fewer than
    ``n`` values reach it, a lower one is tried, and at last an exact partition)."""
    size = x.size
    if n >= size:
        return np.argsort(-x, kind="stable")
    step = max(1, size // _SAMPLE)
    sub = x[::step]
    m = sub.size
    want = 2 * n + 64  # aim above n: the sample only estimates ranks
    t = None
    for _ in range(3):
        r = min(m - 1, -(-want * m // size))  # the guess's rank in the sample (0: largest)
        guess = np.partition(sub, m - 1 - r)[m - 1 - r]
        if np.count_nonzero(x >= guess) >= n:
            t = guess
            break
        want *= 8
    if t is None:  # (the sample misled: exact)
        t = x[np.argpartition(-x, n - 1)[:n]].min()
    cand = np.flatnonzero(x >= t)  # ascending ids
    return cand[np.argsort(-x[cand], kind="stable")][:n]


#: Values of a [V] row sampled to guess where its leading ``n`` begin (:func:`top_ids`).
_SAMPLE = 4096


class Sampler:
    """Stateful sampler for one generation (owns its random generator)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = None if params.seed is None else operator.index(params.seed)
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def probs(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
        """The distribution actually sampled from (after temperature, top-k, top-p). Every
        step works in one float64 buffer and neither filter sorts the whole vocabulary (a
        partition finds the leading ids in their stable order): the bits of the plain
        formulation (argsort, masks, fresh arrays), at a fraction of its time on a large
        vocabulary (155k: 23 ms a token, on the event loop)."""
        p = self.params
        x = logits.astype(np.float64)
        x /= max(p.temperature, 1e-6)  # [V]
        if not np.isfinite(x.max()):  # NaN anywhere, +inf, or every token masked out
            raise ModelError(
                "cannot sample: the model produced non-finite logits (NaN or +inf; the weights "
                "are probably damaged: check them with `coli doctor --verify`, a mirror's with "
                "`coli mirror verify`), or they allow no token"
            )
        if p.top_k and p.top_k < x.size:
            # keep exactly k; ties at the boundary go to the lowest ids (stable order)
            keep = top_ids(x, p.top_k)
            vals = x[keep]
            x.fill(-np.inf)
            x[keep] = vals
        x -= x.max()
        np.exp(x, out=x)
        x /= x.sum()
        if p.top_p < 1.0:
            # the smallest prefix of the descending order with mass >= top_p: a cumulative
            # sum is sequential, so a long enough prefix of the order gives its first values
            n = min(x.size, 64)
            while True:
                order = top_ids(x, n)
                cum = np.cumsum(x[order])
                if cum[-1] >= p.top_p or n == x.size:
                    break
                n = min(x.size, 8 * n)
            idx = order[: int(np.searchsorted(cum, p.top_p) + 1)]
            vals = x[idx]
            x.fill(0.0)
            x[idx] = vals
            x /= x.sum()
        return x

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        p = self.params
        probs = self.probs(logits)
        # the inverse CDF; after a filter over the ids with mass only (a running sum grows
        # only where a token has mass, so the first id whose sum passes u is one of them:
        # the full sum's choice)
        nz = np.flatnonzero(probs) if p.top_p < 1.0 or 0 < p.top_k < probs.size else None
        cum = np.cumsum(probs if nz is None else probs[nz])
        u = self._rng.random()
        j = int(np.searchsorted(cum, u, side="right"))
        if j >= cum.size:
            # u landed in the rounding gap above cum[-1] (< 1): take the last token that has
            # mass, never a filtered-out one
            return int(np.flatnonzero(probs)[-1]) if nz is None else int(nz[-1])
        return j if nz is None else int(nz[j])

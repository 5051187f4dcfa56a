"""Speculative rejection sampling and the expected tokens of a round.

Shape legend: see ``runtime.speculative``.
"""

from __future__ import annotations

import numpy as np

from runtime.speculative._common import F64Array


def sample_from(probs: F64Array, rng: np.random.Generator) -> int:
    """Inverse-CDF sample from ``probs`` [V] (one uniform draw; never a zero-mass token)."""
    cum = np.cumsum(probs)  # [V]
    u = rng.random() * cum[-1]
    idx = int(np.searchsorted(cum, u, side="right"))
    if idx >= probs.size or probs[idx] <= 0:
        nz = np.flatnonzero(probs)
        idx = int(nz[min(int(np.searchsorted(nz, idx)), nz.size - 1)])
    return idx


def accept_or_resample(
    p: F64Array, q: F64Array | None, draft: int, rng: np.random.Generator
) -> tuple[bool, int]:
    """One step of speculative rejection sampling.

    ``p`` [V] target distribution, ``q`` [V] the distribution ``draft`` was drawn from (None: a
    deterministic draft, q one-hot). Accept with probability min(1, p(d)/q(d)); else return a
    sample from norm(max(0, p - q)). Either way the returned token is distributed exactly as p."""
    qd = 1.0 if q is None else float(q[draft])
    pd = float(p[draft])
    if qd > 0 and rng.random() * qd < pd:
        return True, int(draft)
    if q is None:
        resid = p.copy()  # [V]
        resid[draft] = 0.0
    else:
        resid = np.maximum(p - q, 0.0)  # [V]
    if not resid.sum() > 0:  # p == q up to rounding: rejection had probability ~0
        resid = p
    return False, sample_from(resid, rng)


def expected_tokens(alpha: float | list[float], k: int) -> float:
    """Tokens per verify step with k drafts: ``1 + a1 + a1 a2 + ... + a1..ak`` where ``ai`` is
    the probability that draft i matches given drafts 1..i-1 did (one float: the same for every
    position, ``1 + a + .. + a^k``; a list shorter than k: its last value repeats)."""
    alphas = [alpha] if isinstance(alpha, float | int) else list(alpha)
    total, run = 1.0, 1.0
    for i in range(k):
        a = min(max(float(alphas[min(i, len(alphas) - 1)]), 0.0), 1.0)
        run *= a
        total += run
    return total

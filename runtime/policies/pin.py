"""Learned pinning: fill a pinned set from routing counts, and re-pin with hysteresis.

Shape legend: L layer, E expert, Key = (L, E); counts [L, E].
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["choose_pinned", "repin_swaps"]

Key = tuple[int, int]


def choose_pinned(
    counts: npt.NDArray[np.int64],
    layers: Sequence[int],
    max_experts: int,
    *,
    min_total: int = 0,
) -> list[Key]:
    """The ``max_experts`` hottest (layer, expert) pairs by cumulative count.

    ``counts`` is [n_layers, n_experts] indexed by absolute layer. Nothing is pinned until the
    history holds ``min_total`` selections (a few tokens say little). Ties: lower layer, then lower
    expert id (deterministic).
    """
    if max_experts <= 0 or int(counts.sum()) < max(min_total, 1):
        return []
    cands: list[tuple[int, int, int]] = []
    for layer in layers:
        row = counts[layer]
        for e in np.nonzero(row)[0]:
            cands.append((-int(row[e]), layer, int(e)))
    cands.sort()
    return [(layer, e) for _, layer, e in cands[:max_experts]]


def repin_swaps(
    pinned: Iterable[Key],
    score: Mapping[Key, float],
    *,
    hysteresis: float = 0.25,
    margin: float = 4.0,
    max_swaps: int = 4,
) -> list[tuple[Key, Key]]:
    """Swaps (out, in) that make the pinned set hotter, only where the newcomer beats the
    coldest pinned entry by ``(1 + hysteresis) * old + margin``; at most ``max_swaps``.

    ``score`` holds heat (e.g. decayed counts) for every candidate, pinned or not."""
    pinned_set = set(pinned)
    inside = sorted(pinned_set, key=lambda k: (score.get(k, 0.0), k))
    outside = sorted((k for k in score if k not in pinned_set), key=lambda k: (-score[k], k))
    swaps: list[tuple[Key, Key]] = []
    for cold, hot in zip(inside, outside, strict=False):
        if len(swaps) >= max_swaps:
            break
        if score[hot] > (1.0 + hysteresis) * score.get(cold, 0.0) + margin:
            swaps.append((cold, hot))
        else:
            break
    return swaps

"""Which cluster worker owns which routed expert: weighted rendezvous hashing.

Every (layer, expert) key ranks the workers by ``w_i / -ln(u(key, i))`` (``u`` uniform per key
and worker, :func:`storage.multidisk.placement.rendezvous_order` with its own salt so the
ranking is independent of how a worker spreads its keys over its own disks). The first worker
owns the key; a worker owns a share ``w_i / sum(w)`` of all keys, and adding or removing a
worker moves only the keys it gains or loses.

A worker's weight is its RAM budget times its probed read bandwidth (each normalised to the
largest; the bandwidth ratio rounded to a power of two, so probe noise does not move keys): a
host with twice the RAM holds twice the experts, and of two hosts with the same RAM the one
with a disk twice as fast takes twice as many (its misses cost less).

Shape legend: L MoE layers, E experts per layer, N workers, key = (layer, expert).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from storage.errors import ColibriError
from storage.multidisk.placement import rendezvous_order

__all__ = ["CLUSTER_SALT", "Key", "assign", "shares", "worker_weights"]

Key = tuple[int, int]
CLUSTER_SALT = 0x636F6C69  # "coli": the worker ranking, independent of the disk ranking


def worker_weights(ram_bytes: Sequence[int], read_bps: Sequence[float]) -> tuple[float, ...]:
    """One weight per worker from its RAM budget and read bandwidth (each normalised to the
    largest, RAM in 1/16 steps, bandwidth to a power of two), so the product is dimensionless
    and the same from run to run. A worker with no RAM or no bandwidth gets 0."""
    if len(ram_bytes) != len(read_bps) or not ram_bytes:
        raise ColibriError("worker weights need one RAM budget and one bandwidth per worker")
    top_ram, top_bw = max(ram_bytes), max(read_bps)
    if top_ram <= 0 or top_bw <= 0:
        raise ColibriError("no worker has RAM and read bandwidth to hold experts")
    return tuple(
        round(16 * max(0.0, r / top_ram)) / 16 * _octave(b / top_bw)
        for r, b in zip(ram_bytes, read_bps, strict=True)
    )


def _octave(ratio: float) -> float:
    """A bandwidth ratio rounded to a power of two: a probe's noise (two workers reading the
    same disk measure 0.85 and 1.0) must not skew the shares; a disk half as fast counts."""
    if ratio <= 0:
        return 0.0
    return float(2.0 ** round(math.log2(min(ratio, 1.0))))


def assign(
    layers: Sequence[int], n_experts: int, weights: Sequence[float]
) -> dict[Key, tuple[int, ...]]:
    """Every key of ``layers`` x ``n_experts`` -> the workers ranked best first (the first owns
    it; the rest are where it would go if that one left). The same in every process."""
    if not any(w > 0 for w in weights):
        raise ColibriError("at least one worker needs a weight > 0")
    workers = range(len(weights))
    return {
        (layer, e): tuple(rendezvous_order(layer, e, weights, workers, salt=CLUSTER_SALT))
        for layer in layers
        for e in range(n_experts)
    }


def shares(ranking: dict[Key, tuple[int, ...]], n_workers: int) -> list[list[Key]]:
    """The keys each worker owns (ascending), from :func:`assign`'s ranking."""
    out: list[list[Key]] = [[] for _ in range(n_workers)]
    for key in sorted(ranking):
        out[ranking[key][0]].append(key)
    return out

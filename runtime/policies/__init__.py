"""Placement policies: pure Python, no I/O, driven directly by their tests.

They decide *where* an expert lives (pinned set, per-layer LRU, storage) and therefore only speed;
they never see activations and cannot change an output token.

Shape legend: L layer, E expert, Key = (L, E); no arrays.
"""

from runtime.policies.lru import LayerLru
from runtime.policies.pin import choose_pinned, repin_swaps
from runtime.policies.tiers import Placement, StepHandle, TierPolicy, TierStats

__all__ = [
    "LayerLru",
    "Placement",
    "StepHandle",
    "TierPolicy",
    "TierStats",
    "choose_pinned",
    "repin_swaps",
]

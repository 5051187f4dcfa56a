"""Placement policies: pure Python, driven by tests with fake clocks and fake readers.

They decide *where* an expert lives (pinned set, per-layer LRU, storage) and therefore only speed;
they never see activations and cannot change an output token.
"""

from runtime.policies.lru import LayerLru
from runtime.policies.pin import choose_pinned, repin_swaps

__all__ = ["LayerLru", "choose_pinned", "repin_swaps"]

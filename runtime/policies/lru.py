"""Per-layer LRU over a fixed number of slots, with protection for in-use entries.

Shape legend: E expert ids of one layer; no arrays.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["LayerLru"]


class LayerLru:
    """LRU of expert ids for one layer.

    ``capacity`` slots; ``protect(ids)`` marks entries the current step needs so that admission
    never evicts them (a miss that finds every slot protected bypasses the cache instead).
    Prefill mode admits nothing new into a full cache: a chunk touches most experts once and would
    otherwise flush the decode hot set.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._order: OrderedDict[int, None] = OrderedDict()
        self._protected: set[int] = set()
        self._held: dict[int, int] = {}

    def __contains__(self, expert: int) -> bool:
        return expert in self._order

    def __len__(self) -> int:
        return len(self._order)

    def keys(self) -> list[int]:
        """Least recently used first."""
        return list(self._order)

    def touch(self, expert: int) -> None:
        self._order.move_to_end(expert)

    def protect(self, experts: Iterable[int]) -> None:
        self._protected = set(experts)

    def unprotect(self) -> None:
        self._protected = set()

    def hold(self, expert: int) -> None:
        """Pin an entry while something (a read in flight) uses its slot; nests."""
        self._held[expert] = self._held.get(expert, 0) + 1

    def unhold(self, expert: int) -> None:
        n = self._held.get(expert, 0) - 1
        if n > 0:
            self._held[expert] = n
        else:
            self._held.pop(expert, None)

    def victim(self) -> int | None:
        """The entry admission would evict now (None if a slot is free or all are protected)."""
        if len(self._order) < self.capacity:
            return None
        for e in self._order:
            if e not in self._protected and e not in self._held:
                return e
        return None

    def can_admit(self, *, prefill: bool = False) -> bool:
        if self.capacity == 0:
            return False
        if len(self._order) < self.capacity:
            return True
        if prefill:
            return False
        return self.victim() is not None

    def admit(self, expert: int, *, prefill: bool = False) -> int | None:
        """Insert ``expert``; returns the evicted id (or None). Caller checks can_admit first."""
        if expert in self._order:
            self.touch(expert)
            return None
        if not self.can_admit(prefill=prefill):
            raise RuntimeError("admit() without a free or evictable slot")
        evicted = self.victim()
        if evicted is not None:
            del self._order[evicted]
        self._order[expert] = None
        return evicted

    def discard(self, expert: int) -> None:
        self._order.pop(expert, None)

"""Placement policies are pure Python: drive them directly."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.policies import LayerLru, choose_pinned, repin_swaps


def test_lru_evicts_least_recent_unprotected() -> None:
    lru = LayerLru(3)
    for e in (1, 2, 3):
        lru.admit(e)
    lru.touch(1)  # order now 2, 3, 1
    assert lru.victim() == 2
    lru.protect([2])
    assert lru.victim() == 3
    assert lru.admit(9) == 3
    assert lru.keys() == [2, 1, 9]


def test_lru_never_evicts_protected_or_held() -> None:
    lru = LayerLru(2)
    lru.admit(1)
    lru.admit(2)
    lru.protect([1])
    lru.hold(2)
    assert not lru.can_admit()
    with pytest.raises(RuntimeError):
        lru.admit(3)
    lru.unhold(2)
    assert lru.admit(3) == 2


def test_prefill_does_not_flush_a_full_cache() -> None:
    lru = LayerLru(2)
    lru.admit(1)
    lru.admit(2)
    assert not lru.can_admit(prefill=True)
    assert lru.can_admit(prefill=False)
    empty = LayerLru(2)
    assert empty.can_admit(prefill=True)  # free slots may still be filled during prefill


def test_zero_capacity_admits_nothing() -> None:
    assert not LayerLru(0).can_admit()


def test_choose_pinned_hottest_first_and_deterministic() -> None:
    counts = np.zeros((4, 8), dtype=np.int64)
    counts[1, 3] = 50
    counts[2, 5] = 50
    counts[3, 0] = 70
    counts[1, 7] = 1
    assert choose_pinned(counts, [1, 2, 3], 3) == [(3, 0), (1, 3), (2, 5)]
    assert choose_pinned(counts, [1, 2, 3], 3, min_total=10_000) == []
    assert choose_pinned(counts, [2], 5) == [(2, 5)]


def test_repin_needs_hysteresis_and_caps_swaps() -> None:
    pinned = [(0, 0), (0, 1)]
    score = {(0, 0): 10.0, (0, 1): 100.0, (0, 2): 17.0, (0, 3): 12.0}
    assert repin_swaps(pinned, score) == [((0, 0), (0, 2))]  # 17 > 1.25*10+4 = 16.5
    assert repin_swaps(pinned, {**score, (0, 2): 16.0}) == []  # inside the hysteresis band
    many = {(1, i): float(i) for i in range(20)}
    got = repin_swaps([(1, i) for i in range(10)], many, hysteresis=0.0, margin=0.0, max_swaps=4)
    assert len(got) == 4

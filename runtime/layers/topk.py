"""Top-k selection that picks the same *set* as ``torch.topk`` on CPU, exact ties included.

Why: the reference (transformers) selects DSA keys and routed experts with ``torch.topk``. With
``relu`` in the DSA indexer many keys score exactly 0.0, so the k-th boundary often falls inside
a run of equal values; which of them torch keeps changes the attention output. Torch's CPU
kernel (``aten/src/ATen/native/TopKImpl.h``) copies ``(value, index)`` pairs and runs libstdc++
``std::nth_element`` (introselect) -- or ``std::partial_sort`` (a heap select) when
``k * 64 <= n`` -- with a comparator on the value only ("NaN is largest"). The outcome for ties
is deterministic, so we reproduce it by porting those libstdc++ routines (verified against
torch 2.13 on thousands of tie-heavy rows).

Rows whose boundary is not tied have one correct answer, found with ``np.argpartition`` (or,
for a small ``k`` such as an MoE router's, a ``nogil`` selection kernel that spares the dozen
numpy calls: ~5 us instead of ~95 us for one row of 64 experts); only tied rows run the (pure
Python, O(n)) port. A tie among ``-inf`` entries (a causally masked
region) is resolved arbitrarily when ``exact_masked_ties`` is False, because the caller masks
those entries anyway.

Shape legend: R rows, N candidates per row, k selected.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
from numba import njit

__all__ = ["KERNELS", "torch_topk_indices"]

#: Largest ``k`` the selection kernel takes (it keeps the k best in a sorted run: O(N k) worst).
_KERNEL_MAX_K = 64

F32Array = npt.NDArray[np.float32]
I64Array = npt.NDArray[np.int64]


def torch_topk_indices(
    values: F32Array,
    k: int,
    *,
    exact_masked_ties: bool = False,
    lengths: npt.NDArray[np.integer] | None = None,
) -> I64Array:
    """Indices [R, k] of the k largest values of each row of ``values`` [R, N].

    The set per row equals ``torch.topk(values, k, dim=-1).indices`` (CPU); the order within a
    row is unspecified. ``k`` is clipped to N (torch would raise; callers clip first anyway).

    ``lengths`` [R]: row r's candidates are its first ``lengths[r]`` values only (each >= k; the
    rest must be -inf, a causally masked tail). The set is then ``torch.topk`` of that prefix,
    ties included, so it does not depend on how long the masked tail is: a query's selection
    in a long prefill equals the one a one-token decode at its position makes.
    """
    v = np.asarray(values, dtype=np.float32)
    r, n = v.shape
    k = min(int(k), n)
    if k <= 0:
        return np.zeros((r, 0), dtype=np.int64)
    if k == n:
        return np.broadcast_to(np.arange(n, dtype=np.int64), (r, n)).copy()
    if k <= _KERNEL_MAX_K:
        n_rows = (
            np.full(r, n, np.int64)
            if lengths is None
            else np.ascontiguousarray(lengths, dtype=np.int64)
        )  # [R]
        out = np.empty((r, k), np.int64)  # [R, k]
        tied = np.empty(r, np.bool_)  # [R]
        if _select(v, k, n_rows, exact_masked_ties, out, tied):
            for row in np.flatnonzero(tied):
                out[row] = _libstdcxx_topk(v[row, : n_rows[row]].tolist(), k)
        return out
    part = np.argpartition(-v, k - 1, axis=1)  # [R, N]: first k are a valid top-k set
    out = np.ascontiguousarray(part[:, :k], dtype=np.int64)  # [R, k]
    kth = np.take_along_axis(v, part[:, k - 1 : k], axis=1)[:, 0]  # [R] k-th largest
    rest = np.take_along_axis(v, part[:, k:], axis=1)  # [R, N-k]
    tied = (rest == kth[:, None]).any(axis=1) | np.isnan(v).any(axis=1)  # [R]
    if not exact_masked_ties:
        tied &= ~np.isneginf(kth)
    for row in np.flatnonzero(tied):
        n_row = n if lengths is None else int(lengths[row])
        out[row] = _libstdcxx_topk(v[row, :n_row].tolist(), k)
    return out


@njit(nogil=True, cache=True)
def _select(v, k, lengths, exact_masked_ties, out, tied):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Per row ``r`` of ``v`` [R, N], over its first ``lengths[r]`` values (each >= k): ``out[r]``
    the indices of the k largest non-NaN values (a value replaces the k-th only when strictly
    larger) and ``tied[r]`` whether that set is ambiguous: a NaN among them, fewer than k other
    values, or a value outside the set equal to the k-th (counted with ``>=``, so -0.0 ties
    0.0 as ``==`` does in the numpy path), except a k-th of -inf unless ``exact_masked_ties``.
    Returns how many rows tied."""
    n_rows = v.shape[0]
    best = np.empty(k, np.float32)
    n_tied = 0
    for r in range(n_rows):
        n = lengths[r]
        cnt = 0
        nan = False
        for j in range(n):
            x = v[r, j]
            if x != x:
                nan = True
                continue
            if cnt < k:
                p = cnt
                cnt += 1
            elif x > best[k - 1]:
                p = k - 1
            else:
                continue
            while p > 0 and best[p - 1] < x:
                best[p] = best[p - 1]
                out[r, p] = out[r, p - 1]
                p -= 1
            best[p] = x
            out[r, p] = j
        if cnt < k:
            tied[r] = True
        else:
            kv = best[k - 1]
            ge = 0
            for j in range(n):
                if v[r, j] >= kv:
                    ge += 1
            tied[r] = (nan or ge > k) and (exact_masked_ties or kv != -np.inf)
        n_tied += tied[r]
    return n_tied


#: Every compiled kernel (tests check they were built with ``nogil=True``).
KERNELS = (_select,)


# ----------------------------------------------------------------------------- libstdc++ port
# Comparator of TopKImpl.h for largest=True: x "before" y if x is NaN and y is not, or x > y.


def _before(x: float, y: float) -> bool:
    return (math.isnan(x) and not math.isnan(y)) or x > y


def _libstdcxx_topk(vals: list[float], k: int) -> list[int]:
    """The k indices torch's CPU topk keeps for one row (see module docstring)."""
    n = len(vals)
    v = list(vals)
    idx = list(range(n))
    if k * 64 <= n:  # std::partial_sort: the set comes from its heap select
        _heap_select(v, idx, 0, k, n)
        return idx[:k]
    _introselect(v, idx, k - 1, n)
    return idx[:k]


def _introselect(v: list[float], idx: list[int], nth: int, n: int) -> None:
    """libstdc++ ``std::__introselect`` over [0, n) with depth limit 2*floor(log2 n)."""
    first, last = 0, n
    depth = 2 * (n.bit_length() - 1)
    while last - first > 3:
        if depth == 0:
            _heap_select(v, idx, first, nth + 1, last)
            v[first], v[nth] = v[nth], v[first]
            idx[first], idx[nth] = idx[nth], idx[first]
            return
        depth -= 1
        # __unguarded_partition_pivot: median of (first+1, mid, last-1) moved to first.
        a, b, c = first + 1, first + (last - first) // 2, last - 1
        if _before(v[a], v[b]):
            m = b if _before(v[b], v[c]) else (c if _before(v[a], v[c]) else a)
        else:
            m = a if _before(v[a], v[c]) else (c if _before(v[b], v[c]) else b)
        v[first], v[m] = v[m], v[first]
        idx[first], idx[m] = idx[m], idx[first]
        pivot = v[first]
        lo, hi = first + 1, last
        while True:  # __unguarded_partition
            while _before(v[lo], pivot):
                lo += 1
            hi -= 1
            while _before(pivot, v[hi]):
                hi -= 1
            if not lo < hi:
                break
            v[lo], v[hi] = v[hi], v[lo]
            idx[lo], idx[hi] = idx[hi], idx[lo]
            lo += 1
        if lo <= nth:
            first = lo
        else:
            last = lo
    _insertion_sort(v, idx, first, last)


def _insertion_sort(v: list[float], idx: list[int], first: int, last: int) -> None:
    for i in range(first + 1, last):
        val, vid = v[i], idx[i]
        if _before(val, v[first]):
            v[first + 1 : i + 1] = v[first:i]
            idx[first + 1 : i + 1] = idx[first:i]
            v[first], idx[first] = val, vid
        else:  # __unguarded_linear_insert
            j = i
            while _before(val, v[j - 1]):
                v[j], idx[j] = v[j - 1], idx[j - 1]
                j -= 1
            v[j], idx[j] = val, vid


def _adjust_heap(
    v: list[float], idx: list[int], first: int, hole: int, length: int, val: float, vid: int
) -> None:
    top = second = hole
    while second < (length - 1) // 2:
        second = 2 * (second + 1)
        if _before(v[first + second], v[first + second - 1]):
            second -= 1
        v[first + hole], idx[first + hole] = v[first + second], idx[first + second]
        hole = second
    if (length & 1) == 0 and second == (length - 2) // 2:
        second = 2 * (second + 1)
        v[first + hole], idx[first + hole] = v[first + second - 1], idx[first + second - 1]
        hole = second - 1
    parent = (hole - 1) // 2  # __push_heap
    while hole > top and _before(v[first + parent], val):
        v[first + hole], idx[first + hole] = v[first + parent], idx[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    v[first + hole], idx[first + hole] = val, vid


def _heap_select(v: list[float], idx: list[int], first: int, middle: int, last: int) -> None:
    length = middle - first
    if length >= 2:  # __make_heap
        parent = (length - 2) // 2
        while True:
            _adjust_heap(v, idx, first, parent, length, v[first + parent], idx[first + parent])
            if parent == 0:
                break
            parent -= 1
    for i in range(middle, last):
        if _before(v[i], v[first]):  # __pop_heap(first, middle, i)
            val, vid = v[i], idx[i]
            v[i], idx[i] = v[first], idx[first]
            _adjust_heap(v, idx, first, 0, length, val, vid)

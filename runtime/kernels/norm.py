"""RMS norm rows in one numba call, with numpy's float32 arithmetic bit for bit.

``rms_norm`` in numpy is seven array operations (square, sum, divide, add, sqrt, reciprocal,
two products), ~15 us for one row of a few thousand values, 25 times per decode step of a
DeepSeek-V3-shaped model and as often on a small one, where it was a tenth of the step. This is
the same arithmetic in one call: each row's sum of squares as numpy's float32 ``add.reduce``
sums a contiguous row (from 0, blocks of eight running sums combined pairwise, halves of more
than 128 values summed apart: ``pairwise_sum`` in numpy's loops), then the correctly rounded
division by the width, the square root and the reciprocal in float32, then ``weight * (x *
inv)``. Every row on its own, so a row's bits do not depend on the other rows. The DSA
indexer's key LayerNorm (``layer_rows``) the same way: ten array operations for one row of 128
values per layer of a GLM-5 decode step (~60 us of numpy calls) in one call.

Shape legend: T rows, D normalised width.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["KERNELS", "layer_rows", "rms_rows"]

_BLOCK = 128  # numpy's PW_BLOCKSIZE: longer runs are split in halves


@njit(nogil=True, cache=True, inline="always")
def _block(a, lo, n):  # type: ignore[no-untyped-def]
    """``a[lo : lo + n]`` (``n <= _BLOCK``) summed in float32 as numpy's ``pairwise_sum``
    sums a run it does not split: under 8 values one by one from 0, else eight running sums
    combined pairwise, then the values past the last multiple of 8."""
    if n < 8:
        res = np.float32(0.0)
        for i in range(n):
            res += a[lo + i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    whole = n - n % 8
    while i < whole:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(nogil=True, cache=True)
def _pairwise(a, n):  # type: ignore[no-untyped-def]
    """``a[:n]`` summed in float32 as numpy's ``pairwise_sum``: a run of more than
    ``_BLOCK`` values is split at half its length rounded down to a multiple of 8, each half
    summed so, and the two sums added. Without recursion (numba's cache cannot hold a
    recursive function): the same tree walked with explicit stacks, left half first."""
    los = np.empty(128, np.int64)  # runs to do: start, length, whether to add two sums
    ns = np.empty(128, np.int64)
    adds = np.empty(128, np.bool_)
    sums = np.empty(64, np.float32)  # sums done, the left one below the right one
    todo = 1
    done = 0
    los[0], ns[0], adds[0] = 0, n, False
    while todo:
        todo -= 1
        lo, m, add = los[todo], ns[todo], adds[todo]
        if add:
            done -= 1
            sums[done - 1] = sums[done - 1] + sums[done]
        elif m <= _BLOCK:
            sums[done] = _block(a, lo, m)
            done += 1
        else:
            half = m // 2
            half -= half % 8
            los[todo], ns[todo], adds[todo] = lo, m, True  # after both halves
            los[todo + 1], ns[todo + 1], adds[todo + 1] = lo + half, m - half, False
            los[todo + 2], ns[todo + 2], adds[todo + 2] = lo, half, False  # first
            todo += 3
    return sums[0]


@njit(nogil=True, cache=True)
def rms_rows(x, weight, eps, out):  # type: ignore[no-untyped-def]
    """``out [T, D] = weight * (x * inv)`` with ``inv = 1 / sqrt(sum(x^2) / D + eps)`` per row
    of ``x`` [T, D] (float32, any strides); returns whether every row's sum of squares was
    finite (the final norm's check)."""
    n_rows, d = x.shape
    sq = np.empty(d, np.float32)
    width = np.float32(d)
    one = np.float32(1.0)
    finite = True
    for t in range(n_rows):
        for i in range(d):
            v = x[t, i]
            sq[i] = v * v
        ss = np.float32(0.0) + _pairwise(sq, d)  # numpy's reduce starts from its identity
        if not np.isfinite(ss):
            finite = False
        inv = one / np.sqrt(ss / width + eps)
        for i in range(d):
            out[t, i] = weight[i] * (x[t, i] * inv)
    return finite


@njit(nogil=True, cache=True)
def layer_rows(x, weight, bias, eps, out):  # type: ignore[no-untyped-def]
    """``out [T, D] = xc * inv * weight + bias`` per row of ``x`` [T, D] (float32, any
    strides), with ``xc = x - mean(x)`` and ``inv = 1 / sqrt(mean(xc^2) + eps)``:
    ``torch.nn.LayerNorm`` (biased variance) as ``runtime.layers.rms_norm.layer_norm_numpy``
    computes it, bit for bit (each mean numpy's float32 sum of a contiguous row, then a
    correctly rounded division by the width; every product and sum in float32 in numpy's
    order)."""
    n_rows, d = x.shape
    xc = np.empty(d, np.float32)
    sq = np.empty(d, np.float32)
    width = np.float32(d)
    one = np.float32(1.0)
    for t in range(n_rows):
        for i in range(d):
            xc[i] = x[t, i]
        mean = (np.float32(0.0) + _pairwise(xc, d)) / width
        for i in range(d):
            v = x[t, i] - mean
            xc[i] = v
            sq[i] = v * v
        var = (np.float32(0.0) + _pairwise(sq, d)) / width
        inv = one / np.sqrt(var + eps)
        for i in range(d):
            out[t, i] = xc[i] * inv * weight[i] + bias[i]


#: Every compiled kernel (tests check they were built with ``nogil=True``).
KERNELS = (_block, _pairwise, rms_rows, layer_rows)

"""Rotary position embedding in one numba call, numpy's float32 arithmetic bit for bit.

``apply_rope`` in numpy is six array operations on a few hundred values (~15 us a call, a dozen
calls a decode step). Here every output value is the same two float32 products and one
float32 sum or difference as numpy's ``x1 * cos - x2 * sin`` / ``x2 * cos + x1 * sin`` (no
fused multiply-add: numba contracts nothing without fastmath), so the same bits.

Shape legend: T tokens, H heads, R rotated width, R2 = R / 2 pairs.
"""

from __future__ import annotations

from numba import njit

__all__ = ["KERNELS", "rope_rows"]


@njit(nogil=True, cache=True)
def rope_rows(x, cos, sin, interleave, out):  # type: ignore[no-untyped-def]
    """``out`` [T, H, R] from ``x`` [T, H, R] (any strides) and ``cos`` / ``sin`` [T, R2]:
    pair ``j`` is lanes ``2j, 2j + 1`` (``interleave``) or ``j, j + R2``; the output holds
    ``x1 cos - x2 sin`` in its first half and ``x2 cos + x1 sin`` in its second."""
    n_tok, n_heads, r = x.shape
    half = r // 2
    for t in range(n_tok):
        for h in range(n_heads):
            for j in range(half):
                if interleave:
                    a = x[t, h, 2 * j]
                    b = x[t, h, 2 * j + 1]
                else:
                    a = x[t, h, j]
                    b = x[t, h, half + j]
                c = cos[t, j]
                s = sin[t, j]
                out[t, h, j] = a * c - b * s
                out[t, h, half + j] = b * c + a * s


#: Every compiled kernel (tests check they were built with ``nogil=True``).
KERNELS = (rope_rows,)

"""A loop bound by DRAM reads, shared by ``kernels.py`` (the one-thread DRAM read it divides by)
and ``stream.py`` (memory traffic beside the disk): both run as scripts from this folder.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["read_sum"]


@njit(nogil=True, cache=True)
def read_sum(a):  # type: ignore[no-untyped-def]
    """Sum of a uint64 array, off the GIL (integer adds vectorize; the loop is bound by DRAM
    reads once ``a`` is far larger than the caches)."""
    s = np.uint64(0)
    for i in range(a.size):
        s += a[i]
    return s

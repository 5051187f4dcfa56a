"""numpy arrays whose first element starts a 64-byte cache line (the KV cache, which the
16-lane attention kernel reads whole lines of; numba code allocates with ``_intrinsics.zeros64``).

numpy aligns its arrays to 16 bytes and numba to 32; a 64-byte vector load from an address
that is not a multiple of 64 touches two cache lines. Measured on an AVX-512 Intel guest
(docs/benchmarks.md): the absorbed attention kernel over 2048 keys x 64 heads 1.33x faster with
its key and query arrays aligned, the 16-lane int4 GEMV 1.25x (in L2) with its activation
planes aligned. Alignment changes no result: the kernels do the same operations on the same
values.

Shape legend: n elements; shape any.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from runtime.kernels._intrinsics import ALIGN

__all__ = ["ALIGN", "is_aligned", "zeros_aligned"]


def zeros_aligned(shape: int | tuple[int, ...], dtype: npt.DTypeLike = np.float32) -> np.ndarray:
    """``np.zeros(shape, dtype)`` starting on a 64-byte boundary (a view of a slightly larger
    buffer, which it keeps alive)."""
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(dims) * dt.itemsize
    buf = np.zeros(nbytes + ALIGN, np.uint8)
    off = -buf.ctypes.data % ALIGN
    return buf[off : off + nbytes].view(dt).reshape(dims)


def is_aligned(a: np.ndarray) -> bool:
    """Whether ``a``'s first element starts a 64-byte boundary."""
    return a.ctypes.data % ALIGN == 0

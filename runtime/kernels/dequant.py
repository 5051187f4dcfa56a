"""Dequantize a stored weight into float32 ``[O, I]`` (the dense tile a BLAS GEMM consumes).

Used only by the opt-in fast prefill path (``fast_prefill``): for a large prefill chunk an
expert sees tens to hundreds of rows, and a dequantized tile multiplied by BLAS (multi-threaded,
cache-blocked) is several times faster than the streaming int4 kernel. BLAS sums in its own
order, so results agree with :mod:`.quant_matmul` to float rounding, not bit for bit; the exact
(default) path never calls this module.

The values are exactly those of :func:`storage.quant.dequantize`, which serves every format but
int4; int4 (``(nibble - 8) * scale``, per row or per group), the expert format, has a numba
kernel here that writes into a reusable scratch.

Shape legend: O out features, I in features, B = ceil(I / 2) packed bytes per int4 row, G scale
groups per row.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from storage.quant import QTensor
from storage.quant import dequantize as reference_dequantize

__all__ = ["dequantize"]

F32Array = npt.NDArray[np.float32]


def _nibble_table() -> F32Array:
    """[256, 2]: byte -> (low nibble - 8, high nibble - 8) as float32."""
    b = np.arange(256)
    return np.stack([(b & 15) - 8, (b >> 4) - 8], axis=1).astype(np.float32)


_NIBBLES = _nibble_table()  # a constant table, not state


@njit(nogil=True, cache=True, error_model="numpy")
def _dq_int4(packed, scales, n_out, n_in, nb, gs, s_row, lut, out):  # type: ignore[no-untyped-def]
    # gs == 0: one scale per row. Columns come in pairs (one byte); an even group never splits
    # a byte, odd groups take the per-column branch. ``out`` is flat [O * I].
    for o in range(n_out):
        base = o * nb
        srow = o * s_row
        ob = o * n_in
        if gs % 2 == 1:
            for c in range(n_in):
                b = packed[base + c // 2]
                s = scales[srow + c // gs]
                out[ob + c] = lut[b, c & 1] * s
            continue
        half = gs // 2 if gs else nb
        prow = packed[base : base + nb]
        orow = out[ob : ob + n_in]
        pairs = n_in // 2
        for g in range(s_row):
            s = scales[srow + g]
            j0 = g * half
            if j0 + half <= pairs:  # a whole group: fixed trip count, vectorizes
                for j in range(j0, j0 + half):
                    b = prow[j]
                    orow[2 * j] = lut[b, 0] * s
                    orow[2 * j + 1] = lut[b, 1] * s
            else:
                for j in range(j0, pairs):
                    b = prow[j]
                    orow[2 * j] = lut[b, 0] * s
                    orow[2 * j + 1] = lut[b, 1] * s
        if n_in % 2 == 1:
            out[ob + n_in - 1] = lut[packed[base + nb - 1], 0] * scales[srow + s_row - 1]


def dequantize(q: QTensor, out: F32Array | None = None) -> F32Array:
    """``q`` as float32 ``[O, I]``; written into ``out`` (C-contiguous float32, at least O*I
    elements; a view of its first O*I is returned) when given, so a scratch can be reused."""
    o, i = q.shape
    if out is None:
        dst = np.empty((o, i), dtype=np.float32)
    else:
        if out.dtype != np.float32 or not out.flags.c_contiguous or out.size < o * i:
            raise ValueError(f"out must be C-contiguous float32 with >= {o * i} elements")
        dst = out.reshape(-1)[: o * i].reshape(o, i)
    if q.fmt.kind != "int4":  # storage.quant computes it (a temporary, copied into dst)
        dst[...] = reference_dequantize(q)
        return dst
    if q.scales is None:
        raise ValueError(f"{q.fmt.name} weight without scales")
    scales = np.ascontiguousarray(q.scales, dtype=np.float32).reshape(-1)
    raw = np.ascontiguousarray(q.data).reshape(-1).view(np.uint8)
    nb = (i + 1) // 2
    gs = q.fmt.group_size
    flat = dst.reshape(-1)
    if gs is None:  # one scale per row: a single "group" spanning the row
        _dq_int4(raw, scales, o, i, nb, 0, 1, _NIBBLES, flat)
    else:
        _dq_int4(raw, scales, o, i, nb, int(gs), -(-i // int(gs)), _NIBBLES, flat)
    return dst

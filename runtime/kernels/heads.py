"""Per-head matmuls of MLA absorption in one call: ``out[t, h] = W[h] x[t, h]`` for every head.

Why: absorbed attention multiplies each head's query by its own ``W_UK[h]`` and each head's
latent output by its own ``W_UV[h]``; as one :class:`~runtime.linear.Linear` call per head that
was 2 x NH Python calls per layer and token (32 per layer on a 16-head model), each a few
multiply-adds, so a decode step spent milliseconds in call overhead. Here one numba call loops
over the heads: ``W_UK`` as a sum of scaled rows (16 output lanes at a time, fixed order), and
``W_UV`` through, per head, the very int4 kernels a per-head ``Linear`` runs (the same bits).

Shape legend: T rows, NH heads, O out features per head, I in features, B = ceil(I / 2) packed
bytes per int4 row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from numba import njit

from runtime.kernels._matmul_kernels import (
    _i4_gemm,
    _i4_gemm16,
    _i4_gemv,
    _i4_gemv16,
    _i4_prep,
)
from runtime.kernels._simd import (
    i4lo16,
    u8f16,
    vadd16,
    vfma16,
    vload16,
    vmul16,
    vsplat16,
    vstore16,
    vzero16,
)
from runtime.kernels.quant_matmul import DEFAULT_PREFETCH, int4_lanes, int4_scale_walk

__all__ = ["KERNELS", "HeadsMatmul"]

F32Array = npt.NDArray[np.float32]


@njit(nogil=True, cache=True)
def _heads_axpy(w, n_heads, n_in, n_out, x, out):  # type: ignore[no-untyped-def]
    """w [NH * I * O] (head-major, ``W[h]`` stored [I, O]), x [T, NH, I] -> out [T, NH, O]:
    ``out[t, h] = sum_i x[t, h, i] * W[h, i]``, ``i`` in increasing order, 16 output lanes at
    a time (no horizontal sums). Per (t, h) the same code for any T."""
    n_tok = x.shape[0]
    o16 = n_out // 16 * 16
    flat = out.reshape(-1)
    for t in range(n_tok):
        for h in range(n_heads):
            base = (t * n_heads + h) * n_out
            wbase = h * n_in * n_out
            for k in range(0, o16, 16):
                vstore16(flat, base + k, vzero16())
            for k in range(o16, n_out):
                flat[base + k] = np.float32(0.0)
            for i in range(n_in):
                xv = x[t, h, i]
                xs = vsplat16(xv)
                wi = wbase + i * n_out
                for k in range(0, o16, 16):
                    o = base + k
                    vstore16(flat, o, vfma16(xs, vload16(w, wi + k), vload16(flat, o)))
                for k in range(o16, n_out):
                    flat[base + k] += xv * w[wi + k]


@njit(nogil=True, cache=True)
def _heads_axpy_i4(  # type: ignore[no-untyped-def]
    packed, scales, row0, row_step, n_heads, n_in, n_out, gbytes, s_row, s_step, x, out
):
    """:func:`_heads_axpy` with ``W[h]`` [I, O] read from an int4 matrix (``O`` a multiple of
    32, scale groups of a multiple of 32 columns or one per row): row ``i`` of ``W[h]`` is row
    ``row0 + h * row_step + i`` of the matrix, each value ``(nibble - 8) * scale`` in float32
    (``storage.quant.dequantize``'s values: one rounded product) as it is used. Every output
    column gets the same fused multiply-adds in the same order as ``_heads_axpy`` gives it
    on the dequantized weight, so the same bits, from an eighth of the bytes and without a
    float32 copy of the weight in RAM. Per 16 bytes the low nibbles (even columns) and the
    high nibbles (odd columns) sit in two 16-lane vectors, whose sums go back in column order.
    ``x`` [T, NH, I] -> ``out`` [T, NH, O]."""
    n_tok = x.shape[0]
    nb = n_out // 2
    sixteenth = vsplat16(np.float32(0.0625))
    neg_sixteenth = vsplat16(np.float32(-0.0625))
    minus = vsplat16(np.float32(-8.5))
    tail = np.empty(32, np.float32)
    block = np.empty(max(n_in, 1) * 32, np.float32)  # 32 columns of every row of a head
    for h in range(n_heads):
        r0 = row0 + h * row_step
        # 16 bytes (32 columns) at a time: every row of the head dequantized once into
        # ``block`` (its rows' bytes are nb apart), then each row t's two sums of those columns
        # in registers over the rows i in order
        for jb in range(0, nb, 16):
            g = (jb // gbytes) * s_step
            for i in range(n_in):
                r = r0 + i
                sc = vsplat16(scales[r * s_row + g])
                byte = u8f16(packed, r * nb + jb)  # lo + 16 * hi
                lo8 = i4lo16(packed, r * nb + jb)  # lo - 8
                # hi - 8 = byte / 16 - (lo - 8) / 16 - 8.5: exact (small multiples of 1/16)
                hi8 = vadd16(vmul16(byte, sixteenth), vfma16(lo8, neg_sixteenth, minus))
                vstore16(block, 32 * i, vmul16(lo8, sc))
                vstore16(block, 32 * i + 16, vmul16(hi8, sc))
            for t in range(n_tok):
                a_lo = vzero16()
                a_hi = vzero16()
                for i in range(n_in):
                    xs = vsplat16(x[t, h, i])
                    a_lo = vfma16(xs, vload16(block, 32 * i), a_lo)
                    a_hi = vfma16(xs, vload16(block, 32 * i + 16), a_hi)
                vstore16(tail, 0, a_lo)
                vstore16(tail, 16, a_hi)
                for k in range(16):
                    out[t, h, 2 * (jb + k)] = tail[k]
                    out[t, h, 2 * (jb + k) + 1] = tail[16 + k]


@njit(nogil=True, cache=True)
def _heads_i4(  # type: ignore[no-untyped-def]
    packed, scales, row0, row_step, n_heads, n_out, n_in, gbytes, s_row, s_step, wide, x, out, pf
):
    """Head ``h`` = rows ``[row0 + h * row_step, + O)`` of an int4 matrix; x [T, NH, I] ->
    out [T, NH, O]: ``_i4_prep`` then ``_i4_gemv[16]`` (T = 1) or ``_i4_gemm[16]`` per head."""
    n_tok = x.shape[0]
    nb = (n_in + 1) // 2
    ys = (nb + 7) // 8 * 8 + 16
    xh = np.empty((n_tok, n_in), np.float32)  # [T, I]
    tmp = np.empty((n_tok, n_out), np.float32)  # [T, O]
    flat = tmp.reshape(-1)
    for h in range(n_heads):
        r = row0 + h * row_step
        p = packed[r * nb : (r + n_out) * nb]
        s = scales[r * s_row : (r + n_out) * s_row]
        for t in range(n_tok):  # (element by element: a slice assignment compiles numba's
            for i in range(n_in):  # shape-mismatch message, ~1.7 s of a first run)
                xh[t, i] = x[t, h, i]
        y = _i4_prep(xh, nb, ys)
        if n_tok == 1:
            if wide:
                _i4_gemv16(p, s, n_out, nb, gbytes, s_row, s_step, y, ys, flat, pf)
            else:
                _i4_gemv(p, s, n_out, nb, gbytes, s_row, s_step, y, ys, flat, pf)
        elif wide:
            _i4_gemm16(p, s, n_out, nb, gbytes, s_row, s_step, y, ys, tmp, pf)
        else:
            _i4_gemm(p, s, n_out, nb, gbytes, s_row, s_step, y, ys, tmp, pf)
        for t in range(n_tok):
            for o in range(n_out):
                out[t, h, o] = tmp[t, o]


class HeadsMatmul:
    """``[T, NH, I] -> [T, NH, O]`` through one weight per head, in one numba call where the
    weights allow it (float32 stacked ``[NH, O, I]``, or row ranges of one int4 matrix), else
    head by head through ``Linear`` (the same result either way: the same kernels run)."""

    def __init__(
        self,
        per_head: Sequence[object],
        run: object | None = None,
        held: tuple[npt.NDArray[np.generic], ...] = (),
        kind: str = "",
        spec: tuple[int, ...] = (),
    ) -> None:
        self._per_head = list(per_head)
        self._run = run
        self.held = held  # the arrays ``run`` reads (RAM accounting walks attributes)
        # ``run``'s kernel and its arguments, for a caller that runs a range of heads itself
        # (the job crew): "axpy" (NH, I, O), "axpy_int4" (NH, I, O, row0, row_step, gbytes,
        # s_row, s_step), "int4" (NH, row0, row_step, O, I, gbytes, s_row,
        # s_step, wide); "" (per-head calls)
        self.kind = kind
        self.spec = spec

    @classmethod
    def axpy(cls, w: F32Array) -> HeadsMatmul:
        """``w`` [NH, I, O] float32: ``out[t, h] = x[t, h] @ w[h]`` as a sum of scaled rows of
        ``w[h]`` (fixed order, batch-invariant; for short ``I`` and wide ``O``, as absorbing
        queries through ``W_UK``: no per-output horizontal sums)."""
        stacked = np.ascontiguousarray(w, dtype=np.float32)
        nh, i, o = stacked.shape
        flat = stacked.reshape(-1)

        def run(x: F32Array) -> F32Array:
            out = np.empty((x.shape[0], nh, o), np.float32)  # [T, NH, O]
            _heads_axpy(flat, nh, i, o, x, out)
            return out

        return cls([], run, (flat,), "axpy", (nh, i, o))

    @staticmethod
    def int4_axpy_fits(n_out: int, group_size: int | None) -> bool:
        """Whether :meth:`axpy_int4` takes an int4 matrix of ``n_out`` columns with these
        scale groups (else absorption keeps a float32 copy: :meth:`axpy`)."""
        return n_out % 32 == 0 and (group_size is None or group_size % 32 == 0)

    @classmethod
    def axpy_int4(
        cls,
        packed: npt.NDArray[np.uint8],
        scales: F32Array,
        group_size: int | None,
        n_out: int,
        row0: int,
        row_step: int,
        n_in: int,
        n_heads: int,
    ) -> HeadsMatmul | None:
        """:meth:`axpy` with ``w[h]`` [I, O] = rows ``[row0 + h * row_step, + n_in)`` of an
        int4 matrix of ``n_out`` columns (``packed`` / ``scales`` flat, as stored), dequantized
        as it is used (``_heads_axpy_i4``: the same bits as :meth:`axpy` on the dequantized
        rows, from an eighth of the bytes); None where :meth:`int4_axpy_fits` says no."""
        if not cls.int4_axpy_fits(n_out, group_size):
            return None
        s_row, s_step, gbytes = int4_scale_walk(n_out, group_size)
        p = np.ascontiguousarray(packed).reshape(-1).view(np.uint8)
        s = np.ascontiguousarray(scales, dtype=np.float32).reshape(-1)
        nh, n, o = n_heads, n_in, n_out

        def run(x: F32Array) -> F32Array:
            out = np.empty((x.shape[0], nh, o), np.float32)  # [T, NH, O]
            _heads_axpy_i4(p, s, row0, row_step, nh, n, o, gbytes, s_row, s_step, x, out)
            return out

        spec = (nh, n, o, row0, row_step, gbytes, s_row, s_step)
        return cls([], run, (p, s), "axpy_int4", spec)

    @classmethod
    def int4_rows(
        cls,
        packed: npt.NDArray[np.uint8],
        scales: F32Array,
        group_size: int | None,
        n_in: int,
        row0: int,
        row_step: int,
        n_out: int,
        per_head: Sequence[object],
        lanes: int,
    ) -> HeadsMatmul:
        """Head ``h`` = rows ``[row0 + h * row_step, + n_out)`` of an int4 matrix of ``n_in``
        columns (``packed`` / ``scales`` flat, as stored)."""
        if group_size is not None and group_size % 16:
            return cls(per_head)  # the generic slow path: keep the per-head calls
        s_row, s_step, gbytes = int4_scale_walk(n_in, group_size)
        wide = int4_lanes(n_in, group_size, lanes) == 16
        nh = len(per_head)
        p = np.ascontiguousarray(packed).reshape(-1).view(np.uint8)
        s = np.ascontiguousarray(scales, dtype=np.float32).reshape(-1)

        def run(x: F32Array) -> F32Array:
            out = np.empty((x.shape[0], nh, n_out), np.float32)  # [T, NH, O]
            _heads_i4(
                p, s, row0, row_step, nh, n_out, n_in, gbytes, s_row, s_step, wide, x, out,
                DEFAULT_PREFETCH,
            )  # fmt: skip
            return out

        spec = (nh, row0, row_step, n_out, n_in, gbytes, s_row, s_step, int(wide))
        return cls(per_head, run, (p, s), "int4", spec)

    def __call__(self, x: npt.NDArray[np.floating]) -> F32Array:
        xx = np.ascontiguousarray(x, dtype=np.float32)  # [T, NH, I]
        if self._run is not None:
            out: F32Array = self._run(xx)  # type: ignore[operator]
            return out
        t = xx.shape[0]
        cols = [lin(np.ascontiguousarray(xx[:, h, :])) for h, lin in enumerate(self._per_head)]  # type: ignore[operator]
        return np.stack(cols, axis=1) if cols else np.empty((t, 0, 0), np.float32)


#: Every compiled kernel (tests check they were built with ``nogil=True``).
KERNELS = (_heads_axpy, _heads_axpy_i4, _heads_i4)

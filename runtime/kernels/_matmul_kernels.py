"""numba kernels for ``y = x @ W.T`` in every storage format, straight from the stored bytes.

Formats and layouts are those of :mod:`storage.quant` (int4: nibble ``q + 8``, low nibble = even
column, rows ``B`` bytes apart, scales ``[O, G]`` row-major or ``[O]`` per row; int8: two's
complement, scales ``[O]``; bf16/f16: raw uint16 bits; f32 as is). No dequantized copy is made.

Determinism and batch invariance: every kernel is serial, ``nogil``, ``fastmath=False``; sums use
explicit 8-lane vectors (:mod:`._simd`) whose lane assignment and reduction order are fixed by the
code below and do not depend on T. The T = 1 and T >= 2 kernels perform the same operations per
(token, row) - the T >= 2 kernels only reuse each decoded weight chunk across tokens - so row
``t`` of the output is bit-identical whether it is computed alone or with 63 other rows. (numpy /
BLAS matmul is not batch-invariant, which is why even f32 has its own kernel.)

int4 math. With ``y1[j] = x[2j+1] / 16`` and ``y2[j] = x[2j] - y1[j]`` prepared once per call,
byte ``j`` (low nibble = column 2j) contributes ``(byte - 136) * y1 + (lo - 8) * y2``, which is
exactly ``(lo - 8) * x[2j] + (hi - 8) * x[2j+1]``: two FMAs per byte, no shift for the high
nibble, and both factors come from one widened load (OR-ing the int into the mantissa of 2**23
gives the float without an int->float convert or numba's int64 promotion). Per row: for each
group a partial ``p`` (8 lanes), then ``acc = fma(scale, p, acc)``; the result is the fixed-order
lane sum of ``acc``. The 16-lane kernels take the byte whole instead (``float(byte)``, one
convert) and start each 32-byte chunk's single FMA chain at a per-lane offset that ``_i4_prep``
stores in a third plane (``-136 * y1`` of the chunk's two bytes per lane), which puts the
``- 136`` back: four FMAs per chunk. Groups of a multiple of 64 columns are read in 32-byte
chunks (8 lanes: four independent FMA chains), other groups (and the last, partial one) 8
bytes at a time, the final
short block from a copy padded with zero weights (byte 0x88). Per-row int4 uses 64-column virtual
groups with the row's scale. Group sizes that are not a multiple of 16 (bytes straddle groups)
take a slower exact path that dequantizes each row into a scratch row first.

The weight stream is software-prefetched ``prefetch_distance`` bytes ahead (``0`` turns it off);
docs/benchmarks.md has the measured effect.

The typed wrappers (argument checks, activation preparation) are in :mod:`.quant_matmul`.

The JIT cache (``cache=True``) is keyed on this file only: after editing ``_simd.py`` or
``_intrinsics.py``, delete ``runtime/kernels/__pycache__/_matmul_kernels*.nb*``.

Shape legend: T tokens, I in features, O out features, G scale groups per row, B = ceil(I / 2)
packed bytes per int4 row, Ys = B rounded up to 8, plus 16 (activation plane stride; a token
has three planes), Ip = I rounded up to 8.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import overload

from runtime.kernels._intrinsics import prefetch, zeros64
from runtime.kernels._simd import (
    bf16x8,
    f16x8,
    i4byte8,
    i4lo8,
    i4lo16,
    i8x8,
    i8x16,
    u8f16,
    vadd,
    vadd16,
    vfma,
    vfma16,
    vhsum,
    vhsum16,
    vload,
    vload16,
    vmul,
    vsplat,
    vsplat16,
    vstore,
    vstore16,
    vzero,
    vzero16,
)

__all__ = ["KERNELS", "i4_expert", "i4_matmul", "i4_swiglu", "silu_mul"]

_TILE = 8  # tokens per pass over the weights in the T >= 2 kernels (x tile stays in L1/L2)
_ROWS = 16  # int4 T >= 2: rows per block sharing one activation segment in L1
_SEGMENT = 64  # int4 T >= 2: packed bytes per row segment (its activations: TILE * 512 B)
_KIND_F32, _KIND_BF16, _KIND_F16, _KIND_I8 = 0, 1, 2, 3
_NIBBLE_ZERO = 0x88  # a padding byte: both nibbles decode to weight 0
_PLANES = 3  # ``_i4_prep`` planes per token: y1, y2, the 16-lane chunk offsets
#: int4 16 lanes, T >= 2 on 64-column groups: the register-tile kernel (``_i4_gemm16_regs``)
#: takes every call (2026-12-05, AVX-512 Intel guest). Full tiles of 4 tokens take the rows in
#: pairs: against the blocked kernel 1.3-1.8x at 2048-6144 columns and T = 4-48. Tiles of 1-2
#: tokens take rows four at a time a quarter of the matrix apart: T = 2 on [2048, 6144] from
#: DRAM 12.0 weight GB/s against the blocked kernel's 5.5; three tokens 9.7 against 4.3.
#: int8 16 lanes, T >= 2 (``_i8_matmul16_tiles``): rows per block, tokens per pass over a block.
_I8_ROWS = 16
_I8_TOKENS = 32
#: int4 8 lanes: up to ``_FEW_MAX_T`` tokens take ``_i4_gemm_few`` (64-column groups or per-row
#: scales), in runs of up to ``_FEW_RUN`` tokens per pass over a row; more take ``_i4_gemm``.
_FEW_MAX_T = 4
_FEW_RUN = 4
#: int4 T = 1 (``gbytes == 32``): rows computed side by side, a quarter of the matrix apart
_STREAMS = 4


# ============================================================================ x preparation


@njit(nogil=True, cache=True)
def _i4_prep(x, nb, ys):  # type: ignore[no-untyped-def]
    """x [T, I] -> y flat [T, 3, Ys]: per token ``y1``, ``y2`` (zero padded) and the 16-lane
    chunk offsets ``c``, see below.

    For byte ``j`` (columns 2j, 2j+1): ``y1 = x[2j+1] / 16`` and ``y2 = x[2j] - y1``, so that
    ``(byte - 136) * y1 + (lo - 8) * y2 = (lo - 8) * x[2j] + (hi - 8) * x[2j+1]``: two FMAs per
    byte and no shift to extract the high nibble (the 8-lane kernels). The 16-lane kernels
    take ``byte`` itself (one int -> float convert instead of an or and a subtraction) and
    begin each 32-byte chunk's chain at ``c``: lane ``l`` of the chunk at byte ``k`` holds
    ``-(136 * y1[k+l] + 136 * y1[k+16+l])`` (stored at ``k + l``), which puts the ``- 136``
    back. ``Ys`` is B rounded up to 8 plus 16 floats so that the rows of different tokens do
    not all map to the same L1 sets (4 KiB aliasing).
    """
    n_tok, n_in = x.shape
    y = zeros64(n_tok * _PLANES * ys, np.float32)  # [T, 3, Ys], 64-byte aligned
    sixteenth = np.float32(0.0625)
    bias = np.float32(136.0)
    half = n_in // 2
    for t in range(n_tok):
        xt = x[t]  # [I]
        base = t * _PLANES * ys
        y1 = y[base : base + ys]  # [Ys] view
        y2 = y[base + ys : base + 2 * ys]  # [Ys] view
        c = y[base + 2 * ys : base + 3 * ys]  # [Ys] view
        for j in range(half):
            a = xt[2 * j + 1] * sixteenth  # exact: a power of two
            y1[j] = a
            y2[j] = xt[2 * j] - a
        if n_in % 2:
            y2[half] = xt[n_in - 1]  # the last byte's high nibble is padding (x = 0)
        for k in range(0, ys - 31, 32):
            for lane in range(16):
                lo = bias * y1[k + lane]
                hi = bias * y1[k + 16 + lane]
                c[k + lane] = -(lo + hi)
    return y


@njit(nogil=True, cache=True)
def _pad_rows(x, ip):  # type: ignore[no-untyped-def]
    """x [T, I] -> flat [T * Ip], each row zero padded to Ip."""
    n_tok, n_in = x.shape
    xp = zeros64(n_tok * ip, np.float32)  # [T * Ip], 64-byte aligned
    for t in range(n_tok):
        base = t * ip
        for c in range(n_in):
            xp[base + c] = x[t, c]
    return xp


# ============================================================================ int4 building blocks


@njit(nogil=True, cache=True, inline="always")
def _i4_decode32(packed, i):  # type: ignore[no-untyped-def]
    """32 packed bytes at ``i`` -> (byte - 136, lo - 8) float vectors for each of 4 blocks."""
    return (
        i4byte8(packed, i),
        i4lo8(packed, i),
        i4byte8(packed, i + 8),
        i4lo8(packed, i + 8),
        i4byte8(packed, i + 16),
        i4lo8(packed, i + 16),
        i4byte8(packed, i + 24),
        i4lo8(packed, i + 24),
    )


@njit(nogil=True, cache=True, inline="always")
def _i4_dot32(w, y, yi, ys):  # type: ignore[no-untyped-def]
    """Partial (8 lanes) of one decoded 32-byte chunk against ``y1 = y[yi:]``, ``y2 = y[yi+ys:]``.

    Four independent chains hide the FMA latency; the combine order is fixed.
    """
    zi = yi + ys
    a = vfma(w[4], vload(y, yi + 16), vmul(w[0], vload(y, yi)))
    b = vfma(w[6], vload(y, yi + 24), vmul(w[2], vload(y, yi + 8)))
    c = vfma(w[5], vload(y, zi + 16), vmul(w[1], vload(y, zi)))
    d = vfma(w[7], vload(y, zi + 24), vmul(w[3], vload(y, zi + 8)))
    return vadd(vadd(a, b), vadd(c, d))


@njit(nogil=True, cache=True, inline="always")
def _fill_tail(tail, packed, start, n):  # type: ignore[no-untyped-def]
    """Copy ``n < 8`` bytes into the padded scratch ``tail`` (rest stays ``_NIBBLE_ZERO``)."""
    for k in range(n):
        tail[k] = packed[start + k]


# ============================================================================ int4 kernels


@njit(nogil=True, cache=True, inline="always")
def _i4_quad_group(packed, scales, g, rows, srows, s_step, y, ys, accs):  # type: ignore[no-untyped-def]
    """``_i4_quad16_group`` with 8 lanes (the arithmetic of ``_i4_gemv``'s hot path)."""
    g0 = g * 32
    gs = np.uintp(g * s_step)
    a0, a1, a2, a3 = accs
    p = _i4_dot32(_i4_decode32(packed, rows[0] + g0), y, g0, ys)
    a0 = vfma(vsplat(scales[np.uintp(srows[0]) + gs]), p, a0)
    p = _i4_dot32(_i4_decode32(packed, rows[1] + g0), y, g0, ys)
    a1 = vfma(vsplat(scales[np.uintp(srows[1]) + gs]), p, a1)
    p = _i4_dot32(_i4_decode32(packed, rows[2] + g0), y, g0, ys)
    a2 = vfma(vsplat(scales[np.uintp(srows[2]) + gs]), p, a2)
    p = _i4_dot32(_i4_decode32(packed, rows[3] + g0), y, g0, ys)
    a3 = vfma(vsplat(scales[np.uintp(srows[3]) + gs]), p, a3)
    return a0, a1, a2, a3


@njit(nogil=True, cache=True, inline="always")
def _i4_quad(packed, scales, o, quarter, n_groups, nb, s_row, s_step, y, ys, out, pf):  # type: ignore[no-untyped-def]
    """``_i4_quad16`` for the 8-lane ``_i4_gemv`` (rows of whole 32-byte groups)."""
    q = quarter * nb
    rows = (o * nb, o * nb + q, o * nb + 2 * q, o * nb + 3 * q)
    sq = quarter * s_row
    srows = (o * s_row, o * s_row + sq, o * s_row + 2 * sq, o * s_row + 3 * sq)
    ahead = pf // _STREAMS
    accs = (vzero(), vzero(), vzero(), vzero())
    for g in range(n_groups):
        if ahead > 0 and g % 2 == 0:  # one cache line per row every two groups
            g0 = g * 32 + ahead
            prefetch(packed, rows[0] + g0)
            prefetch(packed, rows[1] + g0)
            prefetch(packed, rows[2] + g0)
            prefetch(packed, rows[3] + g0)
        accs = _i4_quad_group(packed, scales, g, rows, srows, s_step, y, ys, accs)
    out[o] = vhsum(accs[0])
    out[o + quarter] = vhsum(accs[1])
    out[o + 2 * quarter] = vhsum(accs[2])
    out[o + 3 * quarter] = vhsum(accs[3])


@njit(nogil=True, cache=True)
def _i4_gemv(packed, scales, n_out, nb, gbytes, s_row, s_step, y, ys, out, pf):  # type: ignore[no-untyped-def]
    """One token: out [O] from packed [O * B], scales and the token's ``_i4_prep`` row ``y``.

    ``gbytes`` bytes per group (group size / 2, or 32 for per-row scales), ``s_row`` scales per
    row, ``s_step`` scale index step per group (0 for per-row), ``pf`` prefetch bytes (0 = off).
    """
    tail = np.full(8, _NIBBLE_ZERO, np.uint8)  # [8] padded last block
    n_full = nb // gbytes
    rem = nb - n_full * gbytes
    rem_blocks = rem // 8
    rem_tail = rem - rem_blocks * 8
    chunked = gbytes % 32 == 0
    quarter = n_out // _STREAMS if gbytes == 32 and rem == 0 else 0
    for o in range(quarter):
        _i4_quad(packed, scales, o, quarter, n_full, nb, s_row, s_step, y, ys, out, pf)
    for o in range(_STREAMS * quarter, n_out):
        row = o * nb
        srow = o * s_row
        acc = vzero()
        if gbytes == 32:  # gs64 and per-row: one chunk per group, the hot path
            for g in range(n_full):
                g0 = g * 32
                if pf > 0:
                    prefetch(packed, row + g0 + pf)
                p = _i4_dot32(_i4_decode32(packed, row + g0), y, g0, ys)
                acc = vfma(vsplat(scales[srow + g * s_step]), p, acc)
        for g in range(0 if gbytes != 32 else n_full, n_full):
            g0 = g * gbytes
            if chunked:
                if pf > 0:
                    prefetch(packed, row + g0 + pf)
                p = _i4_dot32(_i4_decode32(packed, row + g0), y, g0, ys)
                for c in range(g0 + 32, g0 + gbytes, 32):
                    if pf > 0:
                        prefetch(packed, row + c + pf)
                    p = vadd(p, _i4_dot32(_i4_decode32(packed, row + c), y, c, ys))
            else:
                if pf > 0:
                    prefetch(packed, row + g0 + pf)
                pb = vzero()
                pl = vzero()
                for c in range(g0, g0 + gbytes, 8):
                    pb = vfma(i4byte8(packed, row + c), vload(y, c), pb)
                    pl = vfma(i4lo8(packed, row + c), vload(y, ys + c), pl)
                p = vadd(pb, pl)
            acc = vfma(vsplat(scales[srow + g * s_step]), p, acc)
        if rem > 0:
            g0 = n_full * gbytes
            pb = vzero()
            pl = vzero()
            for c in range(g0, g0 + rem_blocks * 8, 8):
                pb = vfma(i4byte8(packed, row + c), vload(y, c), pb)
                pl = vfma(i4lo8(packed, row + c), vload(y, ys + c), pl)
            if rem_tail > 0:
                c = g0 + rem_blocks * 8
                _fill_tail(tail, packed, row + c, rem_tail)
                pb = vfma(i4byte8(tail, 0), vload(y, c), pb)
                pl = vfma(i4lo8(tail, 0), vload(y, ys + c), pl)
            acc = vfma(vsplat(scales[srow + n_full * s_step]), vadd(pb, pl), acc)
        out[o] = vhsum(acc)


@njit(nogil=True, cache=True)
def _i4_gemm(packed, scales, n_out, nb, gbytes, s_row, s_step, y, ys, out, pf):  # type: ignore[no-untyped-def]
    """T tokens: out [T, O]; per (token, row) exactly the arithmetic of ``_i4_gemv``.

    Each 32-byte chunk (or 8-byte block) is decoded once and applied to every token of a tile.
    Rows are taken in blocks of ``_ROWS`` and columns in segments of whole groups, so the
    activations of a tile's segment stay in L1 while the block's rows pass over them (without
    this the kernel is bound by L2 reads of activations and gains nothing over T GEMVs). Groups
    of a row are still visited in increasing order, so the result per token does not change.
    """
    n_tok = out.shape[0]
    tail = np.full(8, _NIBBLE_ZERO, np.uint8)  # [8]
    acc = np.zeros(_ROWS * _TILE * 8, np.float32)  # [ROWS, TILE, 8] accumulators
    pp = np.zeros(_TILE * 8, np.float32)  # [TILE, 8] group partials
    pb = np.zeros(_TILE * 8, np.float32)  # [TILE, 8] (byte - 136) * y1 partials (blocks)
    pl = np.zeros(_TILE * 8, np.float32)  # [TILE, 8] (lo - 8) * y2 partials (blocks)
    n_full = nb // gbytes
    rem = nb - n_full * gbytes
    rem_blocks = rem // 8
    rem_tail = rem - rem_blocks * 8
    chunked = gbytes % 32 == 0
    seg = gbytes * max(1, _SEGMENT // gbytes)  # whole groups per segment
    full_end = n_full * gbytes
    n_seg = (full_end + seg - 1) // seg
    zero = vzero()
    for t0 in range(0, n_tok, _TILE):
        nt = min(_TILE, n_tok - t0)
        for o0 in range(0, n_out, _ROWS):
            nr = min(_ROWS, n_out - o0)
            for k in range(nr * _TILE):
                vstore(acc, k * 8, zero)
            for si in range(n_seg + (1 if rem > 0 else 0)):
                last = si == n_seg  # the partial group, alone, after every full one
                s0 = full_end if last else si * seg
                s1 = min(s0 + seg, full_end)
                gi0 = n_full if last else si * (seg // gbytes)  # index of the first group
                for r in range(nr):
                    o = o0 + r
                    row = o * nb
                    a0 = r * _TILE * 8
                    g0 = s0
                    gi = gi0
                    while g0 < s1 or last:
                        s = vsplat(scales[o * s_row + gi * s_step])
                        if chunked and not last:
                            if gbytes == 32:  # one chunk per group: p is that chunk's partial
                                if pf > 0:
                                    prefetch(packed, row + g0 + seg)
                                w = _i4_decode32(packed, row + g0)
                                for u in range(nt):
                                    q = _i4_dot32(w, y, (t0 + u) * _PLANES * ys + g0, ys)
                                    ai = a0 + u * 8
                                    vstore(acc, ai, vfma(s, q, vload(acc, ai)))
                                g0 += gbytes
                                gi += 1
                                continue
                            for c in range(g0, g0 + gbytes, 32):
                                if pf > 0:
                                    prefetch(packed, row + c + seg)
                                w = _i4_decode32(packed, row + c)
                                for u in range(nt):
                                    q = _i4_dot32(w, y, (t0 + u) * _PLANES * ys + c, ys)
                                    if c == g0:
                                        vstore(pp, u * 8, q)
                                    else:
                                        vstore(pp, u * 8, vadd(vload(pp, u * 8), q))
                        else:
                            if pf > 0:
                                prefetch(packed, row + g0 + seg)
                            for u in range(nt):
                                vstore(pb, u * 8, zero)
                                vstore(pl, u * 8, zero)
                            if last:
                                g1 = g0 + rem_blocks * 8
                                n_tail = rem_tail
                            else:
                                g1 = g0 + gbytes
                                n_tail = 0
                            for c in range(g0, g1 + (8 if n_tail > 0 else 0), 8):
                                if c < g1:
                                    wb = i4byte8(packed, row + c)
                                    wl = i4lo8(packed, row + c)
                                else:
                                    _fill_tail(tail, packed, row + c, n_tail)
                                    wb = i4byte8(tail, 0)
                                    wl = i4lo8(tail, 0)
                                for u in range(nt):
                                    yi = (t0 + u) * _PLANES * ys + c
                                    vstore(pb, u * 8, vfma(wb, vload(y, yi), vload(pb, u * 8)))
                                    vstore(pl, u * 8, vfma(wl, vload(y, yi + ys), vload(pl, u * 8)))
                            for u in range(nt):
                                vstore(pp, u * 8, vadd(vload(pb, u * 8), vload(pl, u * 8)))
                        for u in range(nt):
                            ai = a0 + u * 8
                            vstore(acc, ai, vfma(s, vload(pp, u * 8), vload(acc, ai)))
                        if last:
                            break
                        g0 += gbytes
                        gi += 1
            for r in range(nr):
                for u in range(nt):
                    out[t0 + u, o0 + r] = vhsum(vload(acc, (r * _TILE + u) * 8))


@njit(nogil=True, cache=True, inline="always")
def _i4_row_few(packed, scales, row, srow, s_step, n_full, y, ys, y0, nt, pf):  # type: ignore[no-untyped-def]
    """One weight row against ``nt`` (1..4) tokens whose ``_i4_prep`` rows start at ``y0``:
    each decoded chunk serves every token, the accumulators stay in registers. Per token
    exactly the arithmetic of ``_i4_gemv``'s hot path (the unused accumulators stay zero)."""
    a = vzero()
    b = vzero()
    c = vzero()
    d = vzero()
    step = _PLANES * ys
    for g in range(n_full):
        g0 = g * 32
        if pf > 0:
            prefetch(packed, row + g0 + pf)
        w = _i4_decode32(packed, row + g0)
        s = vsplat(scales[srow + g * s_step])
        a = vfma(s, _i4_dot32(w, y, y0 + g0, ys), a)
        if nt > 1:
            b = vfma(s, _i4_dot32(w, y, y0 + step + g0, ys), b)
        if nt > 2:
            c = vfma(s, _i4_dot32(w, y, y0 + 2 * step + g0, ys), c)
        if nt > 3:
            d = vfma(s, _i4_dot32(w, y, y0 + 3 * step + g0, ys), d)
    return a, b, c, d


@njit(nogil=True, cache=True)
def _i4_gemm_few(packed, scales, n_out, nb, s_row, s_step, y, ys, out, pf):  # type: ignore[no-untyped-def]
    """A few tokens (at most ``_FEW_MAX_T``), one 32-byte chunk per group (``gbytes == 32``,
    ``nb`` a multiple of 32): per row, the tokens in runs of up to ``_FEW_RUN`` that share each
    decoded chunk, with their accumulators in registers (``_i4_row_few``). Per (token, row)
    exactly the arithmetic of ``_i4_gemv``'s hot path, so the same bits. (The blocked
    ``_i4_gemm`` keeps its accumulators in memory: on a core with two address units its loads
    and stores, not its FMAs, bound it at a few tokens.)"""
    n_tok = out.shape[0]
    n_full = nb // 32
    for o in range(n_out):
        row = o * nb
        srow = o * s_row
        for t in range(0, n_tok, _FEW_RUN):
            nt = min(_FEW_RUN, n_tok - t)
            a, b, c, d = _i4_row_few(
                packed, scales, row, srow, s_step, n_full, y, ys, t * _PLANES * ys, nt,
                pf if t == 0 else 0,
            )  # fmt: skip
            out[t, o] = vhsum(a)
            if nt > 1:
                out[t + 1, o] = vhsum(b)
            if nt > 2:
                out[t + 2, o] = vhsum(c)
            if nt > 3:
                out[t + 3, o] = vhsum(d)


# ============================================================================ int4, 16 lanes


@njit(nogil=True, cache=True, inline="always")
def _i4_decode32x16(packed, i):  # type: ignore[no-untyped-def]
    """32 packed bytes at ``i`` -> (byte, lo - 8) 16-lane vectors for each of 2 halves (the
    ``- 136`` of the byte is in the chunk offsets of ``_i4_prep``)."""
    return (
        u8f16(packed, i),
        i4lo16(packed, i),
        u8f16(packed, i + 16),
        i4lo16(packed, i + 16),
    )


@njit(nogil=True, cache=True, inline="always")
def _i4_dot32x16(w, y, yi, ys):  # type: ignore[no-untyped-def]
    """Partial (16 lanes) of one decoded 32-byte chunk: one multiply-add chain in a fixed
    order, from the chunk's offsets (``y[yi + 2 * ys:]``) through bytes 0-15 (whole byte,
    then low nibble) and 16-31. The kernels are bound by vector ops, and this is 4 per 16
    bytes where the two-chain sum of ``byte - 136`` products took 7 (measured on an AVX-512
    Intel guest, see docs/benchmarks.md)."""
    zi = yi + ys
    a = vfma16(w[0], vload16(y, yi), vload16(y, zi + ys))
    a = vfma16(w[1], vload16(y, zi), a)
    a = vfma16(w[2], vload16(y, yi + 16), a)
    return vfma16(w[3], vload16(y, zi + 16), a)


@njit(nogil=True, cache=True, inline="always")
def _i4_quad16_group(packed, scales, g, rows, srows, s_step, y, ys, accs):  # type: ignore[no-untyped-def]
    """Group ``g`` (32 bytes) of the four rows at byte offsets ``rows`` (scale offsets
    ``srows``) into their accumulators ``accs``: the single-row arithmetic of ``_i4_gemv16``.
    Indices are unsigned: a signed index costs numba's negative-index fix-up, scalar ops
    that competed with the vector ones for the same ports."""
    g0 = g * 32
    gs = np.uintp(g * s_step)
    a0, a1, a2, a3 = accs
    p = _i4_dot32x16(_i4_decode32x16(packed, rows[0] + g0), y, g0, ys)
    a0 = vfma16(vsplat16(scales[np.uintp(srows[0]) + gs]), p, a0)
    p = _i4_dot32x16(_i4_decode32x16(packed, rows[1] + g0), y, g0, ys)
    a1 = vfma16(vsplat16(scales[np.uintp(srows[1]) + gs]), p, a1)
    p = _i4_dot32x16(_i4_decode32x16(packed, rows[2] + g0), y, g0, ys)
    a2 = vfma16(vsplat16(scales[np.uintp(srows[2]) + gs]), p, a2)
    p = _i4_dot32x16(_i4_decode32x16(packed, rows[3] + g0), y, g0, ys)
    a3 = vfma16(vsplat16(scales[np.uintp(srows[3]) + gs]), p, a3)
    return a0, a1, a2, a3


@njit(nogil=True, cache=True, inline="always")
def _i4_quad16(packed, scales, o, quarter, n_groups, nb, s_row, s_step, y, ys, out, pf):  # type: ignore[no-untyped-def]
    """Rows ``o``, ``o + quarter``, ``o + 2 * quarter``, ``o + 3 * quarter`` of a one-chunk-per-
    group (``gbytes == 32``) GEMV side by side, each with exactly the arithmetic of the single-
    row loop of ``_i4_gemv16``. Four read streams a quarter of the matrix apart keep more
    DRAM reads in flight than one: on an AVX-512 Intel guest [2048, 6144] from DRAM went from
    0.59 to ~0.75 of a one-thread read loop (adjacent rows side by side did not help:
    0.39-0.65). Each stream is prefetched ``pf / 4`` ahead (the bytes in flight of one stream
    at ``pf``; on huge pages 1 KiB ahead per stream was 3-4% faster than 2 KiB, and 2 KiB 5-8%
    faster than 4 KiB on 4 KiB pages), once every two groups (one cache line per row). One
    group per pass: with two per pass and an odd group after the loop, LLVM kept the
    accumulators in memory across the joins, ~10 ns per row more (a [256, 128] GEMV from L2:
    3.9 -> 1.2 us, AVX-512 Intel guest; from DRAM the same). See docs/benchmarks.md."""
    q = quarter * nb
    rows = (o * nb, o * nb + q, o * nb + 2 * q, o * nb + 3 * q)
    sq = quarter * s_row
    srows = (o * s_row, o * s_row + sq, o * s_row + 2 * sq, o * s_row + 3 * sq)
    ahead = pf // _STREAMS
    accs = (vzero16(), vzero16(), vzero16(), vzero16())
    for g in range(n_groups):
        if ahead > 0 and g % 2 == 0:  # one cache line per row every two groups
            g0 = g * 32 + ahead
            prefetch(packed, rows[0] + g0)
            prefetch(packed, rows[1] + g0)
            prefetch(packed, rows[2] + g0)
            prefetch(packed, rows[3] + g0)
        accs = _i4_quad16_group(packed, scales, g, rows, srows, s_step, y, ys, accs)
    out[o] = vhsum16(accs[0])
    out[o + quarter] = vhsum16(accs[1])
    out[o + 2 * quarter] = vhsum16(accs[2])
    out[o + 3 * quarter] = vhsum16(accs[3])


@njit(nogil=True, cache=True)
def _i4_gemv16(packed, scales, n_out, nb, gbytes, s_row, s_step, y, ys, out, pf):  # type: ignore[no-untyped-def]
    """``_i4_gemv`` with 16-lane vectors, for ``gbytes % 32 == 0`` and ``nb % gbytes == 0``.

    Per group: the chunks' partials summed in order, then ``acc = fma(scale, p, acc)``; the
    result is the fixed-order lane sum of ``acc``. Prefetch once per 64 bytes.
    """
    n_groups = nb // gbytes
    quarter = n_out // _STREAMS if gbytes == 32 else 0
    for o in range(quarter):
        _i4_quad16(packed, scales, o, quarter, n_groups, nb, s_row, s_step, y, ys, out, pf)
    for o in range(_STREAMS * quarter, n_out):
        row = o * nb
        srow = o * s_row
        acc = vzero16()
        if gbytes == 32:  # gs64 and per-row: one chunk per group, the hot path
            for g in range(n_groups):
                g0 = g * 32
                if pf > 0 and g % 2 == 0:
                    prefetch(packed, row + g0 + pf)
                p = _i4_dot32x16(_i4_decode32x16(packed, row + g0), y, g0, ys)
                acc = vfma16(vsplat16(scales[srow + g * s_step]), p, acc)
        else:
            for g in range(n_groups):
                g0 = g * gbytes
                if pf > 0:
                    prefetch(packed, row + g0 + pf)
                p = _i4_dot32x16(_i4_decode32x16(packed, row + g0), y, g0, ys)
                for c in range(g0 + 32, g0 + gbytes, 32):
                    if pf > 0 and (c - g0) % 64 == 0:
                        prefetch(packed, row + c + pf)
                    p = vadd16(p, _i4_dot32x16(_i4_decode32x16(packed, row + c), y, c, ys))
                acc = vfma16(vsplat16(scales[srow + g * s_step]), p, acc)
        out[o] = vhsum16(acc)


@njit(nogil=True, cache=True, inline="always")
def _i4_pairs16(packed, scales, n_pairs, nb, s_row, s_step, y, ys, out, pf, t0):  # type: ignore[no-untyped-def]
    """Tokens ``t0 .. t0 + 3`` against rows ``0 .. 2 * n_pairs - 1``, two rows at a time: each
    chunk of both rows decoded once, each activation load shared by the two rows, the eight
    accumulators in registers across the whole rows."""
    n_groups = nb // 32
    y0 = t0 * _PLANES * ys
    y1, y2, y3 = y0 + _PLANES * ys, y0 + 2 * _PLANES * ys, y0 + 3 * _PLANES * ys
    for pair in range(n_pairs):
        o = 2 * pair
        row = o * nb
        rowb = row + nb
        srow = o * s_row
        srowb = srow + s_row
        a0 = vzero16()
        a1 = vzero16()
        a2 = vzero16()
        a3 = vzero16()
        b0 = vzero16()
        b1 = vzero16()
        b2 = vzero16()
        b3 = vzero16()
        for g in range(n_groups):
            g0 = g * 32
            if pf > 0 and g % 2 == 0:
                prefetch(packed, row + g0 + pf)
                prefetch(packed, rowb + g0 + pf)
            w = _i4_decode32x16(packed, row + g0)
            v = _i4_decode32x16(packed, rowb + g0)
            sc = vsplat16(scales[srow + g * s_step])
            sd = vsplat16(scales[srowb + g * s_step])
            a0 = vfma16(sc, _i4_dot32x16(w, y, y0 + g0, ys), a0)
            b0 = vfma16(sd, _i4_dot32x16(v, y, y0 + g0, ys), b0)
            a1 = vfma16(sc, _i4_dot32x16(w, y, y1 + g0, ys), a1)
            b1 = vfma16(sd, _i4_dot32x16(v, y, y1 + g0, ys), b1)
            a2 = vfma16(sc, _i4_dot32x16(w, y, y2 + g0, ys), a2)
            b2 = vfma16(sd, _i4_dot32x16(v, y, y2 + g0, ys), b2)
            a3 = vfma16(sc, _i4_dot32x16(w, y, y3 + g0, ys), a3)
            b3 = vfma16(sd, _i4_dot32x16(v, y, y3 + g0, ys), b3)
        out[t0, o] = vhsum16(a0)
        out[t0 + 1, o] = vhsum16(a1)
        out[t0 + 2, o] = vhsum16(a2)
        out[t0 + 3, o] = vhsum16(a3)
        out[t0, o + 1] = vhsum16(b0)
        out[t0 + 1, o + 1] = vhsum16(b1)
        out[t0 + 2, o + 1] = vhsum16(b2)
        out[t0 + 3, o + 1] = vhsum16(b3)


@njit(nogil=True, cache=True, inline="always")
def _i4_rows16(packed, scales, o0, n_out, nb, s_row, s_step, y, ys, out, pf, t0, nt):  # type: ignore[no-untyped-def]
    """Tokens ``t0 .. t0 + nt - 1`` (``nt`` 1 to 4) against rows ``o0 .. n_out - 1``, one row at
    a time: each chunk decoded once for the tile, the accumulators in registers."""
    n_groups = nb // 32
    y0 = t0 * _PLANES * ys
    y1, y2, y3 = y0 + _PLANES * ys, y0 + 2 * _PLANES * ys, y0 + 3 * _PLANES * ys
    for o in range(o0, n_out):
        row = o * nb
        srow = o * s_row
        a0 = vzero16()
        a1 = vzero16()
        a2 = vzero16()
        a3 = vzero16()
        for g in range(n_groups):
            g0 = g * 32
            if pf > 0 and g % 2 == 0:
                prefetch(packed, row + g0 + pf)
            w = _i4_decode32x16(packed, row + g0)
            sc = vsplat16(scales[srow + g * s_step])
            a0 = vfma16(sc, _i4_dot32x16(w, y, y0 + g0, ys), a0)
            if nt >= 2:
                a1 = vfma16(sc, _i4_dot32x16(w, y, y1 + g0, ys), a1)
            if nt >= 3:
                a2 = vfma16(sc, _i4_dot32x16(w, y, y2 + g0, ys), a2)
            if nt == 4:
                a3 = vfma16(sc, _i4_dot32x16(w, y, y3 + g0, ys), a3)
        out[t0, o] = vhsum16(a0)
        if nt >= 2:
            out[t0 + 1, o] = vhsum16(a1)
        if nt >= 3:
            out[t0 + 2, o] = vhsum16(a2)
        if nt == 4:
            out[t0 + 3, o] = vhsum16(a3)


@njit(nogil=True, cache=True, inline="always")
def _i4_tile2_group(packed, scales, g, row, srow, s_step, y, ya, yb, ys, a, b):  # type: ignore[no-untyped-def]
    """Group ``g`` of the row at byte offset ``row`` against the tokens whose ``_i4_prep`` rows
    start at ``ya`` and ``yb``: decoded once, then per token the arithmetic of
    ``_i4_gemv16``."""
    g0 = g * 32
    w = _i4_decode32x16(packed, row + g0)
    sc = vsplat16(scales[np.uintp(srow) + np.uintp(g * s_step)])
    a = vfma16(sc, _i4_dot32x16(w, y, ya + g0, ys), a)
    b = vfma16(sc, _i4_dot32x16(w, y, yb + g0, ys), b)
    return a, b


@njit(nogil=True, cache=True, inline="always")
def _i4_quads16(packed, scales, quarter, nb, s_row, s_step, y, ys, out, pf, t0):  # type: ignore[no-untyped-def]
    """Tokens ``t0``, ``t0 + 1`` against rows ``0 .. 4 * quarter - 1``, four rows at a time a
    quarter of the matrix apart (four DRAM read streams, as ``_i4_quad16``), each chunk
    decoded once per row for both tokens, the accumulators in registers. Two tokens against a
    [1024, 2048] expert matrix from DRAM: 1.5x the rows one at a time (AVX-512 Intel
    guest)."""
    n_groups = nb // 32
    ya = t0 * _PLANES * ys
    yb = ya + _PLANES * ys
    q = quarter * nb
    sq = quarter * s_row
    ahead = pf // _STREAMS
    for o in range(quarter):
        r0 = o * nb
        s0 = o * s_row
        a0, b0, a1, b1 = vzero16(), vzero16(), vzero16(), vzero16()
        a2, b2, a3, b3 = vzero16(), vzero16(), vzero16(), vzero16()
        for g in range(n_groups):
            if ahead > 0 and g % 2 == 0:
                g0 = g * 32 + ahead
                prefetch(packed, r0 + g0)
                prefetch(packed, r0 + q + g0)
                prefetch(packed, r0 + 2 * q + g0)
                prefetch(packed, r0 + 3 * q + g0)
            a0, b0 = _i4_tile2_group(packed, scales, g, r0, s0, s_step, y, ya, yb, ys, a0, b0)
            a1, b1 = _i4_tile2_group(
                packed, scales, g, r0 + q, s0 + sq, s_step, y, ya, yb, ys, a1, b1
            )
            a2, b2 = _i4_tile2_group(
                packed, scales, g, r0 + 2 * q, s0 + 2 * sq, s_step, y, ya, yb, ys, a2, b2
            )
            a3, b3 = _i4_tile2_group(
                packed, scales, g, r0 + 3 * q, s0 + 3 * sq, s_step, y, ya, yb, ys, a3, b3
            )
        out[t0, o] = vhsum16(a0)
        out[t0, o + quarter] = vhsum16(a1)
        out[t0, o + 2 * quarter] = vhsum16(a2)
        out[t0, o + 3 * quarter] = vhsum16(a3)
        out[t0 + 1, o] = vhsum16(b0)
        out[t0 + 1, o + quarter] = vhsum16(b1)
        out[t0 + 1, o + 2 * quarter] = vhsum16(b2)
        out[t0 + 1, o + 3 * quarter] = vhsum16(b3)


@njit(nogil=True, cache=True, inline="always")
def _i4_tile3_group(packed, scales, g, row, srow, s_step, y, yt, ys, a, b, c):  # type: ignore[no-untyped-def]
    """``_i4_tile2_group`` for three tokens (``_i4_prep`` rows at ``yt[0]``, ``yt[1]``,
    ``yt[2]``)."""
    g0 = g * 32
    w = _i4_decode32x16(packed, row + g0)
    sc = vsplat16(scales[np.uintp(srow) + np.uintp(g * s_step)])
    a = vfma16(sc, _i4_dot32x16(w, y, yt[0] + g0, ys), a)
    b = vfma16(sc, _i4_dot32x16(w, y, yt[1] + g0, ys), b)
    c = vfma16(sc, _i4_dot32x16(w, y, yt[2] + g0, ys), c)
    return a, b, c


@njit(nogil=True, cache=True, inline="always")
def _i4_store3(out, t0, o, a, b, c):  # type: ignore[no-untyped-def]
    """Row ``o`` of tokens ``t0 .. t0 + 2`` from their accumulators."""
    out[t0, o] = vhsum16(a)
    out[t0 + 1, o] = vhsum16(b)
    out[t0 + 2, o] = vhsum16(c)


@njit(nogil=True, cache=True, inline="always")
def _i4_quads16_t3(packed, scales, quarter, nb, s_row, s_step, y, ys, out, pf, t0):  # type: ignore[no-untyped-def]
    """``_i4_quads16`` for tokens ``t0 .. t0 + 2`` (twelve accumulators). Three tokens from
    DRAM: [1024, 2048] 6.7 -> 9.8, [2048, 6144] 4.9 -> 9.7 weight GB/s against the rows one at
    a time (AVX-512 Intel guest)."""
    n_groups = nb // 32
    y0 = t0 * _PLANES * ys
    yt = (y0, y0 + _PLANES * ys, y0 + 2 * _PLANES * ys)
    q = quarter * nb
    sq = quarter * s_row
    ahead = pf // _STREAMS
    for o in range(quarter):
        r0 = o * nb
        s0 = o * s_row
        a0, b0, c0 = vzero16(), vzero16(), vzero16()
        a1, b1, c1 = vzero16(), vzero16(), vzero16()
        a2, b2, c2 = vzero16(), vzero16(), vzero16()
        a3, b3, c3 = vzero16(), vzero16(), vzero16()
        for g in range(n_groups):
            if ahead > 0 and g % 2 == 0:
                g0 = g * 32 + ahead
                prefetch(packed, r0 + g0)
                prefetch(packed, r0 + q + g0)
                prefetch(packed, r0 + 2 * q + g0)
                prefetch(packed, r0 + 3 * q + g0)
            a0, b0, c0 = _i4_tile3_group(packed, scales, g, r0, s0, s_step, y, yt, ys, a0, b0, c0)
            a1, b1, c1 = _i4_tile3_group(
                packed, scales, g, r0 + q, s0 + sq, s_step, y, yt, ys, a1, b1, c1
            )
            a2, b2, c2 = _i4_tile3_group(
                packed, scales, g, r0 + 2 * q, s0 + 2 * sq, s_step, y, yt, ys, a2, b2, c2
            )
            a3, b3, c3 = _i4_tile3_group(
                packed, scales, g, r0 + 3 * q, s0 + 3 * sq, s_step, y, yt, ys, a3, b3, c3
            )
        _i4_store3(out, t0, o, a0, b0, c0)
        _i4_store3(out, t0, o + quarter, a1, b1, c1)
        _i4_store3(out, t0, o + 2 * quarter, a2, b2, c2)
        _i4_store3(out, t0, o + 3 * quarter, a3, b3, c3)


@njit(nogil=True, cache=True)
def _i4_gemm16_regs(packed, scales, n_out, nb, s_row, s_step, y, ys, out, pf):  # type: ignore[no-untyped-def]
    """T tokens for ``gbytes == 32``: tokens in register tiles of 4; a full tile takes the rows
    in pairs (``_i4_pairs16``: per pair and chunk two decodes and 20 activation loads for 40
    multiply-adds), a last tile of one token ``_i4_gemv16``, of two or three tokens four rows
    a quarter of the matrix apart (``_i4_quads16``, ``_i4_quads16_t3``: four DRAM read
    streams), the rows left over one at a time (``_i4_rows16``). Every token's accumulator
    stays in a register across the whole row, so no activation tile has to stay in L1. Per
    (token, row) exactly the arithmetic of ``_i4_gemv16``."""
    n_tok = out.shape[0]
    t0 = 0
    while t0 < n_tok:
        nt = min(4, n_tok - t0)
        if nt == 4:
            _i4_pairs16(packed, scales, n_out // 2, nb, s_row, s_step, y, ys, out, pf, t0)
            o0 = n_out - n_out % 2
        elif nt == 1:  # the one-token kernel on this token's planes, every row
            _i4_gemv16(
                packed,
                scales,
                n_out,
                nb,
                np.int64(32),  # (a literal 32 compiled a second _i4_gemv16: 1.3 s cold)
                s_row,
                s_step,
                y[t0 * _PLANES * ys :],
                ys,
                out[t0],
                pf,
            )
            o0 = n_out
        elif nt == 2:
            _i4_quads16(packed, scales, n_out // 4, nb, s_row, s_step, y, ys, out, pf, t0)
            o0 = n_out - n_out % 4
        else:
            _i4_quads16_t3(packed, scales, n_out // 4, nb, s_row, s_step, y, ys, out, pf, t0)
            o0 = n_out - n_out % 4
        _i4_rows16(packed, scales, o0, n_out, nb, s_row, s_step, y, ys, out, pf, t0, nt)
        t0 += nt


@njit(nogil=True, cache=True)
def _i4_gemm16(packed, scales, n_out, nb, gbytes, s_row, s_step, y, ys, out, pf):  # type: ignore[no-untyped-def]
    """T tokens with 16-lane vectors: per (token, row) exactly the arithmetic of ``_i4_gemv16``.

    Blocking as in ``_i4_gemm``: token tiles of ``_TILE``, row blocks of ``_ROWS`` and column
    segments of whole groups, so a tile's activations stay in L1; each chunk is decoded once per
    row and applied to every token of the tile, groups of a row in increasing order. Rows of
    64-column groups (and per-row scales) take ``_i4_gemm16_regs`` (accumulators in
    registers) instead.
    """
    n_tok = out.shape[0]
    if gbytes == 32:
        _i4_gemm16_regs(packed, scales, n_out, nb, s_row, s_step, y, ys, out, pf)
        return
    acc = zeros64(_ROWS * _TILE * 16, np.float32)  # [ROWS, TILE, 16] accumulators
    pp = zeros64(_TILE * 16, np.float32)  # [TILE, 16] group partials
    n_groups = nb // gbytes
    seg_groups = max(1, _SEGMENT // gbytes)
    zero = vzero16()
    for t0 in range(0, n_tok, _TILE):
        nt = min(_TILE, n_tok - t0)
        for o0 in range(0, n_out, _ROWS):
            nr = min(_ROWS, n_out - o0)
            for k in range(nr * _TILE):
                vstore16(acc, k * 16, zero)
            for gs0 in range(0, n_groups, seg_groups):
                gs1 = min(gs0 + seg_groups, n_groups)
                for r in range(nr):
                    o = o0 + r
                    row = o * nb
                    a0 = r * _TILE * 16
                    for g in range(gs0, gs1):
                        g0 = g * gbytes
                        s = vsplat16(scales[o * s_row + g * s_step])
                        if pf > 0:
                            prefetch(packed, row + g0 + _SEGMENT)
                        if gbytes == 32:
                            w = _i4_decode32x16(packed, row + g0)
                            for u in range(nt):
                                q = _i4_dot32x16(w, y, (t0 + u) * _PLANES * ys + g0, ys)
                                ai = a0 + u * 16
                                vstore16(acc, ai, vfma16(s, q, vload16(acc, ai)))
                            continue
                        for c in range(g0, g0 + gbytes, 32):
                            w = _i4_decode32x16(packed, row + c)
                            for u in range(nt):
                                q = _i4_dot32x16(w, y, (t0 + u) * _PLANES * ys + c, ys)
                                if c == g0:
                                    vstore16(pp, u * 16, q)
                                else:
                                    vstore16(pp, u * 16, vadd16(vload16(pp, u * 16), q))
                        for u in range(nt):
                            ai = a0 + u * 16
                            vstore16(acc, ai, vfma16(s, vload16(pp, u * 16), vload16(acc, ai)))
            for r in range(nr):
                for u in range(nt):
                    out[t0 + u, o0 + r] = vhsum16(vload16(acc, (r * _TILE + u) * 16))


@njit(nogil=True, cache=True)
def _i4_dequant_row(packed, scales, o, n_in, nb, gs, n_groups, w):  # type: ignore[no-untyped-def]
    """Row ``o`` of a grouped int4 weight -> w[:I] float32 (same math as ``dequantize``)."""
    row = o * nb
    for c in range(n_in):
        b = packed[row + c // 2]
        nib = (b >> 4) if c % 2 else (b & 15)
        w[c] = np.float32(np.float32(nib) - np.float32(8.0)) * scales[o * n_groups + c // gs]


# ============================================================================ float / int8 kernels


def _wload8(w: Any, i: Any, kind: Any) -> Any:  # pragma: no cover - replaced by the overload
    raise NotImplementedError("only callable from numba kernels")


@overload(_wload8, jit_options={"nogil": True})
def _ov_wload8(w, i, kind):  # type: ignore[no-untyped-def]  # numba compares signatures
    """Eight weights at ``w[i:i+8]`` as float32; the array dtype (and ``kind``) picks the decode."""
    if not isinstance(w, types.Array):
        return None
    if w.dtype == types.float32:
        return lambda w, i, kind: vload(w, i)
    if w.dtype == types.uint8:
        return lambda w, i, kind: i8x8(w, i)
    if w.dtype == types.uint16:

        def impl(w, i, kind):  # type: ignore[no-untyped-def]
            if kind == _KIND_BF16:
                return bf16x8(w, i)
            return f16x8(w, i)

        return impl
    return None


@njit(nogil=True, cache=True)
def _row_dot(w, wi, n_in, xp, xi, tail, kind, pf):  # type: ignore[no-untyped-def]
    """Dot of weight row ``w[wi : wi + I]`` with ``xp[xi : xi + Ip]`` (zero padded).

    Four chains over 32-column chunks, then 8-column blocks into chain 0, then the short last
    block from ``tail`` (zero padded); lane sum in a fixed order.
    """
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    n32 = n_in // 32 * 32
    n8 = n_in // 8 * 8
    for c in range(0, n32, 32):
        if pf > 0:
            prefetch(w, wi + c + pf)
        a0 = vfma(_wload8(w, wi + c, kind), vload(xp, xi + c), a0)
        a1 = vfma(_wload8(w, wi + c + 8, kind), vload(xp, xi + c + 8), a1)
        a2 = vfma(_wload8(w, wi + c + 16, kind), vload(xp, xi + c + 16), a2)
        a3 = vfma(_wload8(w, wi + c + 24, kind), vload(xp, xi + c + 24), a3)
    for c in range(n32, n8, 8):
        a0 = vfma(_wload8(w, wi + c, kind), vload(xp, xi + c), a0)
    if n8 < n_in:
        for k in range(n_in - n8):
            tail[k] = w[wi + n8 + k]
        a0 = vfma(_wload8(tail, 0, kind), vload(xp, xi + n8), a0)
    return vhsum(vadd(vadd(a0, a1), vadd(a2, a3)))


@njit(nogil=True, cache=True, inline="always")
def _chains8(w, wi, kind, x0, x1, x2, x3, a0, a1, a2, a3):  # type: ignore[no-untyped-def]
    """One weight row's four chains over the 32 columns at ``w[wi:]``: chain ``k`` gets
    ``weights[8k : 8k + 8] * x_k`` (the activations, loaded once by the caller for every row
    that shares them)."""
    return (
        vfma(_wload8(w, wi, kind), x0, a0),
        vfma(_wload8(w, wi + 8, kind), x1, a1),
        vfma(_wload8(w, wi + 16, kind), x2, a2),
        vfma(_wload8(w, wi + 24, kind), x3, a3),
    )


@njit(nogil=True, cache=True, inline="always")
def _dot2_blocks(w, wi, rs, n32, xp, xi, kind, pf):  # type: ignore[no-untyped-def]
    """The 32-column blocks ``[0, n32)`` of ``_dot2``: both rows' four chains (a0-a3, b0-b3).
    A loop alone: with the tail code of ``_dot2`` after it in the same function LLVM kept the
    eight chains in memory (see ``_dot2_whole``)."""
    wj = wi + rs
    ahead = pf // 2
    a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
    b0, b1, b2, b3 = vzero(), vzero(), vzero(), vzero()
    for c in range(0, n32, 32):
        if ahead > 0:
            prefetch(w, wi + c + ahead)
            prefetch(w, wj + c + ahead)
        x0 = vload(xp, xi + c)
        x1 = vload(xp, xi + c + 8)
        x2 = vload(xp, xi + c + 16)
        x3 = vload(xp, xi + c + 24)
        a0, a1, a2, a3 = _chains8(w, wi + c, kind, x0, x1, x2, x3, a0, a1, a2, a3)
        b0, b1, b2, b3 = _chains8(w, wj + c, kind, x0, x1, x2, x3, b0, b1, b2, b3)
    return a0, a1, a2, a3, b0, b1, b2, b3


@njit(nogil=True, cache=True, inline="always")
def _dot2(w, wi, rs, n_in, xp, xi, tails, kind, pf):  # type: ignore[no-untyped-def]
    """``_row_dot`` of one token for the two weight rows at ``wi`` and ``wi + rs``: each
    8-column block of the activations is loaded once for both rows (one load per FMA instead
    of two), every row keeps its own four chains: per row the same FMAs in the same order as
    ``_row_dot``, so the same bits. ``tails`` [16] holds the rows' zero-padded last blocks
    (filled by the caller); ``pf`` > 0 prefetches each row ``pf / 2`` elements ahead (two
    streams: the bytes in flight of one at ``pf``), once per 32 columns."""
    wj = wi + rs
    n32 = n_in // 32 * 32
    n8 = n_in // 8 * 8
    a0, a1, a2, a3, b0, b1, b2, b3 = _dot2_blocks(w, wi, rs, n32, xp, xi, kind, pf)
    for c in range(n32, n8, 8):
        x0 = vload(xp, xi + c)
        a0 = vfma(_wload8(w, wi + c, kind), x0, a0)
        b0 = vfma(_wload8(w, wj + c, kind), x0, b0)
    if n8 < n_in:
        x0 = vload(xp, xi + n8)
        a0 = vfma(_wload8(tails, 0, kind), x0, a0)
        b0 = vfma(_wload8(tails, 8, kind), x0, b0)
    return vhsum(vadd(vadd(a0, a1), vadd(a2, a3))), vhsum(vadd(vadd(b0, b1), vadd(b2, b3)))


@njit(nogil=True, cache=True, inline="always")
def _dot2_whole(w, wi, rs, n_in, xp, xi, kind, pf):  # type: ignore[no-untyped-def]
    """``_dot2`` for rows of whole 32-column blocks (``n_in % 32 == 0``): its blocks alone,
    so the same FMAs in the same order (the same bits), without the joins that made LLVM keep
    the eight chains in memory (as ``_dot4_i8x16_whole``): [4096, 256] int8 and [2048, 256]
    bf16 from L2 18-19 -> 12 ns a row on an AVX-512 Intel guest; long rows the same."""
    a0, a1, a2, a3, b0, b1, b2, b3 = _dot2_blocks(w, wi, rs, n_in, xp, xi, kind, pf)
    return vhsum(vadd(vadd(a0, a1), vadd(a2, a3))), vhsum(vadd(vadd(b0, b1), vadd(b2, b3)))


@njit(nogil=True, cache=True, inline="always")
def _dot1x2(w, wi, n_in, xp, xi, xj, tail, kind, pf):  # type: ignore[no-untyped-def]
    """``_row_dot`` of the weight row at ``wi`` for two tokens (activations at ``xi`` and
    ``xj``): each 8-weight block is loaded and converted once for both, and every token keeps
    its own four chains, so per token the same FMAs in the same order as ``_row_dot`` (the
    same bits). ``tail`` [8] holds the row's zero-padded last block (filled by the caller)."""
    a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
    b0, b1, b2, b3 = vzero(), vzero(), vzero(), vzero()
    n32 = n_in // 32 * 32
    n8 = n_in // 8 * 8
    for c in range(0, n32, 32):
        if pf > 0:
            prefetch(w, wi + c + pf)
        w0 = _wload8(w, wi + c, kind)
        w1 = _wload8(w, wi + c + 8, kind)
        w2 = _wload8(w, wi + c + 16, kind)
        w3 = _wload8(w, wi + c + 24, kind)
        a0 = vfma(w0, vload(xp, xi + c), a0)
        a1 = vfma(w1, vload(xp, xi + c + 8), a1)
        a2 = vfma(w2, vload(xp, xi + c + 16), a2)
        a3 = vfma(w3, vload(xp, xi + c + 24), a3)
        b0 = vfma(w0, vload(xp, xj + c), b0)
        b1 = vfma(w1, vload(xp, xj + c + 8), b1)
        b2 = vfma(w2, vload(xp, xj + c + 16), b2)
        b3 = vfma(w3, vload(xp, xj + c + 24), b3)
    for c in range(n32, n8, 8):
        w0 = _wload8(w, wi + c, kind)
        a0 = vfma(w0, vload(xp, xi + c), a0)
        b0 = vfma(w0, vload(xp, xj + c), b0)
    if n8 < n_in:
        w0 = _wload8(tail, 0, kind)
        a0 = vfma(w0, vload(xp, xi + n8), a0)
        b0 = vfma(w0, vload(xp, xj + n8), b0)
    return vhsum(vadd(vadd(a0, a1), vadd(a2, a3))), vhsum(vadd(vadd(b0, b1), vadd(b2, b3)))


@njit(nogil=True, cache=True)
def _col_matmul(w, scales, n_out, n_in, kind, xp, ip, out, pf):  # type: ignore[no-untyped-def]
    """out [T, O] for f32 / bf16 / f16 / int8 rows of ``w`` (flat [O * I]); ``xp`` [T * Ip].

    int8 applies the per-row scale once to the row sum. One token: rows in pairs half the
    matrix apart that share each activation load (``_dot2``; two DRAM read streams far apart:
    [32000, 2048] int8 14.4 -> 16.1, [2048, 6144] bf16 9.5 -> 17.9 GB/s on an AVX-512 Intel
    guest, against adjacent rows with the next pair prefetched), an odd last row alone
    (``_row_dot``). Several: tokens in
    tiles (the x tile stays in cache while each weight row is read once per tile), and per row
    tokens in pairs that share each weight block's load and conversion (``_dot1x2``), an odd
    last token alone. Per (token, row) the same code for any T and any row count (batch
    invariant, and a split of the rows over threads changes no bit). ``pf`` is in elements.
    """
    n_tok = out.shape[0]
    tail = np.zeros(8, w.dtype)  # [8] zero-padded last block
    tails = np.zeros(16, w.dtype)  # [2, 8] the same for a pair of rows
    n8 = n_in // 8 * 8
    rem = n_in - n8
    if n_tok > 1:
        for t0 in range(0, n_tok, _TILE):
            nt = min(_TILE, n_tok - t0)
            for o in range(n_out):
                wi = o * n_in
                for k in range(rem):
                    tail[k] = w[wi + n8 + k]
                for u in range(0, nt - 1, 2):
                    xi = (t0 + u) * ip
                    y0, y1 = _dot1x2(w, wi, n_in, xp, xi, xi + ip, tail, kind, pf if u == 0 else 0)
                    if kind == _KIND_I8:
                        y0 = y0 * scales[o]
                        y1 = y1 * scales[o]
                    out[t0 + u, o] = y0
                    out[t0 + u + 1, o] = y1
                if nt % 2:
                    y = _row_dot(w, wi, n_in, xp, (t0 + nt - 1) * ip, tail, kind, 0)
                    if kind == _KIND_I8:
                        y = y * scales[o]
                    out[t0 + nt - 1, o] = y
        return
    if n_tok == 0:
        return
    half = n_out // 2
    rs = half * n_in
    whole = n_in % 32 == 0
    for o in range(half):
        wi = o * n_in
        if whole:
            y0, y1 = _dot2_whole(w, wi, rs, n_in, xp, 0, kind, pf)
        else:
            if rem > 0:
                for k in range(rem):
                    tails[k] = w[wi + n8 + k]
                    tails[8 + k] = w[wi + rs + n8 + k]
            y0, y1 = _dot2(w, wi, rs, n_in, xp, 0, tails, kind, pf)
        if kind == _KIND_I8:
            y0 = y0 * scales[o]
            y1 = y1 * scales[o + half]
        out[0, o] = y0
        out[0, o + half] = y1
    for o in range(2 * half, n_out):
        y = _row_dot(w, o * n_in, n_in, xp, 0, tail, kind, pf)
        if kind == _KIND_I8:
            y = y * scales[o]
        out[0, o] = y


@njit(nogil=True, cache=True, inline="always")
def _row_dot_i8x16(w, wi, n_in, xp, xi, tail, pf):  # type: ignore[no-untyped-def]
    """``_row_dot`` for int8 rows with 16-lane vectors: four chains over 64-column chunks,
    then 16-column blocks into chain 0, then the short last block from ``tail`` (zero padded,
    16 bytes); lane sum in a fixed order. ``xp`` rows are padded to a multiple of 16."""
    a0 = vzero16()
    a1 = vzero16()
    a2 = vzero16()
    a3 = vzero16()
    n64 = n_in // 64 * 64
    n16 = n_in // 16 * 16
    for c in range(0, n64, 64):
        if pf > 0:
            prefetch(w, wi + c + pf)
        a0 = vfma16(i8x16(w, wi + c), vload16(xp, xi + c), a0)
        a1 = vfma16(i8x16(w, wi + c + 16), vload16(xp, xi + c + 16), a1)
        a2 = vfma16(i8x16(w, wi + c + 32), vload16(xp, xi + c + 32), a2)
        a3 = vfma16(i8x16(w, wi + c + 48), vload16(xp, xi + c + 48), a3)
    for c in range(n64, n16, 16):
        a0 = vfma16(i8x16(w, wi + c), vload16(xp, xi + c), a0)
    if n16 < n_in:
        for k in range(n_in - n16):
            tail[k] = w[wi + n16 + k]
        a0 = vfma16(i8x16(tail, 0), vload16(xp, xi + n16), a0)
    return vhsum16(vadd16(vadd16(a0, a1), vadd16(a2, a3)))


@njit(nogil=True, cache=True, inline="always")
def _chains_i8x16(w, wi, x0, x1, x2, x3, a0, a1, a2, a3):  # type: ignore[no-untyped-def]
    """One int8 row's four chains over the 64 columns at ``w[wi:]`` (``_chains8`` with 16
    lanes)."""
    return (
        vfma16(i8x16(w, wi), x0, a0),
        vfma16(i8x16(w, wi + 16), x1, a1),
        vfma16(i8x16(w, wi + 32), x2, a2),
        vfma16(i8x16(w, wi + 48), x3, a3),
    )


@njit(nogil=True, cache=True, inline="always")
def _dot4_i8x16_blocks(w, wi, rs, n64, xp, xi, pf):  # type: ignore[no-untyped-def]
    """The 64-column blocks ``[0, n64)`` of ``_dot4_i8x16``: the four rows' four chains each
    (a0-a3, b0-b3, c0-c3, d0-d3). A loop alone, as ``_dot2_blocks``."""
    wj, wk, wl = wi + rs, wi + 2 * rs, wi + 3 * rs
    a0, a1, a2, a3 = vzero16(), vzero16(), vzero16(), vzero16()
    b0, b1, b2, b3 = vzero16(), vzero16(), vzero16(), vzero16()
    c0, c1, c2, c3 = vzero16(), vzero16(), vzero16(), vzero16()
    d0, d1, d2, d3 = vzero16(), vzero16(), vzero16(), vzero16()
    ahead = pf // _STREAMS
    for c in range(0, n64, 64):
        if ahead > 0:
            prefetch(w, wi + c + ahead)
            prefetch(w, wj + c + ahead)
            prefetch(w, wk + c + ahead)
            prefetch(w, wl + c + ahead)
        x0 = vload16(xp, xi + c)
        x1 = vload16(xp, xi + c + 16)
        x2 = vload16(xp, xi + c + 32)
        x3 = vload16(xp, xi + c + 48)
        a0, a1, a2, a3 = _chains_i8x16(w, wi + c, x0, x1, x2, x3, a0, a1, a2, a3)
        b0, b1, b2, b3 = _chains_i8x16(w, wj + c, x0, x1, x2, x3, b0, b1, b2, b3)
        c0, c1, c2, c3 = _chains_i8x16(w, wk + c, x0, x1, x2, x3, c0, c1, c2, c3)
        d0, d1, d2, d3 = _chains_i8x16(w, wl + c, x0, x1, x2, x3, d0, d1, d2, d3)
    return (a0, a1, a2, a3), (b0, b1, b2, b3), (c0, c1, c2, c3), (d0, d1, d2, d3)


@njit(nogil=True, cache=True, inline="always")
def _sum4x16(a):  # type: ignore[no-untyped-def]
    """One row's four 16-lane chains -> its sum: ``(a0 + a1) + (a2 + a3)``, then the lane sum."""
    return vhsum16(vadd16(vadd16(a[0], a[1]), vadd16(a[2], a[3])))


@njit(nogil=True, cache=True, inline="always")
def _dot4_i8x16(w, wi, rs, n_in, xp, xi, tails, pf):  # type: ignore[no-untyped-def]
    """``_row_dot_i8x16`` of one token for the four weight rows starting at ``wi``,
    ``wi + rs``, ``wi + 2 rs``, ``wi + 3 rs``: each 16-column block of the token's
    activations is loaded once for the four rows, and every row keeps its own four chains,
    so per row the same FMAs in the same order as the one-row dot (the same bits). ``tails``
    [64] holds the rows' zero-padded last blocks (filled by the caller). ``pf`` > 0: each
    row's stream is prefetched ``pf / 4`` bytes ahead (as ``_i4_quad16``), one cache line per
    64 columns."""
    wj, wk, wl = wi + rs, wi + 2 * rs, wi + 3 * rs
    n64 = n_in // 64 * 64
    n16 = n_in // 16 * 16
    a, b, c4, d = _dot4_i8x16_blocks(w, wi, rs, n64, xp, xi, pf)
    a0, b0, c0, d0 = a[0], b[0], c4[0], d[0]
    for c in range(n64, n16, 16):
        x0 = vload16(xp, xi + c)
        a0 = vfma16(i8x16(w, wi + c), x0, a0)
        b0 = vfma16(i8x16(w, wj + c), x0, b0)
        c0 = vfma16(i8x16(w, wk + c), x0, c0)
        d0 = vfma16(i8x16(w, wl + c), x0, d0)
    if n16 < n_in:
        x0 = vload16(xp, xi + n16)
        a0 = vfma16(i8x16(tails, 0), x0, a0)
        b0 = vfma16(i8x16(tails, 16), x0, b0)
        c0 = vfma16(i8x16(tails, 32), x0, c0)
        d0 = vfma16(i8x16(tails, 48), x0, d0)
    return (
        _sum4x16((a0, a[1], a[2], a[3])),
        _sum4x16((b0, b[1], b[2], b[3])),
        _sum4x16((c0, c4[1], c4[2], c4[3])),
        _sum4x16((d0, d[1], d[2], d[3])),
    )


@njit(nogil=True, cache=True, inline="always")
def _dot4_i8x16_whole(w, wi, rs, n_in, xp, xi, pf):  # type: ignore[no-untyped-def]
    """``_dot4_i8x16`` for rows of whole 64-column blocks (``n_in % 64 == 0``): its blocks
    alone, so the same FMAs in the same order (the same bits). Without the tail loop and
    branch after them, LLVM keeps the sixteen chains in registers: [4096, 256] from L2 went
    from 12.4 to 8.9 ns per row (AVX-512 Intel guest; rows that long from DRAM: the same)."""
    a, b, c, d = _dot4_i8x16_blocks(w, wi, rs, n_in, xp, xi, pf)
    return _sum4x16(a), _sum4x16(b), _sum4x16(c), _sum4x16(d)


@njit(nogil=True, cache=True, inline="always")
def _i8_row_tile16(w, wi, n_in, xp, xi, ip, tail, nt, pf):  # type: ignore[no-untyped-def]
    """``_row_dot_i8x16`` of one int8 row for ``nt`` (1 to 4) tokens at once (rows ``xi``,
    ``xi + ip``, ...): each 16-column block of the row is converted once for the tile, and
    every token keeps its own four chains in registers, so per token the same FMAs in the
    same order as the one-row dot (the same bits). Returns the four lane sums (0 past
    ``nt``)."""
    a0, a1, a2, a3 = vzero16(), vzero16(), vzero16(), vzero16()
    b0, b1, b2, b3 = vzero16(), vzero16(), vzero16(), vzero16()
    c0, c1, c2, c3 = vzero16(), vzero16(), vzero16(), vzero16()
    d0, d1, d2, d3 = vzero16(), vzero16(), vzero16(), vzero16()
    xj, xk, xl = xi + ip, xi + 2 * ip, xi + 3 * ip
    n64 = n_in // 64 * 64
    n16 = n_in // 16 * 16
    for c in range(0, n64, 64):
        if pf > 0:
            prefetch(w, wi + c + pf)
        w0 = i8x16(w, wi + c)
        w1 = i8x16(w, wi + c + 16)
        w2 = i8x16(w, wi + c + 32)
        w3 = i8x16(w, wi + c + 48)
        a0 = vfma16(w0, vload16(xp, xi + c), a0)
        a1 = vfma16(w1, vload16(xp, xi + c + 16), a1)
        a2 = vfma16(w2, vload16(xp, xi + c + 32), a2)
        a3 = vfma16(w3, vload16(xp, xi + c + 48), a3)
        if nt >= 2:
            b0 = vfma16(w0, vload16(xp, xj + c), b0)
            b1 = vfma16(w1, vload16(xp, xj + c + 16), b1)
            b2 = vfma16(w2, vload16(xp, xj + c + 32), b2)
            b3 = vfma16(w3, vload16(xp, xj + c + 48), b3)
        if nt >= 3:
            c0 = vfma16(w0, vload16(xp, xk + c), c0)
            c1 = vfma16(w1, vload16(xp, xk + c + 16), c1)
            c2 = vfma16(w2, vload16(xp, xk + c + 32), c2)
            c3 = vfma16(w3, vload16(xp, xk + c + 48), c3)
        if nt == 4:
            d0 = vfma16(w0, vload16(xp, xl + c), d0)
            d1 = vfma16(w1, vload16(xp, xl + c + 16), d1)
            d2 = vfma16(w2, vload16(xp, xl + c + 32), d2)
            d3 = vfma16(w3, vload16(xp, xl + c + 48), d3)
    for c in range(n64, n16 + (16 if n16 < n_in else 0), 16):
        if c < n16:
            w0 = i8x16(w, wi + c)
        else:  # the short last block, zero padded
            for k in range(n_in - n16):
                tail[k] = w[wi + n16 + k]
            w0 = i8x16(tail, 0)
        a0 = vfma16(w0, vload16(xp, xi + c), a0)
        if nt >= 2:
            b0 = vfma16(w0, vload16(xp, xj + c), b0)
        if nt >= 3:
            c0 = vfma16(w0, vload16(xp, xk + c), c0)
        if nt == 4:
            d0 = vfma16(w0, vload16(xp, xl + c), d0)
    return (
        vhsum16(vadd16(vadd16(a0, a1), vadd16(a2, a3))),
        vhsum16(vadd16(vadd16(b0, b1), vadd16(b2, b3))),
        vhsum16(vadd16(vadd16(c0, c1), vadd16(c2, c3))),
        vhsum16(vadd16(vadd16(d0, d1), vadd16(d2, d3))),
    )


@njit(nogil=True, cache=True)
def _i8_matmul16_tiles(w, scales, n_out, n_in, xp, ip, out, pf):  # type: ignore[no-untyped-def]
    """int8 rows, 16 lanes, T >= 2: rows against register tiles of up to four tokens
    (``_i8_row_tile16``: one conversion of each weight block per tile instead of one per
    token). Rows in blocks of ``_I8_ROWS`` (their bytes stay in L1/L2 while every tile of up
    to ``_I8_TOKENS`` tokens passes over them; a tile's activations stay in L1 across the
    block's rows). Per (token, row) the arithmetic of ``_row_dot_i8x16``, so a row's result is
    the one-token kernel's, bit for bit."""
    n_tok = out.shape[0]
    tail = np.zeros(16, np.uint8)
    for b0 in range(0, n_tok, _I8_TOKENS):
        b1 = min(n_tok, b0 + _I8_TOKENS)
        for o0 in range(0, n_out, _I8_ROWS):
            o1 = min(n_out, o0 + _I8_ROWS)
            for t0 in range(b0, b1, 4):
                nt = min(4, b1 - t0)
                for o in range(o0, o1):
                    y0, y1, y2, y3 = _i8_row_tile16(
                        w, o * n_in, n_in, xp, t0 * ip, ip, tail, nt, pf if t0 == b0 else 0
                    )
                    sc = scales[o]
                    out[t0, o] = y0 * sc
                    if nt >= 2:
                        out[t0 + 1, o] = y1 * sc
                    if nt >= 3:
                        out[t0 + 2, o] = y2 * sc
                    if nt == 4:
                        out[t0 + 3, o] = y3 * sc


@njit(nogil=True, cache=True)
def _i8_matmul16(w, scales, n_out, n_in, xp, out, pf):  # type: ignore[no-untyped-def]
    """int8 rows with 16-lane vectors, one token (``_i8_matmul16_tiles`` takes more): out
    [1, O] from ``w`` (flat [O * I]) and ``xp`` [Ip] (padded to a multiple of 16); the per-row
    scale applied to the row sum.

    Rows in blocks of four a quarter of the matrix apart (``_dot4_i8x16``: each activation
    block is loaded once for four rows, where loading it per row made the GEMV bound by
    activation loads; four read streams far apart keep more DRAM reads in flight than one:
    [32000, 2048] from DRAM 0.51 -> 0.88 of a one-thread read loop on an AVX-512 Intel guest),
    the last one to three rows alone (``_row_dot_i8x16``). Per row both run the same FMAs in
    the same order, so a row is bit-identical for any T and any row count."""
    tail = np.zeros(16, np.uint8)  # [16] zero-padded last block
    tails = np.zeros(64, np.uint8)  # [4, 16] the same for a block of four rows
    n16 = n_in // 16 * 16
    rem = n_in - n16
    quarter = n_out // 4
    rs = quarter * n_in
    whole = n_in % 64 == 0
    for o in range(quarter):
        wi = o * n_in
        if whole:
            y0, y1, y2, y3 = _dot4_i8x16_whole(w, wi, rs, n_in, xp, 0, pf)
        else:
            if rem > 0:
                for r in range(4):
                    for k in range(rem):
                        tails[16 * r + k] = w[wi + r * rs + n16 + k]
            y0, y1, y2, y3 = _dot4_i8x16(w, wi, rs, n_in, xp, 0, tails, pf)
        out[0, o] = y0 * scales[o]
        out[0, o + quarter] = y1 * scales[o + quarter]
        out[0, o + 2 * quarter] = y2 * scales[o + 2 * quarter]
        out[0, o + 3 * quarter] = y3 * scales[o + 3 * quarter]
    for o in range(4 * quarter, n_out):
        y = _row_dot_i8x16(w, o * n_in, n_in, xp, 0, tail, pf)
        out[0, o] = y * scales[o]


@njit(nogil=True, cache=True)
def _i4_generic_matmul(packed, scales, n_out, n_in, nb, gs, xp, ip, out):  # type: ignore[no-untyped-def]
    """Grouped int4 whose group size is not a multiple of 16 (bytes straddle groups).

    Slow but exact: dequantize each row once into a scratch row, then the f32 row dot per token.
    """
    n_tok = out.shape[0]
    n_groups = (n_in + gs - 1) // gs
    w = np.zeros(ip, np.float32)  # [Ip] one dequantized row
    tail = np.zeros(8, np.float32)  # [8]
    for t0 in range(0, n_tok, _TILE):
        nt = min(_TILE, n_tok - t0)
        for o in range(n_out):
            _i4_dequant_row(packed, scales, o, n_in, nb, gs, n_groups, w)
            for u in range(nt):
                out[t0 + u, o] = _row_dot(w, 0, n_in, xp, (t0 + u) * ip, tail, _KIND_F32, 0)


# ============================================================================ SwiGLU


@njit(nogil=True, cache=True, inline="always")
def _silu_mul1(g, u):  # type: ignore[no-untyped-def]
    """``silu(g) * u`` for one float32 element: ``(g * (0.5 + 0.5 * tanh(0.5 * g))) * u``."""
    half = np.float32(0.5)
    return (g * (half + half * np.tanh(half * g))) * u


@njit(nogil=True, cache=True)
def silu_mul(g, u, out):  # type: ignore[no-untyped-def]
    """out [T, F] = silu(g) * u, elementwise, row by row (a row's values do not depend on T)."""
    n_tok, n_f = g.shape
    for t in range(n_tok):
        for f in range(n_f):
            out[t, f] = _silu_mul1(g[t, f], u[t, f])


@njit(nogil=True, cache=True, inline="always")
def _i4_stride(nb):  # type: ignore[no-untyped-def]
    """``Ys``: the ``_i4_prep`` row stride for ``nb`` packed bytes per weight row."""
    return (nb + 7) // 8 * 8 + 16


@njit(nogil=True, cache=True)
def i4_matmul(x, packed, scales, walk, out, pf):  # type: ignore[no-untyped-def]
    """out [T, O] = x [T, I] @ W.T for int4 ``W`` (groups of a multiple of 16 columns): the
    activations prepared, then ``_i4_apply``. What ``matmul_int4`` runs after its checks."""
    ys = _i4_stride(walk[2])
    _i4_apply(_i4_prep(x, walk[2], ys), ys, packed, scales, walk, out, pf)


@njit(nogil=True, cache=True)
def _i4_apply(y, ys, packed, scales, walk, out, pf):  # type: ignore[no-untyped-def]
    """out [T, O] from the ``_i4_prep`` rows ``y`` (stride ``ys``) and an int4 weight (groups
    of a multiple of 16 columns): the GEMV or GEMM of its width. ``walk``: (O, I, B, group
    bytes, scales per row, scale step, 16 lanes)."""
    n_out, nb, gbytes, s_row, s_step, wide = walk[0], walk[2], walk[3], walk[4], walk[5], walk[6]
    if out.shape[0] == 1:
        if wide:
            _i4_gemv16(packed, scales, n_out, nb, gbytes, s_row, s_step, y, ys, out[0], pf)
        else:
            _i4_gemv(packed, scales, n_out, nb, gbytes, s_row, s_step, y, ys, out[0], pf)
    elif wide:
        _i4_gemm16(packed, scales, n_out, nb, gbytes, s_row, s_step, y, ys, out, pf)
    elif gbytes == 32 and nb % 32 == 0 and out.shape[0] <= _FEW_MAX_T:
        _i4_gemm_few(packed, scales, n_out, nb, s_row, s_step, y, ys, out, pf)
    else:
        _i4_gemm(packed, scales, n_out, nb, gbytes, s_row, s_step, y, ys, out, pf)


@njit(nogil=True, cache=True)
def i4_swiglu(x, gp, gsc, gw, upk, usc, uw, dp, dsc, dw, out, pf):  # type: ignore[no-untyped-def]
    """``out [T, D] = down(silu(gate(x)) * up(x))`` for int4 projections in one call: the same
    kernels on the same prepared activations as three ``matmul_int4`` calls and ``silu_mul``
    (so the same bits), without the Python between them. Per projection: packed bytes, scales
    and its walk (see ``_i4_apply``); gate and up share one preparation of ``x``."""
    n_tok = x.shape[0]
    ys = _i4_stride(gw[2])
    y = _i4_prep(x, gw[2], ys)
    g = np.empty((n_tok, gw[0]), np.float32)
    u = np.empty((n_tok, uw[0]), np.float32)
    _i4_apply(y, ys, gp, gsc, gw, g, pf)
    _i4_apply(y, ys, upk, usc, uw, u, pf)
    silu_mul(g, u, g)
    i4_matmul(g, dp, dsc, dw, out, pf)


@njit(nogil=True, cache=True)
def expert_gather(x, ids, gates, e):  # type: ignore[no-untyped-def]
    """The rows of ``x`` [T, D] that ``ids`` [T, K] route to expert ``e``: (rows [n] ascending,
    their gate weights [n], ``x[rows]`` [n, D]), as ``np.nonzero(ids == e)`` and the gathers."""
    n_tok, k = ids.shape
    n = 0
    for t in range(n_tok):
        for j in range(k):
            if ids[t, j] == e:
                n += 1
    rows = np.empty(n, np.intp)
    g = np.empty(n, np.float32)
    xe = np.empty((n, x.shape[1]), np.float32)
    r = 0
    for t in range(n_tok):
        for j in range(k):
            if ids[t, j] == e:
                rows[r] = t
                g[r] = gates[t, j]
                for c in range(x.shape[1]):  # (not ``xe[r] = x[t]``: its shape check's
                    xe[r, c] = x[t, c]  # message took ~2.5 s of a first run's compile)
                r += 1
    return rows, g, xe


@njit(nogil=True, cache=True)
def i4_expert(x, ids, gates, e, gp, gsc, gw, upk, usc, uw, dp, dsc, dw, pf):  # type: ignore[no-untyped-def]
    """Routed expert ``e`` on the rows of ``x`` [T, D] routed to it (``ids`` [T, K]): (rows
    [n] ascending, ``gate * swiglu(x[rows])`` [n, D]), as ``np.nonzero``, the gather,
    ``i4_swiglu`` and the gate product compute it, in one call."""
    rows, g, xe = expert_gather(x, ids, gates, e)
    n = rows.shape[0]
    out = np.empty((n, dw[0]), np.float32)
    if n:
        i4_swiglu(xe, gp, gsc, gw, upk, usc, uw, dp, dsc, dw, out, pf)
    for r in range(n):
        for c in range(out.shape[1]):
            out[r, c] = out[r, c] * g[r]
    return rows, out


@njit(nogil=True, cache=True)
def i4_moe(x, ids, gates, es, gps, gscs, gw, ups, uscs, uw, dps, dscs, dw, pf):  # type: ignore[no-untyped-def]
    """The routed half of a MoE layer in one call: ``out [T, D]`` = for each expert of ``es``
    (the routed ids, ascending) ``i4_expert`` on its rows, added into its rows' sums in that
    order, from zeros: the bits of ``i4_expert`` per expert and ``moe.combine``. ``gps`` ...
    ``dscs``: the layer's packed bytes and scales per expert id (typed lists); ``gw``, ``uw``,
    ``dw``: the walks every expert of the layer shares."""
    n_tok = x.shape[0]
    n_d = dw[0]
    out = np.zeros((n_tok, n_d), np.float32)
    for j in range(es.shape[0]):
        e = es[j]
        rows, ye = i4_expert(
            x, ids, gates, e, gps[e], gscs[e], gw, ups[e], uscs[e], uw, dps[e], dscs[e], dw, pf
        )
        for r in range(rows.shape[0]):
            t = rows[r]
            for c in range(n_d):
                out[t, c] += ye[r, c]
    return out


@njit(nogil=True, cache=True, inline="always")
def _i4_rows(walk, a, b):  # type: ignore[no-untyped-def]
    """The walk of rows ``[a, b)`` of an int4 weight (their bytes and scales are contiguous)."""
    return (b - a, walk[1], walk[2], walk[3], walk[4], walk[5], walk[6])


@njit(nogil=True, cache=True)
def i4_swiglu_part(xe, gp, gsc, gw, upk, usc, uw, a, b, h, pf):  # type: ignore[no-untyped-def]
    """``h[:, a:b] = silu(gate(xe)) * up(xe)`` for intermediate features ``[a, b)`` only: the
    same kernels on the same prepared rows as ``i4_swiglu`` (a feature's value does not depend
    on which rows share the call; ``a`` a multiple of 16 keeps ``silu_mul``'s walk), so these
    columns carry the same bits as the whole call's."""
    n_tok = xe.shape[0]
    ys = _i4_stride(gw[2])
    y = _i4_prep(xe, gw[2], ys)
    g = np.empty((n_tok, b - a), np.float32)
    u = np.empty((n_tok, b - a), np.float32)
    _i4_apply(y, ys, gp[a * gw[2] : b * gw[2]], gsc[a * gw[4] : b * gw[4]], _i4_rows(gw, a, b),
              g, pf)  # fmt: skip
    _i4_apply(y, ys, upk[a * uw[2] : b * uw[2]], usc[a * uw[4] : b * uw[4]], _i4_rows(uw, a, b),
              u, pf)  # fmt: skip
    silu_mul(g, u, g)
    for t in range(n_tok):
        for f in range(b - a):
            h[t, a + f] = g[t, f]


@njit(nogil=True, cache=True)
def i4_down_part(h, dp, dsc, dw, c, d, g, out, pf):  # type: ignore[no-untyped-def]
    """``out[:, c:d] = g[:, None] * (h @ down.T)[:, c:d]``: output features ``[c, d)`` of a
    routed expert from its whole SwiGLU activation ``h`` [n, F] and gate weights ``g`` [n]
    (the same bits as those columns of ``i4_expert``)."""
    n_tok = h.shape[0]
    part = np.empty((n_tok, d - c), np.float32)
    rows = _i4_rows(dw, c, d)
    i4_matmul(h, dp[c * dw[2] : d * dw[2]], dsc[c * dw[4] : d * dw[4]], rows, part, pf)
    for r in range(n_tok):
        for j in range(d - c):
            out[r, c + j] = part[r, j] * g[r]


#: Every compiled kernel (tests check they were built with ``nogil=True``).
KERNELS = (
    _i4_gemm16_regs,
    i4_moe,
    silu_mul,
    i4_expert,
    expert_gather,
    i4_swiglu_part,
    i4_down_part,
    i4_matmul,
    _i4_apply,
    i4_swiglu,
    _i4_prep,
    _pad_rows,
    _i4_gemv,
    _i4_gemm,
    _i4_gemm_few,
    _i4_gemv16,
    _i4_gemm16,
    _i4_decode32x16,
    _i4_dot32x16,
    _i4_generic_matmul,
    _col_matmul,
    _row_dot,
    _row_dot_i8x16,
    _i8_matmul16,
    _i4_decode32,
    _i4_dot32,
    _fill_tail,
    _i4_dequant_row,
)

"""The opt-in lossy kernels (``--kernels fast-int8``): int4 weights x int8 activation digits.

Why: the exact kernels convert every int4 weight to float32 before the multiply-add, and that
decode, not DRAM, bounds them (docs/benchmarks.md). Here the products are integer: ``vpdpbusd``
(AVX-512 VNNI) multiplies 64 unsigned weight nibbles by 64 signed activation bytes and adds each
run of four products into one of 16 int32 lanes.

The activations: per token and 64-column group, ``v = x * 127 / max|x|`` is written as two int8
digits, ``h = rint(v)`` and ``l = clip(rint((v - h) * 256), -127, 127)``, i.e. 16-bit fixed point
relative to the group's largest value (a plain int8 rounding, as llama.cpp's Q8 activations,
lost up to 12% of the greedy tokens on the random oracle models; the second digit doubles the
integer multiplies).

The arithmetic, per output row ``r``, token ``t`` and 64-column group ``g``: the integer
``D = 256 * sum(h * (q - 8)) + sum(l * (q - 8))`` over the group's 64 columns (``q`` the stored
nibbles), exact in int32 and, since ``|D| <= 64 * 8 * 127 * 257 < 2**24``, exact as a float32;
then ``acc = fma(sw[r, g] * sx[t, g], float(D), acc)`` group by group in increasing order from
``+0.0``, and ``out[t, r] = acc``. Integer sums are exact in any order, so every kernel that
forms ``D`` (whatever its lanes hold) and then runs that float chain gives the same bits.

How: the lanes run across rows. A block of 16 rows is taken 64 columns at a time: the 16 rows'
32 packed bytes are transposed in registers (``i4block16``) into 16 vectors whose lane ``k``
holds four weights of row ``k``; each token then needs 16 ``vpdpbusd`` per digit, each with
the same four activation bytes broadcast to every lane, and one convert and one FMA for all 16
rows (``q8blockdot``). The transposed block is unpacked once for every token of a tile, so a
prompt costs about two integer instructions per 64 multiply-adds where the exact kernels need
four float FMAs. On AVX2 without VNNI the kernels go 8 rows at a time instead, with each
token's two digits as one 16-bit word ``256 * h + l`` (``q8_rows_words``: ``vpmaddwd`` on
the weights as words, ``vphaddd`` across the rows).

What it costs: the activations are rounded (to about 1/65000 of each group's largest value), so
results differ from the exact kernels by more than float rounding and greedy tokens may differ:
the agreement is measured by ``tools/bench/kernels.py`` and tested on the oracle models. It is
never on by default.

Determinism and batch invariance hold as for the exact kernels: the rounding of a token depends
only on that token, ``D`` is an exact integer, and the float chain above is the same code for
one token or 64, for any row block and any split of the rows over threads (rows past the last
whole block go through a zero-padded copy of the same block code). Every machine computes the
same integers, with VNNI where the CPU has it, ``vpmaddwd`` on 16-bit words on AVX2 and plain
vector integer ops elsewhere, so the bits are the same on every x86-64 CPU.

Layout of the prepared activations of token ``t`` (``xq`` rows of ``2 * I`` bytes: the ``h``
digits, then the ``l`` digits; ``bias`` [G] int32 per token; ``sx`` [G] float32 per token):
per 64-column group ``g``, bytes ``g*64 : g*64+32`` hold columns ``g*64 + 0, 2, ..., 62`` (the
low nibbles) and ``g*64+32 : g*64+64`` columns ``g*64 + 1, 3, ..., 63`` (the high nibbles), so
that 32 packed bytes unpacked as ``[lo x 32 | hi x 32]`` line up with them byte for byte;
``bias[g] = -8 * (256 * (sum of the group's h digits) + (sum of its l digits))`` (the nibbles
are ``q + 8``); ``sx[g] = max|x| / 127 / 256`` (0 for an all-zero group).

Shape legend: T tokens, I in features (a multiple of 64 here), O out features, G = I / 64 groups,
B = I / 2 packed bytes per row; lanes: 16 int32 or float32 (16 rows of a block).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, models, register_model

from runtime.kernels._intrinsics import prefetch, prefetch_l2, zeros64
from runtime.kernels._matmul_kernels import silu_mul
from runtime.kernels._simd import (
    f32x8,
    f32x16,
    host_codegen_features,
    vfma,
    vfma16,
    vload,
    vload16,
    vmul,
    vmul16,
    vsplat,
    vsplat16,
    vstore,
    vstore16,
)

__all__ = [
    "KERNELS",
    "TILE",
    "W16",
    "has_avx2_codegen",
    "has_vnni_codegen",
    "i4block16",
    "q8_expert",
    "q8_gemm",
    "q8_matmul",
    "q8_prep",
    "q8_prep_scalar",
    "q8_rows_words",
    "q8_strides",
    "q8_swiglu",
    "q8blockdot",
    "q8blockdot_portable",
    "q8dot_kind",
    "scales16",
]

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


def has_vnni_codegen() -> bool:
    """Whether the code numba generates for this CPU may use ``vpdpbusd`` (512-bit VNNI)."""
    return {"avx512vnni", "avx512bw"} <= host_codegen_features()


def has_avx2_codegen() -> bool:
    """Whether the code numba generates for this CPU may use AVX2's ``vpmaddwd`` and
    ``vphaddd``."""
    return "avx2" in host_codegen_features()


def _intrinsic(fn: Callable[..., Any]) -> Any:
    return intrinsic(fn)


class I8x64(types.Type):
    """numba type of 64 unpacked int4 weights (``<64 x i8>``, values 0..15)."""

    def __init__(self) -> None:
        super().__init__(name="i8x64")


i8x64 = I8x64()


@register_model(I8x64)
class _I8x64Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, ir.VectorType(_I8, 64))  # type: ignore[no-untyped-call]


#: numba type of a transposed block (``i4block16``): 16 vectors of 16 rows x 4 weights.
W16 = types.UniTuple(i8x64, 16)  # type: ignore[no-untyped-call]


def _ptr(context: Any, builder: Any, arrty: Any, arr: Any, idxty: Any, idx: Any) -> Any:
    ary = context.make_array(arrty)(context, builder, arr)
    offset = context.cast(builder, idx, idxty, types.intp)
    return builder.gep(ary.data, [offset], inbounds=True)


def _c_array(arr: Any, dtype: Any) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == dtype and arr.layout == "C"


def _ints(*vals: Any) -> bool:
    return all(isinstance(v, types.Integer) for v in vals)


def _splat32(builder: Any, value: Any, vty: Any) -> Any:
    v = builder.insert_element(ir.Constant(vty, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))


def _transpose(
    builder: Any, vecs: list[Any], lay: list[list[tuple[int, int]]], bits: tuple[int, ...]
) -> tuple[list[Any], list[list[tuple[int, int]]]]:
    """Shuffle 16-lane vectors whose lanes hold ``(row, column)`` pairs (``lay``) until each
    holds one column of rows 0..15 in order: per column bit (high to low), vector ``i`` and
    vector ``i + n/2`` are split into the lanes whose column has that bit clear and set (one
    two-source shuffle each, ``vpermt2d`` on AVX-512)."""
    v16 = ir.VectorType(_I32, 16)
    for bit in bits:
        nv, nl = [], []
        half = len(vecs) // 2
        for i in range(half):
            src = lay[i] + lay[i + half]
            for side in (0, 1):
                want = sorted(x for x in src if (x[1] >> bit) & 1 == side)
                sel = ir.Constant(v16, [src.index(x) for x in want])
                nv.append(builder.shuffle_vector(vecs[i], vecs[i + half], sel))
                nl.append(want)
        vecs, lay = nv, nl
    for one in lay:  # each vector: rows 0..15 of one column
        assert [r for r, _ in one] == list(range(16)) and len({c for _, c in one}) == 1, one
    return vecs, lay


@_intrinsic
def i4block16(typingctx: Any, packed: Any, idx: Any, nb: Any) -> Any:
    """The 32 packed bytes of 16 rows (row ``k`` at ``packed[idx + k * nb:]``) -> 16
    ``<64 x i8>``: vector ``j`` lane ``k`` holds bytes ``4j .. 4j + 3`` of row ``k``'s
    ``[low nibbles x 32 | high nibbles x 32]`` (values 0..15). 16 loads, 8 joins, 24
    shuffles and 24 mask / shift ops."""
    if not _c_array(packed, types.uint8) or not _ints(idx, nb):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        p0 = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        stride = context.cast(builder, args[2], sig.args[2], types.intp)
        v8, v16 = ir.VectorType(_I32, 8), ir.VectorType(_I32, 16)
        rows = []
        for k in range(16):
            pk = builder.gep(p0, [builder.mul(stride, ir.Constant(stride.type, k))], inbounds=True)
            rows.append(builder.load(builder.bitcast(pk, v8.as_pointer()), align=1))
        joined = ir.Constant(v16, list(range(16)))
        vecs = [builder.shuffle_vector(rows[2 * m], rows[2 * m + 1], joined) for m in range(8)]
        lay = [[(2 * m + lane // 8, lane % 8) for lane in range(16)] for m in range(8)]
        vecs, lay = _transpose(builder, vecs, lay, (2, 1, 0))
        out: list[Any] = [None] * 16
        mask, four = ir.Constant(v16, [0x0F0F0F0F] * 16), ir.Constant(v16, [4] * 16)
        v64 = ir.VectorType(_I8, 64)
        for v, one in zip(vecs, lay, strict=True):
            q = one[0][1]  # packed dword q: low nibbles are bytes 4q.., high ones 32 + 4q..
            out[q] = builder.bitcast(builder.and_(v, mask), v64)
            out[8 + q] = builder.bitcast(builder.and_(builder.lshr(v, four), mask), v64)
        return context.make_tuple(builder, sig.return_type, out)

    return W16(packed, idx, nb), codegen


@_intrinsic
def scales16(typingctx: Any, src: Any, idx: Any, stride: Any, dst: Any, didx: Any) -> Any:
    """``dst[didx + 16 * c + k] = src[idx + k * stride + c]`` for ``k, c < 16``: 16 rows' scales
    of 16 groups transposed in registers (16 loads, 64 shuffles, 16 stores), so that a block
    loads the 16 rows' scales of a group as one vector."""
    if not (_c_array(src, types.float32) and _c_array(dst, types.float32)):
        return None
    if not _ints(idx, stride, didx):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        st = sig.args
        p0 = _ptr(context, builder, st[0], args[0], st[1], args[1])
        stride = context.cast(builder, args[2], st[2], types.intp)
        vf = ir.VectorType(_F32, 16)
        rows = []
        for k in range(16):
            pk = builder.gep(p0, [builder.mul(stride, ir.Constant(stride.type, k))], inbounds=True)
            rows.append(builder.load(builder.bitcast(pk, vf.as_pointer()), align=4))
        lay = [[(k, c) for c in range(16)] for k in range(16)]
        vecs, lay = _transpose(builder, rows, lay, (3, 2, 1, 0))
        d0 = _ptr(context, builder, st[3], args[3], st[4], args[4])
        for v, one in zip(vecs, lay, strict=True):
            pc = builder.gep(d0, [ir.Constant(ir.IntType(64), 16 * one[0][1])], inbounds=True)
            builder.store(v, builder.bitcast(pc, vf.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(src, idx, stride, dst, didx), codegen


def _make_blockdot(kind: str) -> Any:
    """The ``q8blockdot`` intrinsic: ``kind`` "vnni" (``vpdpbusd``) or "portable" (plain
    vector integer ops). The same integers: products are at most 15 * 127 and every sum stays
    far inside int32. (AVX2 without VNNI does not take the blocks: ``q8_rows_words``; the
    blocks' ``vpmaddubsw`` form ran at 0.74-1.17x the exact kernel there.)"""

    def dot4(builder: Any, acc: Any, w: Any, xv: Any) -> Any:
        """``acc[k] + sum_{j<4} w[4k+j] * x[4k+j]`` (w unsigned, x signed bytes)."""
        v16i = ir.VectorType(_I32, 16)
        if kind == "vnni":
            fnty = ir.FunctionType(v16i, [v16i, v16i, v16i])
            fn = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512", fnty=fnty)
            return builder.call(fn, [acc, builder.bitcast(w, v16i), builder.bitcast(xv, v16i)])
        v64i = ir.VectorType(_I32, 64)
        prod = builder.mul(builder.zext(w, v64i), builder.sext(xv, v64i))
        for j in range(4):
            sel = ir.Constant(v16i, [4 * k + j for k in range(16)])
            acc = builder.add(acc, builder.shuffle_vector(prod, prod, sel))
        return acc

    @_intrinsic
    def q8blockdot(typingctx: Any, w: Any, xq: Any, xi: Any, xs: Any, bias: Any) -> Any:
        """float32 of the 16 rows' ``D = 256 * (h . w) + (l . w) + bias`` over one 64-column
        group: ``w`` a block from ``i4block16``, the ``h`` digits at ``xq[xi:]``, the ``l``
        digits ``xs`` bytes later, ``bias`` the group's int32. Each run of four digits is
        broadcast to the 16 lanes; four independent sums (even / odd runs, each digit)."""
        if w != W16 or not _c_array(xq, types.int8) or not _ints(xi, xs, bias):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            st = sig.args
            v16i, v64 = ir.VectorType(_I32, 16), ir.VectorType(_I8, 64)
            xi_ = context.cast(builder, args[2], st[2], types.intp)
            xl_ = builder.add(xi_, context.cast(builder, args[3], st[3], types.intp))
            digits = []
            for at in (xi_, xl_):
                p = _ptr(context, builder, st[1], args[1], types.intp, at)
                digits.append(builder.bitcast(p, _I32.as_pointer()))
            zero = ir.Constant(v16i, None)
            acc = [zero, zero, zero, zero]
            for j in range(16):
                wj = builder.extract_value(args[0], j)
                for d, base in enumerate(digits):
                    run = builder.load(builder.gep(base, [ir.Constant(_I32, j)]), align=1)
                    xv = builder.bitcast(_splat32(builder, run, v16i), v64)
                    a = 2 * d + (j & 1)
                    acc[a] = dot4(builder, acc[a], wj, xv)
            h, lo = builder.add(acc[0], acc[1]), builder.add(acc[2], acc[3])
            b = _splat32(builder, context.cast(builder, args[4], st[4], types.int32), v16i)
            d = builder.add(builder.add(builder.shl(h, ir.Constant(v16i, [8] * 16)), lo), b)
            return builder.sitofp(d, ir.VectorType(_F32, 16))

        return f32x16(w, xq, xi, xs, bias), codegen

    return q8blockdot


def q8dot_kind() -> str:
    """Which integer dot the kernels use here: "vnni", "avx2" or "portable"."""
    if has_vnni_codegen():
        return "vnni"
    return "avx2" if has_avx2_codegen() else "portable"


#: What the block kernels use: ``vpdpbusd`` where numba's code for this CPU may have it.
q8blockdot = _make_blockdot("vnni" if q8dot_kind() == "vnni" else "portable")
#: The same integers from plain vector ops (tests compare them bit for bit with ``q8blockdot``).
q8blockdot_portable = _make_blockdot("portable")


def _f32_c(arr: Any) -> bool:
    return _c_array(arr, types.float32)


def _vf16(builder: Any, name: str, nargs: int) -> Any:
    """``llvm.<name>.v16f32`` taking ``nargs`` vectors."""
    vf = ir.VectorType(_F32, 16)
    fnty = ir.FunctionType(vf, [vf] * nargs)
    return builder.module.declare_intrinsic(f"llvm.{name}.v16f32", fnty=fnty)


def _load64f(context: Any, builder: Any, sig: Any, args: Any) -> list[Any]:
    """``args[0].flat[args[1] : args[1] + 64]`` (a float32 C array) as four 16-lane vectors."""
    vf = ir.VectorType(_F32, 16)
    p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
    out = []
    for k in range(4):
        pk = builder.gep(p, [ir.Constant(ir.IntType(64), 16 * k)], inbounds=True)
        out.append(builder.load(builder.bitcast(pk, vf.as_pointer()), align=4))
    return out


@_intrinsic
def absmax64(typingctx: Any, x: Any, idx: Any) -> Any:
    """``max |x.flat[idx : idx + 64]|`` of a float32 C array, NaN counted as 0 (as the scalar
    ``if a > amax`` loop it replaces): a maximum, the same in any order."""
    if not _f32_c(x) or not _ints(idx):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        fabs, fmax = _vf16(builder, "fabs", 1), _vf16(builder, "maxnum", 2)
        a = [builder.call(fabs, [v]) for v in _load64f(context, builder, sig, args)]
        m = builder.call(fmax, [builder.call(fmax, [a[0], a[1]]), builder.call(fmax, [a[2], a[3]])])
        m = builder.call(fmax, [m, ir.Constant(ir.VectorType(_F32, 16), None)])
        for width in (8, 4, 2, 1):  # lane 0 ends with the maximum of all 16
            sel = [width + i if i < width else i for i in range(16)]
            hi = builder.shuffle_vector(m, m, ir.Constant(ir.VectorType(_I32, 16), sel))
            m = builder.call(fmax, [m, hi])
        return builder.extract_element(m, ir.Constant(_I32, 0))

    return types.float32(x, idx), codegen


@_intrinsic
def round64(typingctx: Any, x: Any, idx: Any, inv: Any, xq: Any, qh: Any, n_in: Any) -> Any:
    """One group of ``q8_prep``: ``v = x.flat[idx + c] * inv`` for its 64 columns, the digits
    ``h = rint(v)`` at ``xq[qh:]`` and ``l = clip(rint((v - h) * 256), -127, 127)`` at
    ``xq[qh + n_in:]``, both in position order (the even columns, then the odd ones); returns
    the group's bias ``-8 * (256 * sum(h) + sum(l))``. The float32 operations of the scalar
    loop, lane by lane (``rint``: round half to even, as ``np.rint``), so the same digits."""
    if not _f32_c(x) or not _c_array(xq, types.int8) or inv != types.float32:
        return None
    if not _ints(idx, qh, n_in):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        st = sig.args
        vf, vi = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16)
        cols = _load64f(context, builder, sig, args)
        iv = builder.insert_element(ir.Constant(vf, None), args[2], ir.Constant(_I32, 0))
        iv = builder.shuffle_vector(iv, iv, ir.Constant(vi, [0] * 16))
        even = ir.Constant(vi, [2 * i for i in range(16)])
        odd = ir.Constant(vi, [2 * i + 1 for i in range(16)])
        pos = [builder.shuffle_vector(cols[0], cols[1], even)]
        pos.append(builder.shuffle_vector(cols[2], cols[3], even))
        pos.append(builder.shuffle_vector(cols[0], cols[1], odd))
        pos.append(builder.shuffle_vector(cols[2], cols[3], odd))
        rint, fmin = _vf16(builder, "rint", 1), _vf16(builder, "minnum", 2)
        fmax = _vf16(builder, "maxnum", 2)
        fine = ir.Constant(vf, [256.0] * 16)
        hi_lim, lo_lim = ir.Constant(vf, [127.0] * 16), ir.Constant(vf, [-127.0] * 16)
        hs, ls = [], []
        for v in pos:
            v = builder.fmul(v, iv)
            h = builder.call(rint, [v])
            lo = builder.call(rint, [builder.fmul(builder.fsub(v, h), fine)])
            lo = builder.call(fmax, [builder.call(fmin, [lo, hi_lim]), lo_lim])
            hs.append(builder.fptosi(h, vi))
            ls.append(builder.fptosi(lo, vi))
        v32, v64 = ir.VectorType(_I32, 32), ir.VectorType(_I32, 64)
        b64 = ir.VectorType(_I8, 64)
        at_h = context.cast(builder, args[4], st[4], types.intp)
        at_l = builder.add(at_h, context.cast(builder, args[5], st[5], types.intp))
        for at, digits in ((at_h, hs), (at_l, ls)):
            a = builder.shuffle_vector(digits[0], digits[1], ir.Constant(v32, list(range(32))))
            b = builder.shuffle_vector(digits[2], digits[3], ir.Constant(v32, list(range(32))))
            whole = builder.shuffle_vector(a, b, ir.Constant(v64, list(range(64))))
            p = _ptr(context, builder, st[3], args[3], types.intp, at)
            builder.store(builder.trunc(whole, b64), builder.bitcast(p, b64.as_pointer()), align=1)
        # 256 * h + l per lane, then one reduction (two lane-0 reductions combined by scalar
        # multiplies came out wrong from this LLVM in a test: the sum stays in vectors)
        sh = builder.add(builder.add(hs[0], hs[1]), builder.add(hs[2], hs[3]))
        sl = builder.add(builder.add(ls[0], ls[1]), builder.add(ls[2], ls[3]))
        both = builder.add(builder.shl(sh, ir.Constant(vi, [8] * 16)), sl)
        red = builder.module.declare_intrinsic(
            "llvm.vector.reduce.add.v16i32", fnty=ir.FunctionType(_I32, [vi])
        )
        return builder.mul(builder.call(red, [both]), ir.Constant(_I32, -8))

    return types.int32(x, idx, inv, xq, qh, n_in), codegen


@_intrinsic
def q8dotw8(typingctx: Any, packed: Any, idx: Any, nb: Any, xw: Any, xi: Any, bias: Any) -> Any:
    """float32 of ``D`` for 8 rows and one 64-column group on AVX2: row ``k``'s 32 packed bytes
    at ``packed[idx + k * nb:]`` read as 16 little-endian words ``v``, whose four planes
    ``v & 15``, ``v >> 8 & 15``, ``v >> 4 & 15``, ``v >> 12`` are the weights of columns
    ``4m``, ``4m + 2``, ``4m + 1``, ``4m + 3`` (word ``m``), times the 64 activation words at
    ``xw[xi:]`` in that plane order (four ``vpmaddwd`` a row, the activation loaded once for
    the 8 rows), each row's eight int32 sums reduced by ``vphaddd`` across the rows (the lanes
    end as rows 0..7), plus ``bias``; exact integers, then one convert."""
    if not _c_array(packed, types.uint8) or not _c_array(xw, types.int16):
        return None
    if not _ints(idx, nb, xi, bias):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        st = sig.args
        v16s, v8i = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
        mod = builder.module
        maddwd = mod.declare_intrinsic(
            "llvm.x86.avx2.pmadd.wd", fnty=ir.FunctionType(v8i, [v16s, v16s])
        )
        hadd = mod.declare_intrinsic("llvm.x86.avx2.phadd.d", fnty=ir.FunctionType(v8i, [v8i, v8i]))
        px = _ptr(context, builder, st[3], args[3], st[4], args[4])
        px = builder.bitcast(px, v16s.as_pointer())
        xs = [builder.load(builder.gep(px, [ir.Constant(_I32, k)]), align=2) for k in range(4)]
        p0 = _ptr(context, builder, st[0], args[0], st[1], args[1])
        stride = context.cast(builder, args[2], st[2], types.intp)
        mask = ir.Constant(v16s, [15] * 16)
        sums = []
        for k in range(8):
            pk = builder.gep(p0, [builder.mul(stride, ir.Constant(stride.type, k))], inbounds=True)
            raw = builder.load(builder.bitcast(pk, v16s.as_pointer()), align=1)

            def shr(n: int, raw: Any = raw) -> Any:
                return builder.lshr(raw, ir.Constant(v16s, [n] * 16))

            planes = [builder.and_(raw, mask), builder.and_(shr(8), mask),
                      builder.and_(shr(4), mask), shr(12)]  # fmt: skip
            acc = None
            for w, x in zip(planes, xs, strict=True):
                prod = builder.call(maddwd, [w, x])
                acc = prod if acc is None else builder.add(acc, prod)
            sums.append(acc)
        # [r0 r1 r2 r3 | r4 r5 r6 r7] pairs: three rounds of vphaddd, then the 128-bit halves
        a = [builder.call(hadd, [sums[2 * i], sums[2 * i + 1]]) for i in range(4)]
        b = [builder.call(hadd, [a[0], a[1]]), builder.call(hadd, [a[2], a[3]])]
        # b[0] = [r0 r1 r2 r3 (low halves) | r0 r1 r2 r3 (high halves)], b[1] likewise r4..r7
        lo = builder.shuffle_vector(b[0], b[1], ir.Constant(v8i, [0, 1, 2, 3, 8, 9, 10, 11]))
        hi = builder.shuffle_vector(b[0], b[1], ir.Constant(v8i, [4, 5, 6, 7, 12, 13, 14, 15]))
        d = builder.add(lo, hi)
        bv = builder.insert_element(
            ir.Constant(v8i, None), context.cast(builder, args[5], st[5], types.int32),
            ir.Constant(_I32, 0),
        )  # fmt: skip
        d = builder.add(d, builder.shuffle_vector(bv, bv, ir.Constant(v8i, [0] * 8)))
        return builder.sitofp(d, ir.VectorType(_F32, 8))

    return f32x8(packed, idx, nb, xw, xi, bias), codegen


#: Where the integer dot is AVX2 without VNNI, the kernels take 8 rows at a time through 16-bit
#: activation words (``q8_rows_words``, the same bits): on a Zen 4 guest restricted to AVX2
#: instructions a [2048, 6144] matmul ran at 1.14-1.46x the exact 8-lane kernel for 1 to 64
#: tokens that way, 0.74-1.17x through the 16-row blocks.
WORDS = q8dot_kind() == "avx2"

#: Tokens per tile: a block's 16 transposed vectors serve this many tokens before the next
#: group; the tile's activations (2 * I bytes a token) stay in L2 while the blocks pass.
TILE = 32


# ============================================================================ kernels


@njit(nogil=True, cache=True)
def q8_prep(x, xq, bias, sx, xstride, bstride):  # type: ignore[no-untyped-def]
    """x [T, I] (C order) -> xq (token ``t``'s ``h`` digits at ``t * xstride``, reordered, its
    ``l`` digits ``I`` bytes later), bias int32 (token ``t`` at ``t * bstride``: [G]), sx
    [T, G]; see the module docstring. One vector pass per group (``absmax64``, ``round64``);
    ``q8_prep_scalar`` is the same in scalar code (tests compare them). The strides are a
    little more than ``2 * I`` / ``G`` so that the tokens of a tile do not all map to the same
    L1 sets (rows 4 KiB apart alias)."""
    n_tok, n_in = x.shape
    q8_prep_groups(x.reshape(-1), n_tok, n_in, xq, bias, sx, xstride, bstride, 0, n_in // 64)


@njit(nogil=True, cache=True)
def q8_prep_groups(x, n_tok, n_in, xq, bias, sx, xstride, bstride, g0, g1):  # type: ignore[no-untyped-def]
    """``q8_prep`` of groups ``g0 .. g1 - 1`` only (columns ``64 g0 .. 64 g1``) of the rows
    of ``x`` (flat [T * I]): a group's digits, bias and scale depend on its 64 columns alone,
    so the job crew rounds an MLP's intermediate rows range by range, each with the bits
    of the whole call."""
    n_groups = n_in // 64
    lim = np.float32(127.0)
    for t in range(n_tok):
        for g in range(g0, g1):
            amax = absmax64(x, t * n_in + g * 64)
            qh = t * xstride + g * 64  # this group's h digits; its l digits n_in later
            if amax == 0.0:
                sx[t * n_groups + g] = np.float32(0.0)
                for c in range(64):
                    xq[qh + c] = 0
                    xq[qh + n_in + c] = 0
                bias[t * bstride + g] = 0
                continue
            sx[t * n_groups + g] = amax / lim / np.float32(256.0)  # / 256: a power of two
            bias[t * bstride + g] = round64(x, t * n_in + g * 64, lim / amax, xq, qh, n_in)


@njit(nogil=True, cache=True)
def q8_prep_scalar(x, xq, bias, sx, xstride, bstride):  # type: ignore[no-untyped-def]
    """``q8_prep`` in scalar code, the statement its vector pass is tested against."""
    n_tok, n_in = x.shape
    n_groups = n_in // 64
    lim = np.float32(127.0)
    fine = np.float32(256.0)
    for t in range(n_tok):
        for g in range(n_groups):
            c0 = g * 64
            amax = np.float32(0.0)
            for c in range(64):
                a = abs(x[t, c0 + c])
                if a > amax:
                    amax = a
            qh = t * xstride + g * 64  # this group's h digits; its l digits n_in later
            if amax == 0.0:
                sx[t * n_groups + g] = np.float32(0.0)
                for c in range(64):
                    xq[qh + c] = 0
                    xq[qh + n_in + c] = 0
                bias[t * bstride + g] = 0
                continue
            inv = lim / amax
            sx[t * n_groups + g] = amax / lim / fine  # / 256 exactly: a power of two
            sh = np.int32(0)
            sl = np.int32(0)
            for j in range(64):  # position j of [low nibbles | high nibbles]
                col = c0 + 2 * j if j < 32 else c0 + 2 * (j - 32) + 1
                v = x[t, col] * inv
                h = np.rint(v)
                lo = np.rint((v - h) * fine)
                lo = min(max(lo, np.float32(-127.0)), np.float32(127.0))
                sh += np.int32(h)
                sl += np.int32(lo)
                xq[qh + j] = np.int8(h)
                xq[qh + n_in + j] = np.int8(lo)
            bias[t * bstride + g] = np.int32(-2048) * sh + np.int32(-8) * sl  # -8 (256 sh + sl)


@njit(nogil=True, cache=True)
def _q8_block(packed, scales, nb, r0, xq, bias, sx, xstride, bstride, out, o0, n, st, acc, pf):  # type: ignore[no-untyped-def]
    """Rows ``r0 .. r0 + 15`` of the weight against every token: ``out[t, o0 + k]`` for
    ``k < n`` gets row ``r0 + k`` (the module docstring's chain). ``st`` [G * 16] and ``acc``
    [TILE * 16] are scratch. ``pf`` > 0: while the first tile passes, the block two blocks on
    (16 rows are ``16 * B`` contiguous bytes) is prefetched into L2, a share of it per group.
    The block reads 16 rows in step, 32 bytes of each per group: 16 short streams that the
    hardware prefetchers follow badly (a [6144, 2048] GEMV from DRAM ran at 0.5x the exact
    kernel without this, 1.36x with it; one block ahead, or into L1, 0.66-1.17x)."""
    n_tok = out.shape[0]
    n_chunks = nb // 32
    n_in = nb * 2
    g16 = n_chunks - n_chunks % 16
    per = 16 * nb // n_chunks  # bytes of the block two on prefetched per group (512)
    for g in range(0, g16, 16):
        scales16(scales, r0 * n_chunks + g, n_chunks, st, g * 16)
    for k in range(16):
        for g in range(g16, n_chunks):
            st[g * 16 + k] = scales[(r0 + k) * n_chunks + g]
    base = r0 * nb
    for t0 in range(0, n_tok, TILE):
        t1 = min(t0 + TILE, n_tok)
        for i in range((t1 - t0) * 16):
            acc[i] = np.float32(0.0)
        for g in range(n_chunks):
            if pf > 0 and t0 == 0:
                ahead = base + 32 * nb + g * per
                for c in range(0, per, 64):
                    prefetch_l2(packed, ahead + c)
            w = i4block16(packed, base + g * 32, nb)
            s = vload16(st, g * 16)
            for t in range(t0, t1):
                f = q8blockdot(w, xq, t * xstride + g * 64, n_in, bias[t * bstride + g])
                a = (t - t0) * 16
                xs = vsplat16(sx[t * n_chunks + g])
                vstore16(acc, a, vfma16(vmul16(s, xs), f, vload16(acc, a)))
        for t in range(t0, t1):
            for k in range(n):
                out[t, o0 + k] = acc[(t - t0) * 16 + k]


@njit(nogil=True, cache=True)
def q8_words(xq, xo, n_in, xw):  # type: ignore[no-untyped-def]
    """One token's digits (``h`` at ``xq[xo:]``, ``l`` ``n_in`` bytes later) -> its activation
    words ``256 * h + l`` per 64-column group in ``q8dotw8``'s plane order:
    ``xw[g * 64 + p * 16 + m]`` is the word of position ``2m + (p & 1) + 32 * (p >> 1)``
    (columns ``4m``, ``4m + 2``, ``4m + 1``, ``4m + 3``)."""
    for g in range(n_in // 64):
        for p in range(4):
            for m in range(16):
                pos = xo + g * 64 + 2 * m + (p & 1) + 32 * (p >> 1)
                word = np.int32(256) * np.int32(xq[pos]) + np.int32(xq[pos + n_in])
                xw[g * 64 + p * 16 + m] = np.int16(word)


@njit(nogil=True, cache=True)
def q8_rows_words(packed, scales, n_out, nb, xq, bias, sx, xstride, bstride, out, pf):  # type: ignore[no-untyped-def]
    """``q8_gemm`` for a few tokens on AVX2 without VNNI, 8 rows at a time: per group the 8
    rows' weights as 16-bit words times each token's activation words (``q8dotw8``: four
    ``vpmaddwd`` a row, ``vphaddd`` across the rows) plus the bias is the block kernels'
    ``D`` for those rows; the same chain ``acc = fma(sw * sx, float(D), acc)`` in 8 lanes,
    so the same bits. One ``vpmaddwd`` multiplies 16 products where the byte digits need a
    ``vpmaddubsw`` per digit, and AVX2 has no two-source 32-bit shuffle for the blocks'
    register transposes. Rows past the last 8 go through a zero-padded copy of the same
    code."""
    n_tok = out.shape[0]
    n_chunks = nb // 32
    n_in = nb * 2
    per = n_chunks * 64  # a token's activation words
    xw = np.empty(n_tok * per, np.int16)
    for t in range(n_tok):
        q8_words(xq, t * xstride, n_in, xw[t * per : (t + 1) * per])
    st = np.empty(n_chunks * 8, np.float32)  # a block's scales, group-major
    acc = np.empty(n_tok * 8, np.float32)
    full = n_out - n_out % 8
    for r0 in range(0, n_out, 8):
        if r0 < full:
            pk, sc, base, n = packed, scales, r0, 8
        else:  # the rows left: a zero-padded block (zero scales)
            n = n_out - r0
            pk = np.zeros(8 * nb, np.uint8)
            sc = np.zeros(8 * n_chunks, np.float32)
            pk[: n * nb] = packed[r0 * nb : n_out * nb]
            sc[: n * n_chunks] = scales[r0 * n_chunks : n_out * n_chunks]
            base = 0
        for k in range(8):
            for g in range(n_chunks):
                st[g * 8 + k] = sc[(base + k) * n_chunks + g]
        for i in range(n_tok * 8):
            acc[i] = np.float32(0.0)
        for g in range(n_chunks):
            if pf > 0 and g % 2 == 0:
                for k in range(8):
                    prefetch(pk, (base + k) * nb + g * 32 + pf)
            s = vload(st, g * 8)
            for t in range(n_tok):
                f = q8dotw8(pk, base * nb + g * 32, nb, xw, t * per + g * 64, bias[t * bstride + g])
                a = vload(acc, t * 8)
                vstore(acc, t * 8, vfma(vmul(s, vsplat(sx[t * n_chunks + g])), f, a))
        for t in range(n_tok):
            for k in range(n):
                out[t, r0 + k] = acc[t * 8 + k]


@njit(nogil=True, cache=True)
def q8_gemm(packed, scales, n_out, nb, xq, bias, sx, xstride, bstride, out, pf):  # type: ignore[no-untyped-def]
    """out [T, O] for T >= 1 tokens; ``scales`` [O, G], one per 64-column chunk. Whole blocks
    of 16 rows in place; the last ``O % 16`` rows copied into a zero-padded block (zero
    scales) and computed by the same code, so every row is the same bits wherever it sits."""
    if WORDS:
        q8_rows_words(packed, scales, n_out, nb, xq, bias, sx, xstride, bstride, out, pf)
        return
    n_chunks = nb // 32
    st = zeros64(n_chunks * 16, np.float32)
    acc = zeros64(TILE * 16, np.float32)
    full = n_out - n_out % 16
    for r0 in range(0, full, 16):
        _q8_block(packed, scales, nb, r0, xq, bias, sx, xstride, bstride, out, r0, 16, st, acc, pf)
    rest = n_out - full
    if rest:
        pk = zeros64(16 * nb, np.uint8)
        sc = np.zeros(16 * n_chunks, np.float32)
        pk[: rest * nb] = packed[full * nb : n_out * nb]
        sc[: rest * n_chunks] = scales[full * n_chunks : n_out * n_chunks]
        _q8_block(pk, sc, nb, 0, xq, bias, sx, xstride, bstride, out, full, rest, st, acc, 0)


# ============================================================================ whole calls


@njit(nogil=True, cache=True, inline="always")
def q8_strides(n_in):  # type: ignore[no-untyped-def]
    """(xstride, bstride) of ``q8_prep`` for rows of ``n_in`` columns: the ``[2, I]`` digits
    and ``G`` biases of a token, plus 64 bytes / 16 ints so that tokens do not alias."""
    return 2 * n_in + 64, n_in // 64 + 16


@njit(nogil=True, cache=True)
def _q8_apply(xq, bias, sx, xstride, bstride, packed, scales, n_out, out, pf):  # type: ignore[no-untyped-def]
    """out [T, O] from rounded activations (``q8_prep``) and an int4 weight with one scale per
    64-column chunk (``q8_gemm``, one token or several: the same code)."""
    nb = packed.size // max(n_out, 1)
    if out.shape[0] and n_out:
        q8_gemm(packed, scales, n_out, nb, xq, bias, sx, xstride, bstride, out, pf)


@njit(nogil=True, cache=True)
def _q8_round(x):  # type: ignore[no-untyped-def]
    """``x [T, I]`` rounded by ``q8_prep``: (digits, biases, scales, xstride, bstride)."""
    n_tok, n_in = x.shape
    xstride, bstride = q8_strides(n_in)
    xq = zeros64(n_tok * xstride, np.int8)  # 64-byte aligned: whole-line vector loads
    bias = zeros64(n_tok * bstride, np.int32)
    sx = np.empty(n_tok * (n_in // 64), np.float32)
    if n_tok:
        q8_prep(x, xq, bias, sx, xstride, bstride)
    return xq, bias, sx, xstride, bstride


@njit(nogil=True, cache=True)
def q8_matmul(x, packed, scales, out, pf):  # type: ignore[no-untyped-def]
    """out [T, O] = x [T, I] @ W.T with ``x`` rounded here: what ``matmul_int4_q8`` computes
    (the same rounding, the same kernels, so the same bits), in one call."""
    xq, bias, sx, xstride, bstride = _q8_round(x)
    _q8_apply(xq, bias, sx, xstride, bstride, packed, scales, out.shape[1], out, pf)


@njit(nogil=True, cache=True)
def q8_swiglu(x, gp, gs, up, us, dp, ds, out, pf):  # type: ignore[no-untyped-def]
    """``out [T, D] = down(silu(gate(x)) * up(x))`` under fast-int8, in one call: ``x``
    rounded once for gate and up, then ``silu_mul``, then the down projection on the rounded
    product: the same bits as three ``matmul_int4_q8`` calls and ``silu_times``. Per
    projection: packed bytes [O * I / 2] and one scale per 64-column chunk [O * I / 64]."""
    n_tok = x.shape[0]
    n_f = gs.size * 64 // x.shape[1]
    xq, bias, sx, xstride, bstride = _q8_round(x)
    g = np.empty((n_tok, n_f), np.float32)
    u = np.empty((n_tok, n_f), np.float32)
    _q8_apply(xq, bias, sx, xstride, bstride, gp, gs, n_f, g, pf)
    _q8_apply(xq, bias, sx, xstride, bstride, up, us, n_f, u, pf)
    silu_mul(g, u, g)
    q8_matmul(g, dp, ds, out, pf)


@njit(nogil=True, cache=True)
def q8_expert(x, ids, gates, e, gp, gs, up, us, dp, ds, pf):  # type: ignore[no-untyped-def]
    """Routed expert ``e`` under fast-int8 on the rows of ``x`` [T, D] routed to it (``ids``
    [T, K]): (rows [n] ascending, ``gate * swiglu(x[rows])`` [n, D]), as ``np.nonzero``, the
    gather, ``q8_swiglu`` and the gate product compute it, in one call."""
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
                xe[r] = x[t]
                r += 1
    out = np.empty((n, x.shape[1]), np.float32)
    if n:
        q8_swiglu(xe, gp, gs, up, us, dp, ds, out, pf)
    for r in range(n):
        for c in range(out.shape[1]):
            out[r, c] = out[r, c] * g[r]
    return rows, out


#: Every compiled kernel (tests check they were built with ``nogil=True``).
KERNELS = (
    q8_prep,
    q8_prep_groups,
    q8_prep_scalar,
    q8_words,
    q8_rows_words,
    _q8_block,
    q8_gemm,
    _q8_apply,
    _q8_round,
    q8_matmul,
    q8_swiglu,
    q8_expert,
)

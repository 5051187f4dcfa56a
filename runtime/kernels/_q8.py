"""The opt-in lossy kernels (``--kernels fast-int8``): int4 weights x int8 activation digits.

Why: the exact kernels convert every int4 weight to float32 before the multiply-add, and that
decode, not DRAM, bounds them (docs/benchmarks.md). Here the products are integer: ``vpdpbusd``
(AVX-512 VNNI) multiplies 64 unsigned weight nibbles by 64 signed activation bytes and adds each
run of four products into one of 16 int32 lanes; the float work is one convert and one FMA per
64 weights.

The activations: per token and 64-column group, ``v = x * 127 / max|x|`` is written as two int8
digits, ``h = rint(v)`` and ``l = clip(rint((v - h) * 256), -127, 127)``, i.e. 16-bit fixed point
relative to the group's largest value (a plain int8 rounding, as llama.cpp's Q8 activations,
lost up to 12% of the greedy tokens on the random oracle models; the second digit costs one more
``vpdpbusd`` and no measurable time, since the GEMV is bound by reading the weights). The
integer result per lane is ``256 * (h . w) + (l . w)``, below 2**21, so its float32 convert is
exact.

What it costs: the activations are rounded (to about 1/65000 of each group's largest value), so
results differ from the exact kernels by more than float rounding and greedy tokens may differ:
the agreement is measured by ``tools/bench/kernels.py`` and tested on the oracle models. It is
never on by default.

Determinism and batch invariance hold as for the exact kernels: integer sums are exact in any
order, the rounding of a token depends only on that token, and the float combination (16 lanes,
``acc = fma(sw * sx, float(dot), acc)`` per group in increasing order, fixed lane sum) is the
same code for one token or 64. Every machine computes the same integers, with VNNI where the
CPU has it, ``vpmaddwd`` on AVX2 and plain vector integer ops elsewhere, so the bits are the
same on every x86-64 CPU.

On AVX2 without VNNI the two digits are stored as one 16-bit word ``256 * h + l`` (``WORDS``):
one ``vpmaddwd`` multiplies 16 weight words by 16 activation words and adds pairs, where the
digit layout needs ``vpmaddubsw`` + ``vpmaddwd`` for each digit; CPUs with one vector-multiply
pipe (Zen 1) are bound by those multiplies. Per 64-column chunk the words sit in four planes
of 16, columns ``4m``, ``4m + 2``, ``4m + 1``, ``4m + 3`` (word ``m``), which is what 32
packed bytes read as 16 words give after ``& 15``, ``>> 8 & 15``, ``>> 4 & 15``, ``>> 12``.

Layout of the prepared activations of token ``t`` (``xq`` rows of ``2 * I`` bytes: the ``h``
digits, then the ``l`` digits; ``bias`` rows of ``G * 16`` int32):
per 64-column group ``g``, bytes ``g*64 : g*64+32`` hold columns ``g*64 + 0, 2, ..., 62`` (the
low nibbles) and ``g*64+32 : g*64+64`` columns ``g*64 + 1, 3, ..., 63`` (the high nibbles), so
that 32 packed bytes unpacked as ``[lo x 32 | hi x 32]`` line up with them byte for byte;
``bias[.., g*16 + k] = -8 * (256 * (sum of the four h digits of lane k) + (sum of the four l
digits))`` (the nibbles are ``q + 8``);
``sx[t, g] = max|x| / 127 / 256`` (0 for an all-zero group).

Shape legend: T tokens, I in features (a multiple of 64 here), O out features, G = I / 64 groups,
B = I / 2 packed bytes per row; lanes: 16 int32 or float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, models, register_model

from runtime.kernels._intrinsics import prefetch, zeros64
from runtime.kernels._matmul_kernels import silu_mul
from runtime.kernels._simd import (
    f32x16,
    host_codegen_features,
    vfma16,
    vhsum16,
    vsplat16,
    vzero16,
)

__all__ = [
    "KERNELS",
    "has_avx2_codegen",
    "has_vnni_codegen",
    "i4unpack64",
    "i4words64",
    "q8_expert",
    "q8_gemm",
    "q8_gemv",
    "q8_matmul",
    "q8_prep",
    "q8_prep_as",
    "q8_strides",
    "q8_swiglu",
    "q8dot",
    "q8dot_avx2",
    "q8dot_kind",
    "q8dot_portable",
    "q8dotw",
]

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


def has_vnni_codegen() -> bool:
    """Whether the code numba generates for this CPU may use ``vpdpbusd`` (512-bit VNNI)."""
    return {"avx512vnni", "avx512bw"} <= host_codegen_features()


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


def _ptr(context: Any, builder: Any, arrty: Any, arr: Any, idxty: Any, idx: Any) -> Any:
    ary = context.make_array(arrty)(context, builder, arr)
    offset = context.cast(builder, idx, idxty, types.intp)
    return builder.gep(ary.data, [offset], inbounds=True)


def _c_array(arr: Any, dtype: Any) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == dtype and arr.layout == "C"


@_intrinsic
def i4unpack64(typingctx: Any, packed: Any, idx: Any) -> Any:
    """32 packed bytes ``packed[idx : idx + 32]`` -> ``[low nibbles x 32 | high nibbles x 32]``."""
    if not _c_array(packed, types.uint8) or not isinstance(idx, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        v32 = ir.VectorType(_I8, 32)
        raw = builder.load(builder.bitcast(p, v32.as_pointer()), align=1)
        lo = builder.and_(raw, ir.Constant(v32, [15] * 32))
        hi = builder.lshr(raw, ir.Constant(v32, [4] * 32))
        return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 64), list(range(64))))

    return i8x64(packed, idx), codegen


class I16x64(types.Type):
    """numba type of 64 unpacked int4 weights as words (``<64 x i16>``, values 0..15)."""

    def __init__(self) -> None:
        super().__init__(name="i16x64")


i16x64 = I16x64()


@register_model(I16x64)
class _I16x64Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, ir.VectorType(_I16, 64))  # type: ignore[no-untyped-call]


@_intrinsic
def i4words64(typingctx: Any, packed: Any, idx: Any) -> Any:
    """32 packed bytes ``packed[idx : idx + 32]`` read as 16 little-endian words ``v`` ->
    ``[v & 15 | v >> 8 & 15 | v >> 4 & 15 | v >> 12]``: the nibbles of columns ``4m``,
    ``4m + 2``, ``4m + 1``, ``4m + 3`` of the 64-column chunk (word ``m`` of each plane)."""
    if not _c_array(packed, types.uint8) or not isinstance(idx, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        v16 = ir.VectorType(_I16, 16)
        raw = builder.load(builder.bitcast(p, v16.as_pointer()), align=1)
        mask = ir.Constant(v16, [15] * 16)

        def shr(n: int) -> Any:
            return builder.lshr(raw, ir.Constant(v16, [n] * 16))

        planes = [
            builder.and_(raw, mask),
            builder.and_(shr(8), mask),
            builder.and_(shr(4), mask),
            shr(12),
        ]
        v32 = ir.VectorType(_I32, 32)
        a = builder.shuffle_vector(planes[0], planes[1], ir.Constant(v32, list(range(32))))
        b = builder.shuffle_vector(planes[2], planes[3], ir.Constant(v32, list(range(32))))
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 64), list(range(64))))

    return i16x64(packed, idx), codegen


@_intrinsic
def q8dotw(typingctx: Any, w: Any, xq: Any, xi: Any, xs: Any, bias: Any, bi: Any) -> Any:
    """``q8dot`` for the word layout: the 64 activation words ``256 * h + l`` at byte
    ``xq[xi:]`` (planes as ``i4words64``) times the weight words by ``vpmaddwd``, two products
    per int32, then the two planes of each half added: lane ``k`` holds the very integer
    ``256 * (h . w) + (l . w) + bias`` of ``q8dot``'s lane ``k``. ``xs`` is unused (one
    multiply per pair of products instead of two per quad: half the vector multiplies)."""
    ints = (xi, xs, bi)
    if (
        w != i16x64
        or not _c_array(xq, types.int8)
        or not _c_array(bias, types.int32)
        or not all(isinstance(v, types.Integer) for v in ints)
    ):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        st = sig.args
        v16s, v8i, v16i = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8), ir.VectorType(_I32, 16)
        maddwd = builder.module.declare_intrinsic(
            "llvm.x86.avx2.pmadd.wd", fnty=ir.FunctionType(v8i, [v16s, v16s])
        )
        px = _ptr(context, builder, st[1], args[1], st[2], args[2])
        xw = builder.load(builder.bitcast(px, ir.VectorType(_I16, 64).as_pointer()), align=1)
        prods = []
        for k in range(4):
            sel = ir.Constant(ir.VectorType(_I32, 16), list(range(16 * k, 16 * k + 16)))
            wk = builder.shuffle_vector(args[0], args[0], sel)
            xk = builder.shuffle_vector(xw, xw, sel)
            prods.append(builder.call(maddwd, [wk, xk]))
        lo, hi = builder.add(prods[0], prods[1]), builder.add(prods[2], prods[3])
        acc = builder.shuffle_vector(lo, hi, ir.Constant(v16i, list(range(16))))
        pb = _ptr(context, builder, st[4], args[4], st[5], args[5])
        acc = builder.add(acc, builder.load(builder.bitcast(pb, v16i.as_pointer()), align=1))
        return builder.sitofp(acc, ir.VectorType(_F32, 16))

    return f32x16(w, xq, xi, xs, bias, bi), codegen


def has_avx2_codegen() -> bool:
    """Whether the code numba generates for this CPU may use AVX2's ``vpmaddubsw`` and
    ``vpmaddwd``."""
    return "avx2" in host_codegen_features()


def _dot4_avx2(builder: Any, acc: Any, w: Any, xv: Any) -> Any:
    """``dot4`` from AVX2 ops, 32 bytes at a time: ``vpmaddubsw`` adds the products of byte
    pairs into int16 (at most 2 * 15 * 127, so it never saturates), ``vpmaddwd`` by ones adds
    int16 pairs into int32: lane k holds bytes 4k..4k+3, as ``vpdpbusd`` sums them."""
    v32b, v16s = ir.VectorType(_I8, 32), ir.VectorType(ir.IntType(16), 16)
    v8i = ir.VectorType(_I32, 8)
    mod = builder.module
    maddubs = mod.declare_intrinsic(
        "llvm.x86.avx2.pmadd.ub.sw", fnty=ir.FunctionType(v16s, [v32b, v32b])
    )
    maddwd = mod.declare_intrinsic(
        "llvm.x86.avx2.pmadd.wd", fnty=ir.FunctionType(v8i, [v16s, v16s])
    )
    ones = ir.Constant(v16s, [1] * 16)
    halves = []
    for h in range(2):
        sel = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * h, 32 * h + 32)))
        pairs = builder.call(
            maddubs, [builder.shuffle_vector(w, w, sel), builder.shuffle_vector(xv, xv, sel)]
        )
        halves.append(builder.call(maddwd, [pairs, ones]))
    joined = ir.Constant(ir.VectorType(_I32, 16), list(range(16)))
    return builder.add(acc, builder.shuffle_vector(halves[0], halves[1], joined))


def _make_q8dot(kind: str) -> Any:
    """The ``q8dot`` intrinsic: ``kind`` "vnni" (``vpdpbusd``), "avx2" (``vpmaddubsw`` +
    ``vpmaddwd``) or "portable" (plain vector integer ops). The same integers: products are
    at most 15 * 127 and every sum stays far inside int32."""

    def dot4(builder: Any, acc: Any, w: Any, xv: Any) -> Any:
        """``acc[k] + sum_{j<4} w[4k+j] * x[4k+j]`` (w unsigned, x signed bytes)."""
        v16i = ir.VectorType(_I32, 16)
        if kind == "vnni":
            fnty = ir.FunctionType(v16i, [v16i, v16i, v16i])
            fn = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512", fnty=fnty)
            x32 = builder.bitcast(xv, v16i)
            return builder.call(fn, [acc, builder.bitcast(w, v16i), x32])
        if kind == "avx2":
            return _dot4_avx2(builder, acc, w, xv)
        v64i = ir.VectorType(_I32, 64)
        prod = builder.mul(builder.zext(w, v64i), builder.sext(xv, v64i))
        for j in range(4):
            sel = ir.Constant(v16i, [4 * k + j for k in range(16)])
            acc = builder.add(acc, builder.shuffle_vector(prod, prod, sel))
        return acc

    @_intrinsic
    def q8dot(typingctx: Any, w: Any, xq: Any, xi: Any, xs: Any, bias: Any, bi: Any) -> Any:
        """float32 of the 16 int32 lanes ``256 * (h . w) + (l . w) + bias`` per run of four
        bytes, with the ``h`` digits at ``xq[xi:]``, the ``l`` digits ``xs`` bytes later and
        the lanes' bias at ``bias[bi:]``: exact integers (two independent dot products, one
        shift, one add), then one convert."""
        ints = (xi, xs, bi)
        if (
            w != i8x64
            or not _c_array(xq, types.int8)
            or not _c_array(bias, types.int32)
            or not all(isinstance(v, types.Integer) for v in ints)
        ):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            v16i, v64b = ir.VectorType(_I32, 16), ir.VectorType(_I8, 64)
            st = sig.args

            def load(arr: int, idx: Any, idxty: Any, vty: Any) -> Any:
                p = _ptr(context, builder, st[arr], args[arr], idxty, idx)
                return builder.load(builder.bitcast(p, vty.as_pointer()), align=1)

            xl_idx = builder.add(
                context.cast(builder, args[2], st[2], types.intp),
                context.cast(builder, args[3], st[3], types.intp),
            )
            zero = ir.Constant(v16i, None)
            hi = dot4(builder, zero, args[0], load(1, args[2], st[2], v64b))
            lo = dot4(
                builder, load(4, args[5], st[5], v16i), args[0], load(1, xl_idx, types.intp, v64b)
            )
            acc = builder.add(builder.shl(hi, ir.Constant(v16i, [8] * 16)), lo)
            return builder.sitofp(acc, ir.VectorType(_F32, 16))

        return f32x16(w, xq, xi, xs, bias, bi), codegen

    return q8dot


def q8dot_kind() -> str:
    """Which ``q8dot`` the kernels use here: "vnni", "avx2" or "portable"."""
    if has_vnni_codegen():
        return "vnni"
    return "avx2" if has_avx2_codegen() else "portable"


#: What the kernels use: the fastest integer dot numba's code for this CPU may have.
q8dot = _make_q8dot(q8dot_kind())
#: The same integers from AVX2 ops and from plain ones (tests compare them bit for bit with
#: ``q8dot`` where the CPU has the instructions).
q8dot_avx2 = _make_q8dot("avx2")
q8dot_portable = _make_q8dot("portable")

#: Where the integer dot is AVX2 without VNNI, the activations are stored as 16-bit words
#: ``256 * h + l`` (``q8dotw``, one ``vpmaddwd`` per 16 products) instead of two digit rows
#: (``q8dot``, two ``vpmaddubsw`` + two ``vpmaddwd`` per 32): the same integers, half the
#: vector multiplies, which bound the kernel on CPUs with one vector-multiply pipe.
WORDS = q8dot_kind() == "avx2"
_unpack = i4words64 if WORDS else i4unpack64
_dot = q8dotw if WORDS else q8dot
#: Bytes of a token's prepared activations per 64-column chunk, at ``t * xstride + g * _XG``
#: (the digit layout keeps its ``l`` digits ``I`` bytes after the ``h`` digits).
_XG = 128 if WORDS else 64


# ============================================================================ kernels


@njit(nogil=True, cache=True)
def q8_prep(x, xq, bias, sx, xstride, bstride):  # type: ignore[no-untyped-def]
    """x [T, I] -> xq (token ``t`` at ``t * xstride``, in this machine's layout: ``WORDS``),
    bias int32 (token ``t`` at ``t * bstride``: [G * 16]), sx [T, G]; see ``q8_prep_as``."""
    q8_prep_as(x, xq, bias, sx, xstride, bstride, WORDS)


@njit(nogil=True, cache=True)
def q8_prep_as(x, xq, bias, sx, xstride, bstride, words):  # type: ignore[no-untyped-def]
    """x [T, I] -> xq: per token, either the int8 digits ([2, I], reordered, see the module
    docstring) or, with ``words``, per 64-column chunk the 64 int16 words ``256 * h + l`` in
    the planes of ``i4words64``; bias and sx as ``q8_prep``: the same digits either way.
    The strides are a little more than ``2 * I`` / ``G * 16`` so that the tokens of a tile
    do not all map to the same L1 sets (rows 4 KiB apart alias)."""
    n_tok, n_in = x.shape
    xg = 128 if words else 64  # a chunk's bytes at qh (digits: its h digits)
    half = 64 if words else n_in  # where the second half of a chunk's bytes starts after qh
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
            # digit layout: the h digits of this group here, the l digits n_in later;
            # word layout: 64 words (128 bytes) here
            qh = t * xstride + g * xg
            bh = t * bstride + g * 16
            if amax == 0.0:
                sx[t * n_groups + g] = np.float32(0.0)
                for c in range(64):
                    xq[qh + c] = 0
                    xq[qh + half + c] = 0
                for k in range(16):
                    bias[bh + k] = 0
                continue
            inv = lim / amax
            sx[t * n_groups + g] = amax / lim / fine  # / 256 exactly: a power of two
            for k in range(16):
                sh = np.int32(0)
                sl = np.int32(0)
                for j in range(4 * k, 4 * k + 4):  # position j of [low nibbles | high nibbles]
                    col = c0 + 2 * j if j < 32 else c0 + 2 * (j - 32) + 1
                    v = x[t, col] * inv
                    h = np.rint(v)
                    lo = np.rint((v - h) * fine)
                    lo = min(max(lo, np.float32(-127.0)), np.float32(127.0))
                    sh += np.int32(h)
                    sl += np.int32(lo)
                    if words:  # plane (col & 1) * 2 + (col >> 1 & 1), word (col - c0) >> 2
                        c = col - c0
                        wi = qh + 2 * (((c & 1) * 2 + ((c >> 1) & 1)) * 16 + (c >> 2))
                        word = np.int16(np.int32(256) * np.int32(h) + np.int32(lo))
                        xq[wi] = np.int8(word & 255)  # little-endian int16
                        xq[wi + 1] = np.int8(word >> 8)
                    else:
                        xq[qh + j] = np.int8(h)
                        xq[qh + n_in + j] = np.int8(lo)
                bias[bh + k] = np.int32(-2048) * sh + np.int32(-8) * sl  # 256*(-8 sh) - 8 sl


@njit(nogil=True, cache=True, inline="always")
def _q8_row_pair(packed, scales, o, d, nb, xq, xo, bias, bo, sx, so, pf):  # type: ignore[no-untyped-def]
    """Rows ``o`` and ``o + d`` against the token whose digits, biases and scales start at
    ``xo``, ``bo``, ``so``: their two 16-lane accumulators. Per row, chunk ``g`` in increasing
    order: ``acc = fma(sw[g] * sx[g], float(dot), acc)``. The two rows share each activation
    load; each row's arithmetic is the same as alone (``_q8_row``). ``pf`` > 0: each row is
    prefetched ``pf`` bytes ahead."""
    n_chunks = nb // 32
    n_in = nb * 2
    row = o * nb
    rowb = row + d * nb
    srow = o * n_chunks
    srowb = srow + d * n_chunks
    a = vzero16()
    b = vzero16()
    for g in range(n_chunks):
        g0 = g * 32
        if pf > 0 and g % 2 == 0:
            prefetch(packed, row + g0 + pf)
            prefetch(packed, rowb + g0 + pf)
        xs = sx[so + g]
        xi, bi = xo + g * _XG, bo + g * 16
        fa = _dot(_unpack(packed, row + g0), xq, xi, n_in, bias, bi)
        fb = _dot(_unpack(packed, rowb + g0), xq, xi, n_in, bias, bi)
        a = vfma16(vsplat16(scales[srow + g] * xs), fa, a)
        b = vfma16(vsplat16(scales[srowb + g] * xs), fb, b)
    return a, b


@njit(nogil=True, cache=True, inline="always")
def _q8_row(packed, scales, o, nb, xq, xo, bias, bo, sx, so, pf):  # type: ignore[no-untyped-def]
    """Row ``o`` (one token, as ``_q8_row_pair``): its accumulator, the same arithmetic."""
    n_chunks = nb // 32
    n_in = nb * 2
    row = o * nb
    a = vzero16()
    for g in range(n_chunks):
        g0 = g * 32
        if pf > 0 and g % 2 == 0:
            prefetch(packed, row + g0 + pf)
        f = _dot(_unpack(packed, row + g0), xq, xo + g * _XG, n_in, bias, bo + g * 16)
        a = vfma16(vsplat16(scales[o * n_chunks + g] * sx[so + g]), f, a)
    return a


@njit(nogil=True, cache=True)
def q8_gemv(packed, scales, n_out, nb, xq, bias, sx, out, pf):  # type: ignore[no-untyped-def]
    """One token: out [O]; ``scales`` [O, G], one per 64-column chunk. Rows go in pairs half
    the matrix apart sharing the activation loads: two DRAM read streams far apart, each
    prefetched ``pf / 2`` ahead (see the exact kernels' ``_i4_quad16``)."""
    half = n_out // 2
    for o in range(half):
        a, b = _q8_row_pair(packed, scales, o, half, nb, xq, 0, bias, 0, sx, 0, pf // 2)
        out[o] = vhsum16(a)
        out[o + half] = vhsum16(b)
    if n_out % 2:
        o = n_out - 1
        out[o] = vhsum16(_q8_row(packed, scales, o, nb, xq, 0, bias, 0, sx, 0, pf))


@njit(nogil=True, cache=True, inline="always")
def _q8_pair_tile4(packed, scales, o, nb, xq, bias, sx, xstride, bstride, out, t0, pf):  # type: ignore[no-untyped-def]
    """Rows ``o`` and ``o + 1`` against tokens ``t0 .. t0 + 3``: each weight chunk unpacked
    once for the four tokens (``_q8_row_pair`` unpacks it again for every token), eight
    accumulators in registers. Per (row, token) exactly the arithmetic of ``_q8_row``: its
    accumulator from zero, ``acc = fma(sw[g] * sx[g], float(dot), acc)`` chunk by chunk in
    increasing order, then the fixed lane sum."""
    n_chunks = nb // 32
    n_in = nb * 2
    row = o * nb
    rowb = row + nb
    srow = o * n_chunks
    srowb = srow + n_chunks
    x0, x1, x2, x3 = t0 * xstride, (t0 + 1) * xstride, (t0 + 2) * xstride, (t0 + 3) * xstride
    b0, b1, b2, b3 = t0 * bstride, (t0 + 1) * bstride, (t0 + 2) * bstride, (t0 + 3) * bstride
    s0, s1, s2, s3 = t0 * n_chunks, (t0 + 1) * n_chunks, (t0 + 2) * n_chunks, (t0 + 3) * n_chunks
    a0, a1, a2, a3 = vzero16(), vzero16(), vzero16(), vzero16()
    c0, c1, c2, c3 = vzero16(), vzero16(), vzero16(), vzero16()
    for g in range(n_chunks):
        g0 = g * 32
        if pf > 0 and g % 2 == 0:
            prefetch(packed, row + g0 + pf)
            prefetch(packed, rowb + g0 + pf)
        wa = _unpack(packed, row + g0)
        wb = _unpack(packed, rowb + g0)
        xg, bg = g * _XG, g * 16
        sa, sb = scales[srow + g], scales[srowb + g]
        xs = sx[s0 + g]
        a0 = vfma16(vsplat16(sa * xs), _dot(wa, xq, x0 + xg, n_in, bias, b0 + bg), a0)
        c0 = vfma16(vsplat16(sb * xs), _dot(wb, xq, x0 + xg, n_in, bias, b0 + bg), c0)
        xs = sx[s1 + g]
        a1 = vfma16(vsplat16(sa * xs), _dot(wa, xq, x1 + xg, n_in, bias, b1 + bg), a1)
        c1 = vfma16(vsplat16(sb * xs), _dot(wb, xq, x1 + xg, n_in, bias, b1 + bg), c1)
        xs = sx[s2 + g]
        a2 = vfma16(vsplat16(sa * xs), _dot(wa, xq, x2 + xg, n_in, bias, b2 + bg), a2)
        c2 = vfma16(vsplat16(sb * xs), _dot(wb, xq, x2 + xg, n_in, bias, b2 + bg), c2)
        xs = sx[s3 + g]
        a3 = vfma16(vsplat16(sa * xs), _dot(wa, xq, x3 + xg, n_in, bias, b3 + bg), a3)
        c3 = vfma16(vsplat16(sb * xs), _dot(wb, xq, x3 + xg, n_in, bias, b3 + bg), c3)
    out[t0, o] = vhsum16(a0)
    out[t0, o + 1] = vhsum16(c0)
    out[t0 + 1, o] = vhsum16(a1)
    out[t0 + 1, o + 1] = vhsum16(c1)
    out[t0 + 2, o] = vhsum16(a2)
    out[t0 + 2, o + 1] = vhsum16(c2)
    out[t0 + 3, o] = vhsum16(a3)
    out[t0 + 3, o + 1] = vhsum16(c3)


@njit(nogil=True, cache=True)
def q8_gemm(packed, scales, n_out, nb, xq, bias, sx, xstride, bstride, out, pf):  # type: ignore[no-untyped-def]
    """T tokens: out [T, O], each (token, row) with the arithmetic of ``q8_gemv`` (so row ``t``
    is bit-identical to a one-token call). Rows outside, in pairs; tokens inside, in register
    tiles of four (``_q8_pair_tile4``: a chunk of both rows unpacked once for four tokens),
    the tokens left over one at a time (``_q8_row_pair``): a pair of weight rows stays in L1
    while every token passes over it."""
    n_tok = out.shape[0]
    n_chunks = nb // 32
    full = n_tok - n_tok % 4
    for o in range(0, n_out - 1, 2):
        for t0 in range(0, full, 4):
            _q8_pair_tile4(
                packed, scales, o, nb, xq, bias, sx, xstride, bstride, out, t0,
                pf if t0 == 0 else 0,
            )  # fmt: skip
        for t in range(full, n_tok):
            xo, bo, so = t * xstride, t * bstride, t * n_chunks
            a, b = _q8_row_pair(
                packed, scales, o, 1, nb, xq, xo, bias, bo, sx, so, pf if t == 0 else 0
            )
            out[t, o] = vhsum16(a)
            out[t, o + 1] = vhsum16(b)
    if n_out % 2:
        o = n_out - 1
        for t in range(n_tok):
            xo, bo, so = t * xstride, t * bstride, t * n_chunks
            out[t, o] = vhsum16(_q8_row(packed, scales, o, nb, xq, xo, bias, bo, sx, so, pf))


# ============================================================================ whole calls


@njit(nogil=True, cache=True, inline="always")
def q8_strides(n_in):  # type: ignore[no-untyped-def]
    """(xstride, bstride) of ``q8_prep`` for rows of ``n_in`` columns: the ``[2, I]`` digits
    and ``G * 16`` biases of a token, plus 64 bytes / 16 ints so that tokens do not alias."""
    return 2 * n_in + 64, n_in // 64 * 16 + 16


@njit(nogil=True, cache=True)
def _q8_apply(xq, bias, sx, xstride, bstride, packed, scales, n_out, out, pf):  # type: ignore[no-untyped-def]
    """out [T, O] from rounded activations (``q8_prep``) and an int4 weight with one scale per
    64-column chunk: ``q8_gemv`` for one token, ``q8_gemm`` for several."""
    nb = packed.size // max(n_out, 1)
    if out.shape[0] == 1:
        q8_gemv(packed, scales, n_out, nb, xq, bias, sx, out[0], pf)
    elif out.shape[0] > 1:
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
    q8_prep_as,
    q8_gemv,
    q8_gemm,
    _q8_pair_tile4,
    _q8_row,
    _q8_row_pair,
    _q8_apply,
    _q8_round,
    q8_matmul,
    q8_swiglu,
    q8_expert,
)

"""float32 vector types for numba kernels (8 and 16 lanes), with explicit lane order.

Why: numba leaves LLVM's SLP vectorizer off, and its loop vectorizer refuses float reductions
without fast-math, so a plain ``for`` loop dot product runs scalar (~1 ns/element here). These
intrinsics let a kernel hold ``<8 x float>`` / ``<16 x float>`` values in registers and say
exactly which lane each product lands in, so the summation order is fixed by the source, not by a
vectorizer heuristic: that is what makes the kernels deterministic and batch-invariant.

Two widths, the same operations: ``vload``, ``vfma``, ``vhsum``... work on 8 lanes (one AVX2
register); the ``...16`` names (``vload16``, ``vfma16``, ``vhsum16``...) on 16 lanes (one AVX-512
register). Lane ``k`` of a load holds element ``idx + k``. Loads and stores are unchecked and
unaligned: the caller guarantees ``idx + L <= arr.size``.

Every arithmetic op is a single IEEE operation per lane (``vfma`` is a fused multiply-add with one
rounding, which is exactly specified too), so a kernel's result depends on its lane count and its
source, never on the instruction set it runs on: a 16-lane kernel on an AVX2 machine (LLVM splits
each vector op in two) gives the same bits as on an AVX-512 one, only slower.

Shape legend: L = 8 or 16 lanes of float32; idx is a flat element index into a C array.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic, models, register_model

__all__ = [
    "LANES",
    "F32x8",
    "F32x16",
    "bf16x8",
    "f16x8",
    "f32x8",
    "f32x16",
    "host_codegen_features",
    "i4byte8",
    "i4lo8",
    "i4lo16",
    "i4lo16_portable",
    "i8x8",
    "i8x16",
    "u8f16",
    "vadd",
    "vadd16",
    "vfma",
    "vfma16",
    "vhsum",
    "vhsum16",
    "vhsum16x4",
    "vload",
    "vload16",
    "vmul",
    "vmul16",
    "vsplat",
    "vsplat16",
    "vstore",
    "vstore16",
    "vzero",
    "vzero16",
]

LANES = 8  # the narrow width; every format has an 8-lane kernel
_F32 = ir.FloatType()
_I32 = ir.IntType(32)


def _intrinsic(fn: Callable[..., Any]) -> Any:
    """``numba.extending.intrinsic``; typed ``Any`` because kernels call it without typingctx."""
    return intrinsic(fn)


class F32x8(types.Type):
    """numba type of an ``<8 x float>`` register value."""

    lanes = 8

    def __init__(self) -> None:
        super().__init__(name="f32x8")


class F32x16(types.Type):
    """numba type of a ``<16 x float>`` register value."""

    lanes = 16

    def __init__(self) -> None:
        super().__init__(name="f32x16")


f32x8 = F32x8()
f32x16 = F32x16()


@register_model(F32x8)
@register_model(F32x16)
class _VectorModel(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, ir.VectorType(_F32, fe_type.lanes))  # type: ignore[no-untyped-call]


def _splat(value: ir.Constant | ir.Value, vty: ir.VectorType) -> ir.Constant:
    return ir.Constant(vty, [value] * vty.count)


def _vector_ptr(context: Any, builder: Any, arrty: Any, arr: Any, idxty: Any, idx: Any) -> Any:
    """Pointer to ``arr.flat[idx]`` (C-contiguous array, no bounds or wraparound check)."""
    ary = context.make_array(arrty)(context, builder, arr)
    offset = context.cast(builder, idx, idxty, types.intp)
    return builder.gep(ary.data, [offset], inbounds=True)


def _load_vec(context: Any, builder: Any, sig: Any, args: Any, lane_ty: ir.Type, n: int) -> Any:
    ptr = _vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
    vptr = builder.bitcast(ptr, ir.VectorType(lane_ty, n).as_pointer())
    return builder.load(vptr, align=1)


def _is_array(arr: Any, dtype: Any) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == dtype and arr.layout == "C"


def _magic_float(builder: Any, lanes: Any, offset: float, n: int) -> Any:
    # OR-ing an int 0..255 into the mantissa of 2**23 and subtracting 2**23 + offset gives
    # float(int - offset) exactly, cheaper than an int->float convert on this class of CPU.
    vf, vi = ir.VectorType(_F32, n), ir.VectorType(_I32, n)
    biased = builder.or_(lanes, _splat(ir.Constant(_I32, 0x4B000000), vi))
    return builder.fsub(
        builder.bitcast(biased, vf), _splat(ir.Constant(_F32, 8388608.0 + offset), vf)
    )


def _bytes_as_i32(context: Any, builder: Any, sig: Any, args: Any, n: int) -> Any:
    raw = _load_vec(context, builder, sig, args, ir.IntType(8), n)
    return builder.zext(raw, ir.VectorType(_I32, n))  # int32 lanes: numba would widen to int64


def _lane_sum(builder: Any, v: Any, n: int) -> Any:
    """Fixed-order sum of the ``n`` lanes of vector ``v``: fold the halves lane by lane
    (``v[k] + v[k + n/2]``) down to 8 lanes, then ``((v0+v4)+(v2+v6)) + ((v1+v5)+(v3+v7))``.

    Each fold is one vector add of the low half and the high half (a shuffle each), so LLVM
    emits a few shuffles and adds instead of extracting every lane: the same IEEE additions
    in the same order, so the same bits as adding the extracted lanes one by one (a kernel row
    of few groups spent most of its time here: the demo model's experts)."""
    width = n
    while width > 2:
        half = width // 2
        mask = ir.VectorType(_I32, half)
        lo = builder.shuffle_vector(v, v, ir.Constant(mask, list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(mask, [half + k for k in range(half)]))
        v = builder.fadd(lo, hi)  # lanes: v[k] + v[k + half]
        width = half
    # v = [(v0+v4)+(v2+v6), (v1+v5)+(v3+v7)] (for n = 8; the folds above it for n = 16)
    return builder.fadd(
        builder.extract_element(v, ir.Constant(_I32, 0)),
        builder.extract_element(v, ir.Constant(_I32, 1)),
    )


@functools.cache
def host_codegen_features() -> frozenset[str]:
    """The CPU features LLVM may use in the code numba generates here: what decides whether a
    kernel may emit an ISA-specific intrinsic. numba's own choice, which its settings can
    narrow below the host's: ``NUMBA_CPU_FEATURES`` (``+avx2,+fma,...``; empty, the default
    with ``NUMBA_CPU_NAME=generic``, for caches shared between machines) replaces the host's
    features, and ``NUMBA_ENABLE_AVX=0`` drops every ``avx*`` one. An intrinsic the target
    lacks aborted the process in LLVM ("Do not know how to split the result of this
    operator" with ``NUMBA_CPU_NAME=generic`` on an AVX-512 host); the kernels now take
    their portable forms, which give the same bits. Empty when LLVM cannot tell."""
    chosen = getattr(numba_config, "CPU_FEATURES", None)  # set at import from the environment
    if chosen is not None:
        return frozenset(f.strip()[1:] for f in str(chosen).split(",") if f.strip()[:1] == "+")
    try:
        feats = llvm.get_host_cpu_features()
    except RuntimeError:
        return frozenset()
    on = (name for name, enabled in feats.items() if enabled)
    if not getattr(numba_config, "ENABLE_AVX", True):
        on = (name for name in on if not name.startswith("avx"))
    return frozenset(on)


def _has_avx512f_codegen() -> bool:
    return "avx512f" in host_codegen_features()


def _make_i4lo(vt: Any, *, permute: bool) -> Any:
    """The ``i4lo`` intrinsic of ``vt``; with ``permute`` (16 lanes, AVX-512F code) the nibble
    is decoded by one ``vpermps`` lookup instead of and + or + sub: the same floats."""
    n = int(vt.lanes)
    vf, vi = ir.VectorType(_F32, n), ir.VectorType(_I32, n)

    @_intrinsic
    def i4lo(typingctx: Any, arr: Any, idx: Any) -> Any:
        """Low nibbles of bytes ``arr[idx : idx + L]`` as float32 ``lo - 8``."""
        if not _is_array(arr, types.uint8) or not isinstance(idx, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            wide = _bytes_as_i32(context, builder, sig, args, n)
            if permute:
                # vpermps reads only the low 4 bits of each index: table[k] = float(k - 8)
                fnty = ir.FunctionType(vf, [vf, vi])
                fn = builder.module.declare_intrinsic("llvm.x86.avx512.permvar.sf.512", fnty=fnty)
                table = ir.Constant(vf, [float(k - 8) for k in range(16)])
                return builder.call(fn, [table, wide])
            nib = builder.and_(wide, _splat(ir.Constant(_I32, 15), vi))
            return _magic_float(builder, nib, 8.0, n)

        return vt(arr, idx), codegen

    return i4lo


def _make(vt: Any) -> dict[str, Any]:
    """The intrinsics of one vector type ``vt`` (``f32x8`` or ``f32x16``)."""
    n = int(vt.lanes)
    vf, vi = ir.VectorType(_F32, n), ir.VectorType(_I32, n)
    ops: dict[str, Any] = {}

    @_intrinsic
    def vzero(typingctx: Any) -> Any:
        """All lanes +0.0."""

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return ir.Constant(vf, None)

        return vt(), codegen

    @_intrinsic
    def vsplat(typingctx: Any, x: Any) -> Any:
        """Every lane = float32 scalar ``x``."""
        if x != types.float32:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            v = builder.insert_element(ir.Constant(vf, None), args[0], ir.Constant(_I32, 0))
            return builder.shuffle_vector(v, v, ir.Constant(vi, [0] * n))

        return vt(x), codegen

    @_intrinsic
    def vload(typingctx: Any, arr: Any, idx: Any) -> Any:
        """Lanes = ``arr[idx : idx + L]`` of a float32 array."""
        if not _is_array(arr, types.float32) or not isinstance(idx, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return _load_vec(context, builder, sig, args, _F32, n)

        return vt(arr, idx), codegen

    @_intrinsic
    def vstore(typingctx: Any, arr: Any, idx: Any, v: Any) -> Any:
        """``arr[idx : idx + L] = v`` for a float32 array."""
        if not _is_array(arr, types.float32) or not isinstance(idx, types.Integer) or v != vt:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ptr = _vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            builder.store(args[2], builder.bitcast(ptr, vf.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(arr, idx, v), codegen

    @_intrinsic
    def i4byte(typingctx: Any, arr: Any, idx: Any) -> Any:
        """Bytes ``arr[idx : idx + L]`` as float32 ``byte - 136 = 16 * (hi - 8) + (lo - 8)``."""
        if not _is_array(arr, types.uint8) or not isinstance(idx, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return _magic_float(builder, _bytes_as_i32(context, builder, sig, args, n), 136.0, n)

        return vt(arr, idx), codegen

    i4lo = _make_i4lo(vt, permute=n == 16 and _has_avx512f_codegen())

    @_intrinsic
    def u8f(typingctx: Any, arr: Any, idx: Any) -> Any:
        """Bytes ``arr[idx : idx + L]`` as float32 ``byte`` (0..255, exact): one convert."""
        if not _is_array(arr, types.uint8) or not isinstance(idx, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.sitofp(_bytes_as_i32(context, builder, sig, args, n), vf)

        return vt(arr, idx), codegen

    @_intrinsic
    def i8(typingctx: Any, arr: Any, idx: Any) -> Any:
        """Bytes ``arr[idx : idx + L]`` read as two's complement int8 -> float32."""
        if not _is_array(arr, types.uint8) or not isinstance(idx, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.sitofp(_load_vec(context, builder, sig, args, ir.IntType(8), n), vf)

        return vt(arr, idx), codegen

    @_intrinsic
    def vadd(typingctx: Any, a: Any, b: Any) -> Any:
        """Lane-wise ``a + b``."""
        if a != vt or b != vt:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.fadd(args[0], args[1])

        return vt(a, b), codegen

    @_intrinsic
    def vmul(typingctx: Any, a: Any, b: Any) -> Any:
        """Lane-wise ``a * b``."""
        if a != vt or b != vt:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.fmul(args[0], args[1])

        return vt(a, b), codegen

    @_intrinsic
    def vfma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
        """Lane-wise fused ``a * b + c`` (one rounding)."""
        if a != vt or b != vt or c != vt:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            fnty = ir.FunctionType(vf, [vf, vf, vf])
            fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
                builder.module, fnty, f"llvm.fma.v{n}f32"
            )
            return builder.call(fn, list(args))

        return vt(a, b, c), codegen

    @_intrinsic
    def vhsum(typingctx: Any, v: Any) -> Any:
        """Sum of the lanes in a fixed order (see :func:`_lane_sum`)."""
        if v != vt:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return _lane_sum(builder, args[0], n)

        return types.float32(v), codegen

    ops.update(
        vzero=vzero,
        vsplat=vsplat,
        vload=vload,
        vstore=vstore,
        i4byte=i4byte,
        i4lo=i4lo,
        u8f=u8f,
        i8=i8,
        vadd=vadd,
        vmul=vmul,
        vfma=vfma,
        vhsum=vhsum,
    )
    return ops


_V8 = _make(f32x8)
_V16 = _make(f32x16)

vzero, vsplat, vload, vstore = _V8["vzero"], _V8["vsplat"], _V8["vload"], _V8["vstore"]
i4byte8, i4lo8, vadd, vmul = _V8["i4byte"], _V8["i4lo"], _V8["vadd"], _V8["vmul"]
vfma, vhsum, i8x8 = _V8["vfma"], _V8["vhsum"], _V8["i8"]

vzero16, vsplat16, vload16, vstore16 = _V16["vzero"], _V16["vsplat"], _V16["vload"], _V16["vstore"]
i4lo16, vadd16, vmul16 = _V16["i4lo"], _V16["vadd"], _V16["vmul"]
vfma16, vhsum16, i8x16, u8f16 = _V16["vfma"], _V16["vhsum"], _V16["i8"], _V16["u8f"]
#: ``i4lo16`` without ``vpermps`` (tests compare the two bit for bit on an AVX-512 machine).
i4lo16_portable = _make_i4lo(f32x16, permute=False)


def _lane_sums4(builder: Any, vs: list[Any]) -> list[Any]:
    """:func:`_lane_sum` of four 16-lane vectors at once: each fold adds the low and high
    halves of two (then four) vectors packed side by side in one register, so the four sums
    take 15 vector operations instead of 36, and every sum gets the IEEE additions of its own
    :func:`_lane_sum`, in the same order (``v[k] + v[k + 8]``, then ``+ 4``, ``+ 2``, ``+ 1``)."""

    def fold(x: Any, y: Any, lo: list[int], hi: list[int]) -> Any:
        mask = ir.VectorType(_I32, len(lo))
        a = builder.shuffle_vector(x, y, ir.Constant(mask, lo))
        b = builder.shuffle_vector(x, y, ir.Constant(mask, hi))
        return builder.fadd(a, b)

    # 16 -> 8 lanes each, two vectors to a register: [a8 | b8], [c8 | d8]
    lo8 = [*range(8), *range(16, 24)]
    hi8 = [*range(8, 16), *range(24, 32)]
    ab = fold(vs[0], vs[1], lo8, hi8)
    cd = fold(vs[2], vs[3], lo8, hi8)
    # 8 -> 4: [a4 | b4 | c4 | d4]
    u = fold(ab, cd, [g * 8 + k for g in range(4) for k in range(4)],
             [g * 8 + 4 + k for g in range(4) for k in range(4)])  # fmt: skip
    # 4 -> 2: [a2 | b2 | c2 | d2]
    w = fold(u, u, [g * 4 + k for g in range(4) for k in range(2)],
             [g * 4 + 2 + k for g in range(4) for k in range(2)])  # fmt: skip
    # 2 -> 1: [a, b, c, d]
    z = fold(w, w, [0, 2, 4, 6], [1, 3, 5, 7])
    return [builder.extract_element(z, ir.Constant(_I32, k)) for k in range(4)]


@_intrinsic
def vhsum16x4(typingctx: Any, a: Any, b: Any, c: Any, d: Any) -> Any:
    """``(vhsum16(a), vhsum16(b), vhsum16(c), vhsum16(d))``, the same bits, in fewer
    instructions (:func:`_lane_sums4`): four dot products' final sums side by side."""
    if any(v != f32x16 for v in (a, b, c, d)):
        return None
    ret = types.UniTuple(types.float32, 4)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return context.make_tuple(builder, sig.return_type, _lane_sums4(builder, list(args)))

    return ret(a, b, c, d), codegen


# ----------------------------------------------------------------------------- 8-lane decodes


@_intrinsic
def bf16x8(typingctx: Any, arr: Any, idx: Any) -> Any:
    """bfloat16 bits ``arr[idx : idx + 8]`` (uint16) -> float32 (exact)."""
    if not _is_array(arr, types.uint16) or not isinstance(idx, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        raw = _load_vec(context, builder, sig, args, ir.IntType(16), 8)
        v8i = ir.VectorType(_I32, 8)
        wide = builder.shl(builder.zext(raw, v8i), _splat(ir.Constant(_I32, 16), v8i))
        return builder.bitcast(wide, ir.VectorType(_F32, 8))

    return f32x8(arr, idx), codegen


@_intrinsic
def f16x8(typingctx: Any, arr: Any, idx: Any) -> Any:
    """IEEE half bits ``arr[idx : idx + 8]`` (uint16) -> float32 (exact)."""
    if not _is_array(arr, types.uint16) or not isinstance(idx, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        raw = _load_vec(context, builder, sig, args, ir.IntType(16), 8)
        half = builder.bitcast(raw, ir.VectorType(ir.HalfType(), 8))
        return builder.fpext(half, ir.VectorType(_F32, 8))

    return f32x8(arr, idx), codegen

"""An 8-lane float32 vector type for numba kernels, with explicit lane order.

Why: numba leaves LLVM's SLP vectorizer off, and its loop vectorizer refuses float reductions
without fast-math, so a plain ``for`` loop dot product runs scalar (~1 ns/element here). These
intrinsics let a kernel hold ``<8 x float>`` values in registers and say exactly which lane each
product lands in, so the summation order is fixed by the source, not by a vectorizer heuristic:
that is what makes the kernels deterministic and batch-invariant.

Lane ``k`` of a load holds element ``idx + k``. Loads and stores are unchecked and unaligned: the
caller guarantees ``idx + 8 <= arr.size`` (wrappers pad buffers to a multiple of 8 elements).

Every arithmetic op is a single IEEE operation per lane (``vfma`` is a fused multiply-add with one
rounding, which is exactly specified too), so results do not depend on the instruction set.

Shape legend: L = 8 lanes of float32 (one AVX2 register); idx is a flat element index into a C
array.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

__all__ = [
    "F32x8",
    "bf16x8",
    "f16x8",
    "f32x8",
    "i4byte8",
    "i4lo8",
    "i8x8",
    "vadd",
    "vfma",
    "vhsum",
    "vload",
    "vmul",
    "vsplat",
    "vstore",
    "vzero",
]

LANES = 8
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_V8F = ir.VectorType(_F32, LANES)
_V8I32 = ir.VectorType(_I32, LANES)


def _intrinsic(fn: Callable[..., Any]) -> Any:
    """``numba.extending.intrinsic``; typed ``Any`` because kernels call it without typingctx."""
    return intrinsic(fn)


class F32x8(types.Type):
    """numba type of an ``<8 x float>`` register value."""

    def __init__(self) -> None:
        super().__init__(name="f32x8")


f32x8 = F32x8()


@register_model(F32x8)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, _V8F)  # type: ignore[no-untyped-call]


def _splat(value: ir.Constant | ir.Value, vty: ir.VectorType) -> ir.Constant:
    return ir.Constant(vty, [value] * vty.count)


def _vector_ptr(context: Any, builder: Any, arrty: Any, arr: Any, idxty: Any, idx: Any) -> Any:
    """Pointer to ``arr.flat[idx]`` (C-contiguous array, no bounds or wraparound check)."""
    ary = context.make_array(arrty)(context, builder, arr)
    offset = context.cast(builder, idx, idxty, types.intp)
    return builder.gep(ary.data, [offset], inbounds=True)


def _load_vec(context: Any, builder: Any, sig: Any, args: Any, lane_ty: ir.Type) -> Any:
    ptr = _vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
    vptr = builder.bitcast(ptr, ir.VectorType(lane_ty, LANES).as_pointer())
    return builder.load(vptr, align=1)


def _is_array(arr: Any, dtype: Any) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == dtype and arr.layout == "C"


# ----------------------------------------------------------------------------- constructors


@_intrinsic
def vzero(typingctx: Any) -> Any:
    """All lanes +0.0."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return ir.Constant(_V8F, None)

    return f32x8(), codegen


@_intrinsic
def vsplat(typingctx: Any, x: Any) -> Any:
    """Every lane = float32 scalar ``x``."""
    if x != types.float32:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        v = builder.insert_element(ir.Constant(_V8F, None), args[0], ir.Constant(_I32, 0))
        return builder.shuffle_vector(v, v, ir.Constant(_V8I32, [0] * LANES))

    return f32x8(x), codegen


# ----------------------------------------------------------------------------- loads, stores


@_intrinsic
def vload(typingctx: Any, arr: Any, idx: Any) -> Any:
    """Lanes = ``arr[idx : idx + 8]`` of a float32 array."""
    if not _is_array(arr, types.float32) or not isinstance(idx, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return _load_vec(context, builder, sig, args, _F32)

    return f32x8(arr, idx), codegen


@_intrinsic
def vstore(typingctx: Any, arr: Any, idx: Any, v: Any) -> Any:
    """``arr[idx : idx + 8] = v`` for a float32 array."""
    if not _is_array(arr, types.float32) or not isinstance(idx, types.Integer) or v != f32x8:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        builder.store(args[2], builder.bitcast(ptr, _V8F.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(arr, idx, v), codegen


def _magic_float(builder: Any, lanes: Any, offset: float) -> Any:
    # OR-ing an int 0..255 into the mantissa of 2**23 and subtracting 2**23 + offset gives
    # float(int - offset) exactly, cheaper than an int->float convert on this class of CPU.
    biased = builder.or_(lanes, _splat(ir.Constant(_I32, 0x4B000000), _V8I32))
    return builder.fsub(
        builder.bitcast(biased, _V8F), _splat(ir.Constant(_F32, 8388608.0 + offset), _V8F)
    )


def _bytes_as_i32(context: Any, builder: Any, sig: Any, args: Any) -> Any:
    raw = _load_vec(context, builder, sig, args, ir.IntType(8))
    return builder.zext(raw, _V8I32)  # int32 lanes: numba would widen uint8 math to int64


@_intrinsic
def i4byte8(typingctx: Any, arr: Any, idx: Any) -> Any:
    """Bytes ``arr[idx : idx + 8]`` as float32 ``byte - 136 = 16 * (hi - 8) + (lo - 8)``."""
    if not _is_array(arr, types.uint8) or not isinstance(idx, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return _magic_float(builder, _bytes_as_i32(context, builder, sig, args), 136.0)

    return f32x8(arr, idx), codegen


@_intrinsic
def i4lo8(typingctx: Any, arr: Any, idx: Any) -> Any:
    """Low nibbles of bytes ``arr[idx : idx + 8]`` as float32 ``lo - 8``."""
    if not _is_array(arr, types.uint8) or not isinstance(idx, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        wide = _bytes_as_i32(context, builder, sig, args)
        nib = builder.and_(wide, _splat(ir.Constant(_I32, 15), _V8I32))
        return _magic_float(builder, nib, 8.0)

    return f32x8(arr, idx), codegen


@_intrinsic
def i8x8(typingctx: Any, arr: Any, idx: Any) -> Any:
    """Bytes ``arr[idx : idx + 8]`` read as two's complement int8 -> float32."""
    if not _is_array(arr, types.uint8) or not isinstance(idx, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        raw = _load_vec(context, builder, sig, args, ir.IntType(8))
        return builder.sitofp(raw, _V8F)

    return f32x8(arr, idx), codegen


@_intrinsic
def bf16x8(typingctx: Any, arr: Any, idx: Any) -> Any:
    """bfloat16 bits ``arr[idx : idx + 8]`` (uint16) -> float32 (exact)."""
    if not _is_array(arr, types.uint16) or not isinstance(idx, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        raw = _load_vec(context, builder, sig, args, ir.IntType(16))
        wide = builder.shl(builder.zext(raw, _V8I32), _splat(ir.Constant(_I32, 16), _V8I32))
        return builder.bitcast(wide, _V8F)

    return f32x8(arr, idx), codegen


@_intrinsic
def f16x8(typingctx: Any, arr: Any, idx: Any) -> Any:
    """IEEE half bits ``arr[idx : idx + 8]`` (uint16) -> float32 (exact)."""
    if not _is_array(arr, types.uint16) or not isinstance(idx, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        raw = _load_vec(context, builder, sig, args, ir.IntType(16))
        half = builder.bitcast(raw, ir.VectorType(ir.HalfType(), LANES))
        return builder.fpext(half, _V8F)

    return f32x8(arr, idx), codegen


# ----------------------------------------------------------------------------- arithmetic


@_intrinsic
def vadd(typingctx: Any, a: Any, b: Any) -> Any:
    """Lane-wise ``a + b``."""
    if a != f32x8 or b != f32x8:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fadd(args[0], args[1])

    return f32x8(a, b), codegen


@_intrinsic
def vmul(typingctx: Any, a: Any, b: Any) -> Any:
    """Lane-wise ``a * b``."""
    if a != f32x8 or b != f32x8:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fmul(args[0], args[1])

    return f32x8(a, b), codegen


@_intrinsic
def vfma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """Lane-wise fused ``a * b + c`` (one rounding)."""
    if a != f32x8 or b != f32x8 or c != f32x8:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        fnty = ir.FunctionType(_V8F, [_V8F, _V8F, _V8F])
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, fnty, "llvm.fma.v8f32"
        )
        return builder.call(fn, list(args))

    return f32x8(a, b, c), codegen


@_intrinsic
def vhsum(typingctx: Any, v: Any) -> Any:
    """Sum of the 8 lanes in a fixed order: ``((v0+v4)+(v2+v6)) + ((v1+v5)+(v3+v7))``."""
    if v != f32x8:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        lanes = [builder.extract_element(args[0], ir.Constant(_I32, k)) for k in range(LANES)]
        h = [builder.fadd(lanes[k], lanes[k + 4]) for k in range(4)]  # v0+v4, v1+v5, ...
        q0 = builder.fadd(h[0], h[2])
        q1 = builder.fadd(h[1], h[3])
        return builder.fadd(q0, q1)

    return types.float32(v), codegen

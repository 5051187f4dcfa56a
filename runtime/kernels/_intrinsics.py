"""Low-level numba intrinsics the kernels need and numba does not expose.

* :func:`prefetch` — ``llvm.prefetch`` (read, high locality) on ``&arr[idx]``: streaming int4
  weights from DRAM ran ~2x slower without a software prefetch a few KiB ahead (field notes).
  A prefetch never faults, so ``idx`` may run past the end of the array.
* :func:`f16_bits_to_f32` — IEEE half bits (uint16) -> float32 (exact; ``vcvtph2ps`` with F16C).
  numba's CPU target has no float16 type, so f16 weights travel as raw uint16 bits.
* :func:`u32_bits_to_f32` — reinterpret uint32 bits as float32 (bf16 is the top half of an f32).
* :func:`load_acquire` — an atomic (acquire) load of an int64 array element: a loop polling a
  cell another thread writes must read memory on every pass (a plain load may be hoisted out
  of the loop). :func:`store_release`, :func:`fetch_add`, :func:`swap` and
  :func:`compare_swap` are the other atomic operations the job crew (:mod:`.crew`) needs
  (the read-modify-writes are sequentially consistent: full barriers on x86).
* :func:`f32_at`, :func:`u8_at`, :func:`i64_at` — an integer address as a typed pointer for
  ``numba.carray``; :func:`call_at` calls the C function ``void f(int64)`` at an address (a
  numba ``cfunc``).

The first three are pure functions of their inputs; all four are safe in ``nogil`` code.

And one allocation helper, :func:`zeros64`: numba's ``np.zeros`` aligns arrays to 32 bytes only,
and a 64-byte vector load from an address 32 bytes off a cache line touches two lines. The
16-lane int4 GEMV read its activation planes that way in about half of the calls (depending on
the heap), 1.25x slower: 12.6 against 16.2 GB/s in L2 on an AVX-512 Intel guest
(docs/benchmarks.md).

Shape legend: idx: flat element index into a C-contiguous array; u: an unsigned integer holding raw
bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = [
    "call_at",
    "compare_swap",
    "f16_bits_to_f32",
    "f32_at",
    "fetch_add",
    "i8_at",
    "i32_at",
    "i64_at",
    "load_acquire",
    "prefetch",
    "prefetch_l2",
    "store_release",
    "swap",
    "u8_at",
    "u32_bits_to_f32",
    "zeros64",
]

#: alignment of the arrays :func:`zeros64` returns (one cache line, one 512-bit vector)
ALIGN = 64

_I32 = ir.IntType(32)


def _intrinsic(fn: Callable[..., Any]) -> Any:
    """``numba.extending.intrinsic``; typed ``Any`` because kernels call it without typingctx."""
    return intrinsic(fn)


def _bitwidth(numba_int: Any) -> int:
    return int(numba_int.bitwidth)


def _element_ptr(context: Any, builder: Any, signature: Any, args: Any) -> Any:
    """LLVM pointer to ``arr.flat[idx]`` for an intrinsic called as ``(arr, idx, ...)`` (raw
    pointer arithmetic, no bounds check)."""
    ary = context.make_array(signature.args[0])(context, builder, args[0])
    offset = context.cast(builder, args[1], signature.args[1], types.intp)
    return builder.gep(ary.data, [offset])


def _make_prefetch(locality: int, doc: str) -> Any:
    @_intrinsic
    def prefetch(typingctx: Any, arr: Any, idx: Any) -> Any:
        if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
            return None
        sig = types.void(arr, idx)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ptr = _element_ptr(context, builder, signature, args)  # past the end is harmless
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type, _I32, _I32, _I32])
            fn = builder.module.declare_intrinsic("llvm.prefetch", [ptr.type], fnty)
            # rw=0 (read), locality, cache type=1 (data)
            args_ = [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, locality), ir.Constant(_I32, 1)]
            builder.call(fn, args_)
            return context.get_dummy_value()

        return sig, codegen

    prefetch.__doc__ = doc
    return prefetch


#: ``prefetch(arr, idx)``: hint the cache to load the line holding ``arr.flat[idx]`` into every
#: level (``prefetcht0``).
prefetch = _make_prefetch(3, "load the line of arr.flat[idx] into every cache level")
#: ``prefetch_l2(arr, idx)``: the same into L2 and below only (``prefetcht1``), for data read a
#: while later that would crowd L1 meanwhile.
prefetch_l2 = _make_prefetch(2, "load the line of arr.flat[idx] into L2 (not L1)")


@_intrinsic
def f16_bits_to_f32(typingctx: Any, bits: Any) -> Any:
    """``f16_bits_to_f32(u)``: the float32 value of the IEEE binary16 number with bits ``u``."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)
    width = _bitwidth(bits)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        (val,) = args
        i16 = builder.trunc(val, ir.IntType(16)) if width > 16 else val
        half = builder.bitcast(i16, ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return sig, codegen


@_intrinsic
def u32_bits_to_f32(typingctx: Any, bits: Any) -> Any:
    """``u32_bits_to_f32(u)``: reinterpret the low 32 bits of integer ``u`` as a float32."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)
    width = _bitwidth(bits)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        (val,) = args
        if width > 32:
            val = builder.trunc(val, _I32)
        elif width < 32:
            val = builder.zext(val, _I32)
        return builder.bitcast(val, ir.FloatType())

    return sig, codegen


@_intrinsic
def load_acquire(typingctx: Any, arr: Any, idx: Any) -> Any:
    """``load_acquire(arr, idx)``: ``arr.flat[idx]`` of an int64 array, read atomically with
    acquire ordering (no bounds check: ``idx`` must be in range)."""
    if (
        not isinstance(arr, types.Array)
        or arr.dtype != types.int64
        or not isinstance(idx, types.Integer)
    ):
        return None
    sig = types.int64(arr, idx)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = _element_ptr(context, builder, signature, args)
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


def _is_i64_cell(arr: Any, idx: Any) -> bool:
    return (
        isinstance(arr, types.Array) and arr.dtype == types.int64 and isinstance(idx, types.Integer)
    )


@_intrinsic
def store_release(typingctx: Any, arr: Any, idx: Any, val: Any) -> Any:
    """``store_release(arr, idx, v)``: ``arr.flat[idx] = v`` (int64), atomically with release
    ordering: every store before it is visible to a thread that reads ``v`` with
    :func:`load_acquire`."""
    if not _is_i64_cell(arr, idx) or not isinstance(val, types.Integer):
        return None
    sig = types.void(arr, idx, val)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = _element_ptr(context, builder, signature, args)
        v = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(v, ptr, "release", 8)
        return context.get_dummy_value()

    return sig, codegen


def _make_rmw(op: str, doc: str) -> Any:
    @_intrinsic
    def rmw(typingctx: Any, arr: Any, idx: Any, val: Any) -> Any:
        if not _is_i64_cell(arr, idx) or not isinstance(val, types.Integer):
            return None
        sig = types.int64(arr, idx, val)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ptr = _element_ptr(context, builder, signature, args)
            v = context.cast(builder, args[2], signature.args[2], types.int64)
            return builder.atomic_rmw(op, ptr, v, "seq_cst")

        return sig, codegen

    rmw.__doc__ = doc
    return rmw


#: ``fetch_add(arr, idx, v)``: add ``v`` to ``arr.flat[idx]`` atomically; the value before.
fetch_add = _make_rmw("add", "atomic arr.flat[idx] += v; returns the value before")
#: ``swap(arr, idx, v)``: store ``v`` in ``arr.flat[idx]`` atomically; the value before.
swap = _make_rmw("xchg", "atomic arr.flat[idx] = v; returns the value before")


@_intrinsic
def compare_swap(typingctx: Any, arr: Any, idx: Any, old: Any, new: Any) -> Any:
    """``compare_swap(arr, idx, old, new)``: ``arr.flat[idx] = new`` if it holds ``old``,
    atomically; returns the value it held (``old`` when the swap happened)."""
    if (
        not _is_i64_cell(arr, idx)
        or not isinstance(old, types.Integer)
        or not isinstance(new, types.Integer)
    ):
        return None
    sig = types.int64(arr, idx, old, new)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = _element_ptr(context, builder, signature, args)
        o = context.cast(builder, args[2], signature.args[2], types.int64)
        n = context.cast(builder, args[3], signature.args[3], types.int64)
        pair = builder.cmpxchg(ptr, o, n, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return sig, codegen


def _make_ptr(dtype: Any, doc: str) -> Any:
    @_intrinsic
    def at(typingctx: Any, addr: Any) -> Any:
        if not isinstance(addr, types.Integer):
            return None
        ptr = types.CPointer(dtype)  # type: ignore[no-untyped-call]
        sig = ptr(addr)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return sig, codegen

    at.__doc__ = doc
    return at


#: ``f32_at(addr)``: the address ``addr`` (an integer, e.g. ``a.ctypes.data``) as a float32
#: pointer, for ``numba.carray``: a kernel reads arrays of different objects (one KV cache per
#: sequence) through one compiled signature. The caller keeps those arrays alive and large
#: enough for the call.
f32_at = _make_ptr(types.float32, "an integer address as a float32 pointer")
#: ``u8_at(addr)``: the same as a uint8 pointer.
u8_at = _make_ptr(types.uint8, "an integer address as a uint8 pointer")
#: ``i64_at(addr)`` / ``i8_at`` / ``i32_at``: the same as an int64 / int8 / int32 pointer.
i64_at = _make_ptr(types.int64, "an integer address as an int64 pointer")
i8_at = _make_ptr(types.int8, "an integer address as an int8 pointer")
i32_at = _make_ptr(types.int32, "an integer address as an int32 pointer")


@_intrinsic
def call_at(typingctx: Any, fn: Any, arg: Any) -> Any:
    """``call_at(fn, arg)``: call the C function ``void f(int64_t)`` at address ``fn`` (a
    numba ``cfunc``'s ``address``) with ``arg``."""
    if not isinstance(fn, types.Integer) or not isinstance(arg, types.Integer):
        return None
    sig = types.void(fn, arg)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64])
        f = builder.inttoptr(args[0], fnty.as_pointer())
        a = context.cast(builder, args[1], signature.args[1], types.int64)
        builder.call(f, [a])
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True)
def zeros64(n, dtype):  # type: ignore[no-untyped-def]
    """``np.zeros(n, dtype)`` whose first element starts a 64-byte cache line (a view into a
    slightly larger allocation, which it keeps alive). For itemsizes that divide 64."""
    buf = np.zeros(n + ALIGN, dtype)
    off = ((ALIGN - buf.ctypes.data % ALIGN) % ALIGN) // buf.itemsize
    return buf[off : off + n]

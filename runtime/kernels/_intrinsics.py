"""Low-level numba intrinsics the kernels need and numba does not expose.

* :func:`prefetch` — ``llvm.prefetch`` (read, high locality) on ``&arr[idx]``: streaming int4
  weights from DRAM ran ~2x slower without a software prefetch a few KiB ahead (field notes).
  A prefetch never faults, so ``idx`` may run past the end of the array.
* :func:`f16_bits_to_f32` — IEEE half bits (uint16) -> float32 (exact; ``vcvtph2ps`` with F16C).
  numba's CPU target has no float16 type, so f16 weights travel as raw uint16 bits.
* :func:`u32_bits_to_f32` — reinterpret uint32 bits as float32 (bf16 is the top half of an f32).
* :func:`load_acquire` — an atomic (acquire) load of an int64 array element: a loop polling a
  cell another thread writes must read memory on every pass (a plain load may be hoisted out
  of the loop).

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
    "f16_bits_to_f32",
    "load_acquire",
    "prefetch",
    "prefetch_l2",
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


@_intrinsic
def f32_at(typingctx: Any, addr: Any) -> Any:
    """``f32_at(addr)``: the address ``addr`` (an integer, e.g. ``a.ctypes.data``) as a float32
    pointer, for ``numba.carray``: a kernel reads arrays of different objects (one KV cache
    per sequence) through one compiled signature. The caller keeps those arrays alive and
    large enough for the call."""
    if not isinstance(addr, types.Integer):
        return None
    ptr = types.CPointer(types.float32)  # type: ignore[no-untyped-call]
    sig = ptr(addr)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return sig, codegen


@njit(nogil=True, cache=True)
def zeros64(n, dtype):  # type: ignore[no-untyped-def]
    """``np.zeros(n, dtype)`` whose first element starts a 64-byte cache line (a view into a
    slightly larger allocation, which it keeps alive). For itemsizes that divide 64."""
    buf = np.zeros(n + ALIGN, dtype)
    off = ((ALIGN - buf.ctypes.data % ALIGN) % ALIGN) // buf.itemsize
    return buf[off : off + n]

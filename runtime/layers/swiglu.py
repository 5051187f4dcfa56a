"""SwiGLU MLP ``down(silu(gate(x)) * up(x))``: dense layers, shared experts and routed experts.

Shape legend: T tokens, D hidden, F intermediate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from runtime.kernels.quant_matmul import (
    Int4Weight,
    Q8Weight,
    silu_times,
    swiglu_int4,
    swiglu_int4_q8,
)
from runtime.linear import Linear

__all__ = ["MLPWeights", "fused", "fused_q8", "sigmoid", "silu", "swiglu", "swiglu_q8"]

F32Array = npt.NDArray[np.float32]


class MLPWeights(NamedTuple):
    """The three projections of a SwiGLU MLP (a routed expert is one of these)."""

    gate: Linear  # [F, D]
    up: Linear  # [F, D]
    down: Linear  # [D, F]


def sigmoid(x: F32Array) -> F32Array:
    """Logistic function without overflow warnings (tanh form is finite for every input)."""
    half = np.float32(0.5)
    out: F32Array = (half + half * np.tanh(half * x)).astype(np.float32, copy=False)
    return out


def silu(x: F32Array) -> F32Array:
    """``x * sigmoid(x)`` in float32 (the activation :func:`swiglu` applies, same bits)."""
    xx = np.asarray(x, dtype=np.float32)
    flat = xx.reshape(1, -1)
    return silu_times(flat, np.ones_like(flat)).reshape(xx.shape)


MatMul = Callable[[Linear, F32Array], F32Array]


def _call(lin: Linear, x: F32Array) -> F32Array:
    return lin(x)


def fused(w: MLPWeights) -> tuple[Int4Weight, Int4Weight, Int4Weight] | None:
    """The three projections' arguments for the one-call int4 SwiGLU kernel, or None when one
    of them has none (another format)."""
    g, u, d = w.gate.int4, w.up.int4, w.down.int4
    if g is None or u is None or d is None:
        return None
    return g, u, d


def fused_q8(w: MLPWeights) -> tuple[Q8Weight, Q8Weight, Q8Weight] | None:
    """The three projections' arguments for the one-call fast-int8 SwiGLU kernel, or None when
    one of them has no int8-activation kernel."""
    g, u, d = w.gate.q8, w.up.q8, w.down.q8
    if g is None or u is None or d is None:
        return None
    return g, u, d


def swiglu_q8(x: F32Array, f: tuple[Q8Weight, Q8Weight, Q8Weight]) -> F32Array:
    """:func:`swiglu` under ``--kernels fast-int8`` for weights that all have the int8 kernel
    (``f`` = :func:`fused_q8`): one kernel call, the same bits as the projections one by one."""
    return swiglu_int4_q8(np.ascontiguousarray(x, dtype=np.float32), *f)


def swiglu(x: F32Array, w: MLPWeights, mm: MatMul | None = None) -> F32Array:
    """``x`` [T, D] C-contiguous float32 -> [T, D]; ``mm(lin, x)`` applies a projection (the
    compute's thread split or kernel choice). Without ``mm``, int4 weights take one fused
    kernel call (:func:`runtime.kernels.quant_matmul.swiglu_int4`: the same bits as the three
    projections and :func:`silu_times` one by one)."""
    if mm is None:
        f = fused(w)
        if f is not None:
            return swiglu_int4(np.ascontiguousarray(x, dtype=np.float32), *f)
        mm = _call
    h = silu_times(mm(w.gate, x), mm(w.up, x))  # [T, F]
    return mm(w.down, h)  # [T, D]

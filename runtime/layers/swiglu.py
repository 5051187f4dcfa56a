"""SwiGLU MLP ``down(silu(gate(x)) * up(x))``: dense layers, shared experts and routed experts.

Shape legend: T tokens, D hidden, F intermediate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from runtime.linear import Linear

__all__ = ["MLPWeights", "sigmoid", "silu", "swiglu"]

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
    return (x * sigmoid(x)).astype(np.float32, copy=False)


MatMul = Callable[[Linear, F32Array], F32Array]


def _call(lin: Linear, x: F32Array) -> F32Array:
    return lin(x)


def swiglu(x: F32Array, w: MLPWeights, mm: MatMul = _call) -> F32Array:
    """``x`` [T, D] C-contiguous float32 -> [T, D]; ``mm(lin, x)`` applies a projection
    (default ``lin(x)``; the compute's thread split or kernel choice otherwise)."""
    h = silu(mm(w.gate, x)) * mm(w.up, x)  # [T, F]
    return mm(w.down, np.ascontiguousarray(h, dtype=np.float32))  # [T, D]

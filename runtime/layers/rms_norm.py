"""Normalisations, float32 like the reference (which upcasts to fp32 before normalising).

Shape legend: T tokens, D normalised width.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from runtime.kernels.norm import layer_rows, rms_rows
from storage.errors import ModelError

__all__ = ["layer_norm", "layer_norm_numpy", "rms_norm", "rms_norm_numpy"]

F32Array = npt.NDArray[np.float32]


def rms_norm(x: F32Array, weight: F32Array, eps: float, *, check: bool = False) -> F32Array:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis (HF ``*RMSNorm``).

    ``check`` (the model's final norm): raise :class:`ModelError` when a row's sum of squares
    is not finite (a NaN or inf in ``x``, or values past ~1e19 whose squares overflow). The
    reference then normalises to zeros and the logits stay finite, so only this catches
    activations that damaged weights blew up.

    float32 rows run as one numba call (:func:`runtime.kernels.norm.rms_rows`: numpy's float32
    arithmetic, the same bits, without seven array operations' overhead); anything else as
    :func:`rms_norm_numpy`."""
    if (
        x.dtype == np.float32
        and weight.dtype == np.float32
        and x.ndim >= 1
        and weight.shape == x.shape[-1:]
        and x.size
    ):
        rows = x.reshape(-1, x.shape[-1])  # [T, D] (a view where the layout allows)
        out = np.empty(rows.shape, np.float32)
        if not rms_rows(rows, weight, np.float32(eps), out) and check:
            raise ModelError(_OVERFLOW)
        return out.reshape(x.shape)
    return rms_norm_numpy(x, weight, eps, check=check)


def rms_norm_numpy(x: F32Array, weight: F32Array, eps: float, *, check: bool = False) -> F32Array:
    """:func:`rms_norm` by numpy array operations (any dtype and broadcastable weight)."""
    # np.mean's sum and division without its wrapper (~10 us per call on a decode step):
    # the same float32 sum, and one correctly rounded division by the width, so the same bits
    if check:
        with np.errstate(over="ignore", invalid="ignore"):
            ss = np.add.reduce(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
        if not np.isfinite(ss).all():
            raise ModelError(_OVERFLOW)
    else:
        ss = np.add.reduce(np.square(x), axis=-1, keepdims=True, dtype=np.float32)  # [T, 1]
    var = ss / np.float32(x.shape[-1])  # [T, 1]
    inv = np.float32(1.0) / np.sqrt(var + np.float32(eps))  # [T, 1]
    return (weight * (x * inv)).astype(np.float32, copy=False)  # [T, D]


_OVERFLOW = (
    "the model's activations overflowed or became NaN before its final norm: the weights are "
    "probably damaged; check them with `coli doctor --verify` (a mirror's copies: `coli mirror "
    "verify`)"
)


def layer_norm(x: F32Array, weight: F32Array, bias: F32Array, eps: float) -> F32Array:
    """``torch.nn.LayerNorm`` (biased variance) over the last axis: float32 rows as one numba
    call (:func:`runtime.kernels.norm.layer_rows`, the bits of :func:`layer_norm_numpy`),
    anything else as :func:`layer_norm_numpy`."""
    d = x.shape[-1:] if x.ndim else None
    if (
        x.dtype == np.float32
        and weight.dtype == np.float32
        and bias.dtype == np.float32
        and x.ndim >= 1
        and weight.shape == d
        and bias.shape == d
        and x.size
    ):
        rows = x.reshape(-1, x.shape[-1])  # [T, D] (a view where the layout allows)
        out = np.empty(rows.shape, np.float32)
        layer_rows(rows, weight, bias, np.float32(eps), out)
        return out.reshape(x.shape)
    return layer_norm_numpy(x, weight, bias, eps)


def layer_norm_numpy(x: F32Array, weight: F32Array, bias: F32Array, eps: float) -> F32Array:
    """:func:`layer_norm` by numpy array operations (any dtype and broadcastable weights)."""
    mean = np.mean(x, axis=-1, keepdims=True, dtype=np.float32)  # [T, 1]
    xc = x - mean  # [T, D]
    var = np.mean(np.square(xc), axis=-1, keepdims=True, dtype=np.float32)  # [T, 1]
    inv = np.float32(1.0) / np.sqrt(var + np.float32(eps))  # [T, 1]
    return (xc * inv * weight + bias).astype(np.float32, copy=False)  # [T, D]

"""Linear layers over stored weights: ``y = x @ W.T`` for every storage format.

``Linear`` keeps the weight exactly as stored (int4 / int8 bytes + scales, bf16 / f16 bits, f32)
and calls the numba kernel of :mod:`runtime.kernels.quant_matmul` for its format; no dequantized
copy is ever held. The kernels are batch-invariant (row ``t`` of ``y`` does not depend on the
other rows of ``x``), deterministic and release the GIL, so a ``Linear`` may be called from
worker threads (``anyio.to_thread.run_sync``).

``x`` must be 2-D ``[T, I]`` (a single token is ``[1, I]``); it is converted to C-contiguous
float32 if needed (no copy when it already is).

Shape legend: T tokens, I in features (``in_features``), O out features (``out_features``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from runtime.kernels.isa import exact_lanes
from runtime.kernels.quant_matmul import (
    Int4Weight,
    Q8Input,
    Q8Weight,
    int4_weight,
    matmul_bf16,
    matmul_f16,
    matmul_f32,
    matmul_int4,
    matmul_int4_checked,
    matmul_int4_q8,
    matmul_int8,
    q8_chunk_scales,
    q8_eligible,
    q8_weight,
)
from storage.errors import FormatError
from storage.quant import QTensor, QuantFormat

__all__ = ["Linear", "linear_from_array"]

F32Array = npt.NDArray[np.float32]
_MatMul = Callable[[F32Array, F32Array | None], F32Array]
_MatMulQ8 = Callable[[F32Array, F32Array | None, Q8Input | None], F32Array]


def _bind(q: QTensor, lanes: int) -> _MatMul:
    """Check ``q``'s arrays against its format and shape; return ``(x, out) -> y``."""
    o, i = q.shape
    kind = q.fmt.kind
    data = np.asarray(q.data)
    want = q.fmt.weight_nbytes(o, i)
    if data.nbytes != want:
        raise FormatError(
            f"{q.fmt.name} weight [{o}, {i}] needs {want} bytes of data, got {data.nbytes}"
        )
    if kind == "f32":
        if data.dtype != np.float32:
            raise FormatError(f"f32 weight data must be float32, got {data.dtype}")
        # A derived matrix may be a strided view; a contiguous f32 copy is the same format.
        w = np.ascontiguousarray(data).reshape(o, i)  # [O, I]
        return lambda x, out: matmul_f32(x, w, out=out)
    if kind in ("bf16", "f16"):
        if data.dtype.itemsize != 2:
            raise FormatError(f"{kind} weight data must have 2-byte elements, got {data.dtype}")
        bits = np.ascontiguousarray(data).view(np.uint16).reshape(o, i)  # [O, I]
        fn = matmul_bf16 if kind == "bf16" else matmul_f16
        return lambda x, out: fn(x, bits, out=out)
    if q.scales is None:
        raise FormatError(f"{q.fmt.name} weight [{o}, {i}] without scales")
    if not data.flags.c_contiguous:
        raise FormatError(f"{q.fmt.name} weight bytes must be contiguous")
    raw = data.reshape(-1).view(np.uint8)  # [O * row bytes]
    scales = np.ascontiguousarray(q.scales, dtype=np.float32).reshape(-1)  # [O] or [O * G]
    n_scales = q.fmt.n_scales(o, i)
    if scales.size != n_scales:
        raise FormatError(
            f"{q.fmt.name} weight [{o}, {i}] needs {n_scales} scales, got {scales.size}"
        )
    if kind == "int8":
        return lambda x, out: matmul_int8(x, raw, scales, o, i, out=out, lanes=lanes)
    gs = q.fmt.group_size
    try:
        w4 = int4_weight(raw, scales, o, i, gs, lanes)  # checked once, not at every call
    except ValueError:
        w4 = None  # (what is wrong is raised at the call, as before)
    if w4 is not None:
        return lambda x, out: matmul_int4_checked(x, w4, out=out)
    return lambda x, out: matmul_int4(x, raw, scales, o, i, gs, out=out, lanes=lanes)


def _bind_int8(q: QTensor) -> _MatMulQ8 | None:
    """The int8-activation matmul (``--kernels fast-int8``) for ``q``, or None where the format
    or shape has none (that weight then stays on its exact kernel)."""
    o, i = q.shape
    if q.fmt.kind != "int4" or q.scales is None or not q8_eligible(i, q.fmt.group_size):
        return None
    raw = np.asarray(q.data).reshape(-1).view(np.uint8)  # [O * I / 2]
    scales = np.ascontiguousarray(q.scales, dtype=np.float32).reshape(-1)
    per_chunk: list[F32Array] = []  # [O * I / 64], made at the first call (no copy for g64)

    def run(x: F32Array, out: F32Array | None, q8: Q8Input | None = None) -> F32Array:
        if not per_chunk:
            per_chunk.append(q8_chunk_scales(scales, o, i // 64))
        return matmul_int4_q8(x, raw, per_chunk[0], o, i, 64, out=out, q8=q8)

    return run


class Linear:
    """A weight ``[O, I]`` in any storage format. Call with float32 ``x [T, I]`` -> ``[T, O]``.

    ``lanes`` is the int4 and int8 kernels' vector width (8 or 16; default: the CPU's, see
    :func:`runtime.kernels.isa.exact_lanes`). Raises :class:`storage.errors.FormatError` when
    the stored arrays do not match the format.
    """

    def __init__(self, q: QTensor, *, lanes: int | None = None) -> None:
        self.q = q
        self.out_features, self.in_features = q.shape
        self.lanes = exact_lanes() if lanes is None else lanes
        if self.lanes not in (8, 16):
            raise ValueError(f"lanes must be 8 or 16, got {self.lanes}")
        self._matmul = _bind(q, self.lanes)
        self._matmul_int8 = _bind_int8(q)

    @property
    def has_int8(self) -> bool:
        """Whether ``fast_int8=True`` changes this weight's kernel (int4 with whole 64-column
        chunks); other weights always take their exact kernel."""
        return self._matmul_int8 is not None

    @functools.cached_property
    def int4(self) -> Int4Weight | None:
        """This weight's arguments for the fused int4 SwiGLU kernel
        (:func:`runtime.kernels.quant_matmul.swiglu_int4`), or None where it has none (another
        format, or int4 groups that are not a multiple of 16 columns). Made at the first use."""
        q = self.q
        if q.fmt.kind != "int4" or q.scales is None:
            return None
        raw = np.asarray(q.data).reshape(-1).view(np.uint8)
        scales = np.ascontiguousarray(q.scales, dtype=np.float32).reshape(-1)
        o, i = q.shape
        return int4_weight(raw, scales, o, i, q.fmt.group_size, self.lanes)

    @functools.cached_property
    def q8(self) -> Q8Weight | None:
        """This weight's arguments for the one-call fast-int8 SwiGLU kernel
        (:func:`runtime.kernels.quant_matmul.swiglu_int4_q8`), or None where it has none
        (:attr:`has_int8` false). Made at the first use."""
        q = self.q
        if not self.has_int8 or q.scales is None:
            return None
        raw = np.asarray(q.data).reshape(-1).view(np.uint8)
        scales = np.ascontiguousarray(q.scales, dtype=np.float32).reshape(-1)
        o, i = q.shape
        return q8_weight(raw, scales, o, i, q.fmt.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight (data + scales)."""
        return self.q.nbytes

    def __call__(
        self,
        x: npt.NDArray[np.floating],
        *,
        out: F32Array | None = None,
        fast_int8: bool = False,
        q8: Q8Input | None = None,
    ) -> F32Array:
        """``x [T, I] -> x @ W.T [T, O]`` (float32); ``out`` optionally receives the result.

        ``fast_int8``: the opt-in lossy kernel that rounds ``x`` to int8 per 64 columns
        (:func:`runtime.kernels.quant_matmul.matmul_int4_q8`), where this weight has one
        (:attr:`has_int8`); ``q8``: that rounding of ``x``, done once for several weights
        (:func:`runtime.kernels.quant_matmul.q8_input`). Raises ``ValueError`` if ``x`` is not
        2-D with ``I`` columns.
        """
        xx = np.ascontiguousarray(x, dtype=np.float32)  # [T, I]
        if xx.ndim != 2:
            raise ValueError(
                f"Linear expects x of shape [T, {self.in_features}], got {xx.shape} "
                "(use x[None, :] for a single token)"
            )
        if fast_int8 and self._matmul_int8 is not None:
            return self._matmul_int8(xx, out, q8)  # [T, O]
        return self._matmul(xx, out)  # [T, O]

    def split(self, parts: int) -> list[tuple[int, int, Linear]]:
        """The weight cut into ``parts`` ranges of output features ``(start, end, Linear)``
        (views, no copy; cached). Each output feature is computed by the same kernel code from
        the same stored row whichever range holds it, so the ranges' results side by side are
        bit-identical to the whole call."""
        cache: dict[int, list[tuple[int, int, Linear]]] = self.__dict__.setdefault("_splits", {})
        if parts not in cache:
            from runtime.weights import qtensor_rows

            edges = np.linspace(0, self.out_features, parts + 1).astype(int)
            cache[parts] = [
                (int(a), int(b), Linear(qtensor_rows(self.q, int(a), int(b)), lanes=self.lanes))
                for a, b in itertools.pairwise(edges)
                if b > a
            ]
        return cache[parts]

    def __repr__(self) -> str:
        return f"Linear({self.q.fmt.name}, out={self.out_features}, in={self.in_features})"


def linear_from_array(w: npt.NDArray[np.floating]) -> Linear:
    """A :class:`Linear` over a float32 matrix ``w [O, I]`` (copied only if not contiguous f32)."""
    a = np.ascontiguousarray(w, dtype=np.float32)  # [O, I]
    if a.ndim != 2:
        raise ValueError(f"linear_from_array expects a 2-D [O, I] matrix, got shape {a.shape}")
    return Linear(QTensor(QuantFormat("f32"), (a.shape[0], a.shape[1]), a))

"""Typed wrappers: ``y[T, O] = x[T, I] @ W.T`` for every storage format of :mod:`storage.quant`.

Each function checks dtypes, shapes and contiguity (``ValueError`` with a clear message; these
are internal APIs, :class:`runtime.linear.Linear` is the public one), prepares the activations
once per call and runs the serial ``nogil`` kernel of :mod:`._matmul_kernels` for the format.
Results are deterministic and batch-invariant: row ``t`` of ``y`` is bit-identical whatever the
other rows of ``x`` are (see that module for the summation order).

Shape legend: T tokens, I in features, O out features, G scale groups per row, B = ceil(I / 2)
packed bytes per int4 row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from numba import typed

from runtime.kernels._matmul_kernels import (
    _KIND_BF16,
    _KIND_F16,
    _KIND_F32,
    _KIND_I8,
    _col_matmul,
    _i4_generic_matmul,
    _i8_matmul16,
    _i8_matmul16_tiles,
    _pad_rows,
    expert_gather,
    i4_down_part,
    i4_expert,
    i4_matmul,
    i4_moe,
    i4_swiglu,
    i4_swiglu_part,
    silu_mul,
)
from runtime.kernels._matmul_kernels import KERNELS as _EXACT_KERNELS
from runtime.kernels._q8 import KERNELS as _Q8_KERNELS
from runtime.kernels._q8 import _q8_apply, q8_expert, q8_matmul, q8_prep, q8_strides, q8_swiglu

__all__ = [
    "DEFAULT_PREFETCH",
    "INT4_LANES",
    "KERNELS",
    "Int4Layer",
    "Int4Weight",
    "Q8Input",
    "Q8Weight",
    "SplitExpert",
    "edges16",
    "matmul_bf16",
    "matmul_f16",
    "matmul_f32",
    "matmul_int4",
    "matmul_int4_checked",
    "matmul_int4_q8",
    "matmul_int8",
    "q8_chunk_scales",
    "q8_eligible",
    "q8_input",
    "q8_weight",
    "routed_expert_int4",
    "routed_expert_int4_q8",
    "routed_layer_int4",
    "silu_times",
    "swiglu_int4",
    "swiglu_int4_q8",
]

F32Array = npt.NDArray[np.float32]

#: Every compiled kernel, exact and opt-in (tests check they were built with ``nogil=True``).
KERNELS = _EXACT_KERNELS + _Q8_KERNELS

#: Bytes of weights to prefetch ahead of the one being read (4 KiB per the field notes; measured
#: neutral on the benchmark machine, see docs/benchmarks.md). 0 turns the prefetch off.
DEFAULT_PREFETCH = 4096

#: The int4 and int8 kernels' vector widths: 8 lanes (every shape) and 16 (int8: every shape;
#: int4: groups of a multiple of 64 columns that tile the row exactly, other shapes take 8).
INT4_LANES = (8, 16)


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def _check_x(x: object, n_in: int) -> F32Array:
    if not isinstance(x, np.ndarray):
        raise ValueError(f"x must be a numpy array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, I], got shape {x.shape}")
    if x.shape[1] != n_in:
        raise ValueError(f"x has {x.shape[1]} features, the weight expects I={n_in}")
    if not x.flags.c_contiguous:
        raise ValueError("x must be C-contiguous (use np.ascontiguousarray)")
    return x


def _check_out(out: F32Array | None, n_tok: int, n_out: int) -> F32Array:
    if out is None:
        return np.empty((n_tok, n_out), dtype=np.float32)
    if not isinstance(out, np.ndarray) or out.dtype != np.float32:
        raise ValueError("out must be a float32 numpy array")
    if out.shape != (n_tok, n_out) or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous with shape {(n_tok, n_out)}, got {out.shape}")
    return out


def _check_shape(n_out: int, n_in: int) -> None:
    if n_out < 0 or n_in < 1:
        raise ValueError(f"bad weight shape [O={n_out}, I={n_in}]")


def _check_weight(name: str, arr: object, dtype: type, size: int) -> npt.NDArray[Any]:
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise ValueError(f"{name} must be {np.dtype(dtype)}, got {arr.dtype}")
    if arr.size != size:
        raise ValueError(f"{name} has {arr.size} elements, expected {size}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return arr.reshape(-1)


def _check_prefetch(prefetch_distance: int) -> int:
    if prefetch_distance < 0:
        raise ValueError(f"prefetch_distance must be >= 0, got {prefetch_distance}")
    return int(prefetch_distance)


class _Int4Call(NamedTuple):
    """The checked arguments of an int4 matmul call."""

    n_out: int
    n_in: int
    nb: int  # packed bytes per row
    p: npt.NDArray[np.uint8]  # [O * B]
    s: F32Array  # [O * S]
    s_row: int  # scales per row
    s_step: int  # scale index step per group (0: per-row scales)
    gbytes: int  # packed bytes per group (32 for per-row: 64-column virtual groups)
    gs: int  # group size (0: per row)
    x: F32Array  # [T, I]
    y: F32Array  # [T, O]
    pf: int

    def walk(self, lanes: int) -> tuple[int, int, int, int, int, int, int]:
        """How ``i4_matmul`` / ``i4_swiglu`` walk this weight (see :class:`Int4Weight`)."""
        wide = int(int4_lanes(self.n_in, self.gs or None, lanes) == 16)
        return (self.n_out, self.n_in, self.nb, self.gbytes, self.s_row, self.s_step, wide)


def int4_scale_walk(n_in: int, group_size: int | None) -> tuple[int, int, int]:
    """How the int4 kernels walk the scales of a row of ``n_in`` columns: (scales per row,
    scale index step per group (0: one scale per row), packed bytes per group). Per-row scales
    walk 64-column virtual groups."""
    if group_size is None:
        return 1, 0, 32
    return (n_in + group_size - 1) // group_size, 1, group_size // 2


def _int4_call(
    x: object,
    packed: object,
    scales: object,
    out_features: int,
    in_features: int,
    group_size: int | None,
    out: F32Array | None,
    prefetch_distance: int,
) -> _Int4Call:
    n_out, n_in = int(out_features), int(in_features)
    _check_shape(n_out, n_in)
    nb = (n_in + 1) // 2
    p = _check_weight("packed", packed, np.uint8, n_out * nb)
    gs = 0 if group_size is None else int(group_size)
    if group_size is not None and gs < 1:
        raise ValueError(f"group_size must be positive, got {gs}")
    s_row, s_step, gbytes = int4_scale_walk(n_in, group_size)
    s = _check_weight("scales", scales, np.float32, n_out * s_row)
    xx = _check_x(x, n_in)
    y = _check_out(out, xx.shape[0], n_out)
    pf = _check_prefetch(prefetch_distance)
    return _Int4Call(n_out, n_in, nb, p, s, s_row, s_step, gbytes, gs, xx, y, pf)


def matmul_int4(
    x: F32Array,
    packed: npt.NDArray[np.uint8],
    scales: F32Array,
    out_features: int,
    in_features: int,
    group_size: int | None,
    *,
    out: F32Array | None = None,
    prefetch_distance: int = DEFAULT_PREFETCH,
    lanes: int = 8,
) -> F32Array:
    """``x [T, I] @ W.T -> [T, O]`` for int4 ``W`` (per row if ``group_size`` is None).

    ``packed`` uint8 [O * ceil(I/2)] (or [O, ceil(I/2)]); ``scales`` float32 [O] or [O * G].
    ``lanes`` picks the kernel's vector width (:data:`INT4_LANES`); the two widths sum in a
    different order, so their results differ in the last bits, each deterministic and
    batch-invariant. :func:`int4_lanes` says which width a weight shape actually gets.
    Raises ``ValueError`` on a dtype, shape or contiguity mismatch.
    """
    if lanes not in INT4_LANES:
        raise ValueError(f"lanes must be one of {INT4_LANES}, got {lanes}")
    a = _int4_call(x, packed, scales, out_features, in_features, group_size, out, prefetch_distance)
    n_out, n_in, nb, p, s, xx, y, pf, gs = a.n_out, a.n_in, a.nb, a.p, a.s, a.x, a.y, a.pf, a.gs
    n_tok = xx.shape[0]
    if n_tok == 0 or n_out == 0:
        return y
    if gs and gs % 16 != 0:  # groups end mid-byte or mid-block: the exact slow path
        ip = _round8(n_in)
        _i4_generic_matmul(p, s, n_out, n_in, nb, gs, _pad_rows(xx, ip), ip, y)
        return y
    i4_matmul(xx, p, s, a.walk(lanes), y, pf)
    return y


class Int4Weight(NamedTuple):
    """An int4 weight checked once for :func:`swiglu_int4`: its arrays and how the kernels walk
    it, ``walk`` = (O, I, packed bytes per row, packed bytes per group, scales per row, scale
    index step per group, 1 for the 16-lane kernel else 0)."""

    packed: npt.NDArray[np.uint8]  # [O * B]
    scales: F32Array  # [O * S]
    walk: tuple[int, int, int, int, int, int, int]


def int4_weight(
    packed: npt.NDArray[np.uint8],
    scales: F32Array,
    out_features: int,
    in_features: int,
    group_size: int | None,
    lanes: int,
) -> Int4Weight | None:
    """The weight's arguments for :func:`swiglu_int4`, checked as :func:`matmul_int4` checks
    them; None for groups that are not a multiple of 16 columns (their slow exact path)."""
    if lanes not in INT4_LANES:
        raise ValueError(f"lanes must be one of {INT4_LANES}, got {lanes}")
    x0 = np.empty((0, int(in_features)), np.float32)
    a = _int4_call(x0, packed, scales, out_features, in_features, group_size, None, 0)
    if (a.gs and a.gs % 16 != 0) or a.n_out == 0:
        return None
    return Int4Weight(a.p, a.s, a.walk(lanes))


def matmul_int4_checked(
    x: F32Array,
    w: Int4Weight,
    *,
    out: F32Array | None = None,
    prefetch_distance: int = DEFAULT_PREFETCH,
) -> F32Array:
    """:func:`matmul_int4` for a weight checked once (:func:`int4_weight`): per call only ``x``
    and ``out`` are checked (the weight's checks cost ~5 us a call, ~30 calls a decode step),
    then the same kernel on the same walk, so the same bits."""
    xx = _check_x(x, w.walk[1])
    y = _check_out(out, xx.shape[0], w.walk[0])
    pf = _check_prefetch(prefetch_distance)
    if xx.shape[0]:
        i4_matmul(xx, w.packed, w.scales, w.walk, y, pf)
    return y


def _check_mlp(who: str, gate: Int4Weight, up: Int4Weight, down: Int4Weight) -> int:
    """D, after checking that the projections are [F, D], [F, D], [D, F]."""
    n_f, n_d = gate.walk[0], gate.walk[1]
    if up.walk[:2] != (n_f, n_d) or down.walk[:2] != (n_d, n_f):
        raise ValueError(
            f"{who}: gate {gate.walk[:2]}, up {up.walk[:2]} and down {down.walk[:2]} "
            "are not [F, D], [F, D], [D, F]"
        )
    return n_d


def silu_times(g: F32Array, u: F32Array) -> F32Array:
    """``silu(g) * u`` [T, F] (float32, elementwise: ``(g * (0.5 + 0.5 tanh(g / 2))) * u``),
    the one SwiGLU activation every path uses, fused or not."""
    gg = np.ascontiguousarray(g, dtype=np.float32)
    uu = np.ascontiguousarray(u, dtype=np.float32)
    if gg.ndim != 2 or gg.shape != uu.shape:
        raise ValueError(f"silu_times needs two [T, F] arrays, got {gg.shape} and {uu.shape}")
    out = np.empty_like(gg)
    silu_mul(gg, uu, out)
    return out


def swiglu_int4(
    x: F32Array,
    gate: Int4Weight,
    up: Int4Weight,
    down: Int4Weight,
    *,
    prefetch_distance: int = DEFAULT_PREFETCH,
) -> F32Array:
    """``down(silu(gate(x)) * up(x))`` [T, D] for int4 weights in one kernel call,
    bit-identical to ``matmul_int4`` three times and :func:`silu_times` (same kernels, same
    order), without the Python between the calls. Raises ``ValueError`` on a shape mismatch."""
    n_d = _check_mlp("swiglu_int4", gate, up, down)
    xx = _check_x(x, n_d)
    pf = _check_prefetch(prefetch_distance)
    out = np.empty((xx.shape[0], n_d), np.float32)
    if xx.shape[0]:
        i4_swiglu(xx, *gate, *up, *down, out, pf)
    return out


def routed_expert_int4(
    x: F32Array,
    ids: npt.NDArray[np.int64],
    gates: F32Array,
    e: int,
    gate: Int4Weight,
    up: Int4Weight,
    down: Int4Weight,
    *,
    prefetch_distance: int = DEFAULT_PREFETCH,
) -> tuple[npt.NDArray[np.intp], F32Array]:
    """Routed expert ``e`` applied to the rows of ``x`` [T, D] that ``ids`` [T, K] route to
    it: (rows [n] ascending, their gate-weighted outputs [n, D]), in one kernel call. The same
    bits as ``np.nonzero(ids == e)``, the gather, :func:`swiglu_int4` and the product with
    ``gates`` [T, K] one by one. Raises ``ValueError`` on a shape or dtype mismatch."""
    xx, ids, gates, pf = _check_expert(
        "routed_expert_int4", x, ids, gates, gate, up, down, prefetch_distance
    )
    rows, out = i4_expert(xx, ids, gates, int(e), *gate, *up, *down, pf)
    return rows, out


class Int4Layer:
    """A MoE layer's routed int4 experts as the tables of :func:`routed_layer_int4`: each
    projection's packed bytes and scales per expert id (numba typed lists, made once) and the
    walks every expert shares. Build with :meth:`build`."""

    __slots__ = ("_lists", "n_experts", "walks")

    def __init__(self, n_experts: int, walks: tuple[Any, Any, Any], lists: tuple[Any, ...]):
        self.n_experts = n_experts
        self.walks = walks
        self._lists = lists

    @classmethod
    def build(
        cls, experts: Sequence[tuple[Int4Weight, Int4Weight, Int4Weight] | None]
    ) -> Int4Layer | None:
        """Tables for experts ``0 .. len(experts) - 1`` (each the ``fused`` arguments of one
        expert), or None when one has none or their shapes or scale layouts differ (each
        expert then runs on its own)."""
        if not experts or experts[0] is None:
            return None
        walks = tuple(w.walk for w in experts[0])
        _check_mlp("Int4Layer", *experts[0])
        lists = tuple(typed.List() for _ in range(6))
        for f in experts:
            if f is None or tuple(w.walk for w in f) != walks:
                return None
            for k, w in enumerate(f):
                lists[2 * k].append(w.packed)
                lists[2 * k + 1].append(w.scales)
        return cls(len(experts), walks, lists)  # type: ignore[arg-type]

    @property
    def hidden_size(self) -> int:
        return int(self.walks[2][0])


def routed_layer_int4(
    x: F32Array,
    ids: npt.NDArray[np.int64],
    gates: F32Array,
    layer: Int4Layer,
    *,
    prefetch_distance: int = DEFAULT_PREFETCH,
) -> F32Array:
    """The routed experts of a MoE layer on rows ``x`` [T, D] (``ids`` / ``gates`` [T, K]) in
    one kernel call: [T, D], the bits of :func:`routed_expert_int4` for every routed expert
    summed per row in ascending expert id from zeros (``runtime.layers.moe.combine``).
    Raises ``ValueError`` on a shape mismatch or an expert id outside the layer."""
    xx = _check_x(x, layer.hidden_size)
    _check_routing(ids, gates, xx.shape[0])
    pf = _check_prefetch(prefetch_distance)
    es = np.unique(ids)  # [U] ascending
    if es.size and (es[0] < 0 or es[-1] >= layer.n_experts):
        raise ValueError(f"expert ids must be in 0..{layer.n_experts - 1}, got {es[0]}..{es[-1]}")
    gp, gs, up, us, dp, ds = layer._lists
    gw, uw, dw = layer.walks
    out: F32Array = i4_moe(
        xx, np.ascontiguousarray(ids), np.ascontiguousarray(gates), es,
        gp, gs, gw, up, us, uw, dp, ds, dw, pf,
    )  # fmt: skip
    return out


def _check_expert(
    who: str,
    x: object,
    ids: object,
    gates: object,
    gate: Int4Weight,
    up: Int4Weight,
    down: Int4Weight,
    prefetch_distance: int,
) -> tuple[F32Array, npt.NDArray[np.int64], F32Array, int]:
    """A routed int4 expert call's arguments checked (``_check_mlp``, ``_check_x``,
    ``_check_routing``, ``_check_prefetch``): ``x``, ``ids`` and ``gates`` contiguous, and the
    prefetch distance."""
    n_d = _check_mlp(who, gate, up, down)
    xx = _check_x(x, n_d)
    _check_routing(ids, gates, xx.shape[0])
    pf = _check_prefetch(prefetch_distance)
    return xx, np.ascontiguousarray(ids), np.ascontiguousarray(gates), pf


class SplitExpert:
    """Routed expert ``e`` (int4, as :func:`routed_expert_int4` takes it) in parts that threads
    can share: every :meth:`h_part` (ranges of the SwiGLU activation's features) must finish
    before any :meth:`out_part` (ranges of the output features) starts; then :meth:`result` is
    what :func:`routed_expert_int4` returns, bit for bit (each feature is computed by the same
    kernel code from the same prepared rows, ranges start at multiples of 16 columns).
    ``parts``: ranges per phase (fewer when a projection is narrow). Raises ``ValueError`` as
    :func:`routed_expert_int4` does, and when no row routes to ``e``."""

    def __init__(
        self,
        x: F32Array,
        ids: npt.NDArray[np.int64],
        gates: F32Array,
        e: int,
        gate: Int4Weight,
        up: Int4Weight,
        down: Int4Weight,
        parts: int,
        *,
        prefetch_distance: int = DEFAULT_PREFETCH,
    ) -> None:
        xx, ids, gates, self._pf = _check_expert(
            "SplitExpert", x, ids, gates, gate, up, down, prefetch_distance
        )
        rows, g, xe = expert_gather(xx, ids, gates, e)
        if rows.shape[0] == 0:
            raise ValueError(f"no row routes to expert {e}")
        self.rows: npt.NDArray[np.intp] = rows
        self._g, self._xe = g, xe
        self._w = (gate, up, down)
        n_f, n_d = gate.walk[0], down.walk[0]
        self.f_edges = edges16(n_f, parts)  # feature ranges of h
        self.d_edges = edges16(n_d, parts)  # output feature ranges
        self.h = np.empty((rows.shape[0], n_f), np.float32)  # [n, F]
        self.out = np.empty((rows.shape[0], n_d), np.float32)  # [n, D]

    def h_part(self, i: int) -> None:
        """Features ``f_edges[i]:f_edges[i + 1]`` of the activation ``silu(gate(x)) * up(x)``."""
        gate, up, _ = self._w
        a, b = self.f_edges[i], self.f_edges[i + 1]
        i4_swiglu_part(self._xe, *gate, *up, a, b, self.h, self._pf)

    def out_part(self, i: int) -> None:
        """Output features ``d_edges[i]:d_edges[i + 1]``, gate-weighted (every :meth:`h_part`
        done)."""
        c, d = self.d_edges[i], self.d_edges[i + 1]
        i4_down_part(self.h, *self._w[2], c, d, self._g, self.out, self._pf)

    def result(self) -> tuple[npt.NDArray[np.intp], F32Array]:
        return self.rows, self.out


def edges16(n: int, parts: int, step: int = 16) -> list[int]:
    """``[0, ..., n]``: ``parts`` near-equal ranges of ``n`` whose inner edges are multiples of
    ``step`` (16; 64 for the fast-int8 kernels' column groups; empty ranges dropped)."""
    edges = [0]
    for i in range(1, max(1, parts)):
        cut = round(n * i / parts / step) * step
        if edges[-1] < cut < n:
            edges.append(cut)
    edges.append(n)
    return edges


def _check_routing(ids: object, gates: object, n_tok: int) -> None:
    """``ids`` int64 [T, K] and ``gates`` float32 of the same shape, for ``n_tok`` rows."""
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 2:
        raise ValueError("ids must be an int64 array [T, K]")
    if not isinstance(gates, np.ndarray) or gates.dtype != np.float32 or gates.shape != ids.shape:
        raise ValueError(f"gates must be float32 with the shape of ids {ids.shape}")
    if ids.shape[0] != n_tok:
        raise ValueError(f"ids has {ids.shape[0]} rows, x has {n_tok}")


def q8_eligible(in_features: int, group_size: int | None) -> bool:
    """Whether an int4 weight can take the int8-activation kernel: whole 64-column chunks that
    tile the row, each inside one scale group (per-row scales, or groups of a multiple of 64)."""
    if in_features < 64 or in_features % 64:
        return False
    return group_size is None or (group_size % 64 == 0 and in_features % group_size == 0)


def q8_chunk_scales(scales: F32Array, n_out: int, n_chunks: int) -> F32Array:
    """Scales [O * S] (S per row: one, or one per group of a multiple of 64 columns) -> one per
    64-column chunk [O * G], the int8 kernels' layout (no copy for int4-g64)."""
    s_row = scales.size // max(n_out, 1)
    if n_out == 0 or s_row == n_chunks:
        return scales
    per = scales.reshape(n_out, s_row)  # [O, S]
    return np.ascontiguousarray(np.repeat(per, n_chunks // s_row, axis=1)).reshape(-1)


def matmul_int4_q8(
    x: F32Array,
    packed: npt.NDArray[np.uint8],
    scales: F32Array,
    out_features: int,
    in_features: int,
    group_size: int | None,
    *,
    out: F32Array | None = None,
    prefetch_distance: int = DEFAULT_PREFETCH,
    q8: Q8Input | None = None,
) -> F32Array:
    """``x [T, I] @ W.T -> [T, O]`` for int4 ``W`` with ``x`` rounded to two int8 digits
    (16-bit fixed point) per 64-column group: the opt-in lossy kernel (``--kernels
    fast-int8``, :mod:`._q8`). Deterministic and batch-invariant like the exact kernels, and
    the same bits on every x86-64 CPU, but not equal to them: the activations lose precision.
    Only for :func:`q8_eligible` shapes (``ValueError`` otherwise). ``q8``: ``x`` already
    rounded by :func:`q8_input` (the same result, without rounding it again)."""
    if not q8_eligible(int(in_features), group_size):
        raise ValueError(
            f"the int8-activation kernel needs I a multiple of 64 and groups of a multiple of 64 "
            f"tiling the row, got I={in_features}, group_size={group_size}"
        )
    a = _int4_call(x, packed, scales, out_features, in_features, group_size, out, prefetch_distance)
    n_out, n_in, p, xx, y, pf = a.n_out, a.n_in, a.p, a.x, a.y, a.pf
    s = q8_chunk_scales(a.s, n_out, n_in // 64)
    if xx.shape[0] == 0 or n_out == 0:
        return y
    if q8 is None:
        q8_matmul(xx, p, s, y, pf)
    elif q8.x.shape != xx.shape:
        raise ValueError(f"q8 was rounded from x of shape {q8.x.shape}, not {xx.shape}")
    else:
        _q8_apply(q8.xq, q8.bias, q8.sx, q8.xstride, q8.bstride, p, s, n_out, y, pf)
    return y


class Q8Weight(NamedTuple):
    """An int4 weight checked once for the one-call fast-int8 SwiGLU (:func:`swiglu_int4_q8`):
    packed bytes [O * I / 2], one scale per 64-column chunk [O * I / 64], O and I."""

    packed: npt.NDArray[np.uint8]
    scales: F32Array
    n_out: int
    n_in: int


def q8_weight(
    packed: npt.NDArray[np.uint8],
    scales: F32Array,
    out_features: int,
    in_features: int,
    group_size: int | None,
) -> Q8Weight | None:
    """The weight's arguments for :func:`swiglu_int4_q8`, checked as :func:`matmul_int4_q8`
    checks them; None where the int8-activation kernel does not apply (:func:`q8_eligible`)."""
    if not q8_eligible(int(in_features), group_size):
        return None
    x0 = np.empty((0, int(in_features)), np.float32)
    a = _int4_call(x0, packed, scales, out_features, in_features, group_size, None, 0)
    if a.n_out == 0:
        return None
    return Q8Weight(a.p, q8_chunk_scales(a.s, a.n_out, a.n_in // 64), a.n_out, a.n_in)


def _check_mlp_q8(who: str, gate: Q8Weight, up: Q8Weight, down: Q8Weight) -> int:
    """D, after checking that the projections are [F, D], [F, D], [D, F]."""
    n_f, n_d = gate.n_out, gate.n_in
    if (up.n_out, up.n_in) != (n_f, n_d) or (down.n_out, down.n_in) != (n_d, n_f):
        raise ValueError(
            f"{who}: gate {gate[2:]}, up {up[2:]} and down {down[2:]} are not [F, D], [F, D], "
            "[D, F]"
        )
    return n_d


def swiglu_int4_q8(
    x: F32Array,
    gate: Q8Weight,
    up: Q8Weight,
    down: Q8Weight,
    *,
    prefetch_distance: int = DEFAULT_PREFETCH,
) -> F32Array:
    """``down(silu(gate(x)) * up(x))`` [T, D] under ``--kernels fast-int8`` in one kernel call:
    bit-identical to :func:`matmul_int4_q8` for gate and up (``x`` rounded once), then
    :func:`silu_times`, then :func:`matmul_int4_q8` for down. Raises ``ValueError`` on a shape
    mismatch."""
    n_d = _check_mlp_q8("swiglu_int4_q8", gate, up, down)
    xx = _check_x(x, n_d)
    pf = _check_prefetch(prefetch_distance)
    out = np.empty((xx.shape[0], n_d), np.float32)
    if xx.shape[0]:
        q8_swiglu(xx, *gate[:2], *up[:2], *down[:2], out, pf)
    return out


def routed_expert_int4_q8(
    x: F32Array,
    ids: npt.NDArray[np.int64],
    gates: F32Array,
    e: int,
    gate: Q8Weight,
    up: Q8Weight,
    down: Q8Weight,
    *,
    prefetch_distance: int = DEFAULT_PREFETCH,
) -> tuple[npt.NDArray[np.intp], F32Array]:
    """:func:`routed_expert_int4` under ``--kernels fast-int8``: the rows of ``x`` routed to
    expert ``e``, ascending, and their gate-weighted :func:`swiglu_int4_q8` outputs, in one
    kernel call (the same bits as the steps one by one)."""
    n_d = _check_mlp_q8("routed_expert_int4_q8", gate, up, down)
    xx = _check_x(x, n_d)
    _check_routing(ids, gates, xx.shape[0])
    pf = _check_prefetch(prefetch_distance)
    rows, out = q8_expert(
        xx, np.ascontiguousarray(ids), np.ascontiguousarray(gates), int(e),
        *gate[:2], *up[:2], *down[:2], pf,
    )  # fmt: skip
    return rows, out


@dataclass(frozen=True)
class Q8Input:
    """Activations ``x [T, I]`` rounded once for the int8-activation kernels (two int8 digits
    and a bias per 64 columns per token, :func:`q8_input`), so several weights applied to the
    same ``x`` (an MLP's gate and up, the output ranges of a split matmul) round it once."""

    x: F32Array  # [T, I]
    xq: npt.NDArray[np.int8]  # [T * xstride]
    bias: npt.NDArray[np.int32]  # [T * bstride]
    sx: F32Array  # [T * I / 64]
    xstride: int
    bstride: int


def q8_input(x: npt.NDArray[np.floating]) -> Q8Input:
    """``x [T, I]`` (I a multiple of 64) rounded for :func:`matmul_int4_q8`."""
    xx = np.ascontiguousarray(x, dtype=np.float32)
    if xx.ndim != 2 or xx.shape[1] % 64:
        raise ValueError(f"q8_input needs x [T, I] with I a multiple of 64, got {xx.shape}")
    n_tok, n_in = xx.shape
    n_chunks = n_in // 64
    xstride, bstride = q8_strides(n_in)
    xq = np.empty(n_tok * xstride, np.int8)
    bias = np.empty(n_tok * bstride, np.int32)
    sx = np.empty(n_tok * n_chunks, np.float32)  # [T * G]
    if n_tok:
        q8_prep(xx, xq, bias, sx, xstride, bstride)
    return Q8Input(xx, xq, bias, sx, xstride, bstride)


def int4_lanes(in_features: int, group_size: int | None, lanes: int) -> int:
    """The vector width an int4 weight of ``in_features`` columns gets when ``lanes`` is asked:
    16 only where every group is a whole number of 64-column chunks and the groups tile the row
    (per-row scales count as 64-column groups), else 8."""
    if lanes != 16:
        return 8
    nb = (in_features + 1) // 2
    gbytes = 32 if group_size is None else group_size // 2
    if gbytes == 0 or gbytes % 32 or nb % gbytes:
        return 8
    return 16


def _matmul_cols(
    kind: int,
    x: F32Array,
    w: npt.NDArray[Any],
    scales: F32Array,
    n_out: int,
    n_in: int,
    out: F32Array | None,
    prefetch_distance: int,
) -> F32Array:
    xx = _check_x(x, n_in)
    n_tok = xx.shape[0]
    y = _check_out(out, n_tok, n_out)
    pf_bytes = _check_prefetch(prefetch_distance)
    if n_tok == 0 or n_out == 0:
        return y
    ip = _round8(n_in)
    _col_matmul(w, scales, n_out, n_in, kind, _pad_rows(xx, ip), ip, y, pf_bytes // w.itemsize)
    return y


def matmul_f32(
    x: F32Array,
    w: F32Array,
    *,
    out: F32Array | None = None,
    prefetch_distance: int = DEFAULT_PREFETCH,
) -> F32Array:
    """``x [T, I] @ w.T -> [T, O]`` for float32 ``w [O, I]`` (batch-invariant, unlike BLAS)."""
    if not isinstance(w, np.ndarray) or w.ndim != 2:
        raise ValueError("w must be a 2-D numpy array [O, I]")
    n_out, n_in = w.shape
    _check_shape(n_out, n_in)
    ww = _check_weight("w", w, np.float32, n_out * n_in)
    return _matmul_cols(
        _KIND_F32, x, ww, np.ones(1, np.float32), n_out, n_in, out, prefetch_distance
    )


def _matmul_u16(
    kind: int,
    x: F32Array,
    bits: npt.NDArray[np.uint16],
    out: F32Array | None,
    prefetch_distance: int,
) -> F32Array:
    if not isinstance(bits, np.ndarray) or bits.ndim != 2:
        raise ValueError("bits must be a 2-D numpy array [O, I] of uint16")
    n_out, n_in = bits.shape
    _check_shape(n_out, n_in)
    ww = _check_weight("bits", bits, np.uint16, n_out * n_in)
    return _matmul_cols(kind, x, ww, np.ones(1, np.float32), n_out, n_in, out, prefetch_distance)


def matmul_bf16(
    x: F32Array,
    bits: npt.NDArray[np.uint16],
    *,
    out: F32Array | None = None,
    prefetch_distance: int = DEFAULT_PREFETCH,
) -> F32Array:
    """``x [T, I] @ W.T -> [T, O]`` for bfloat16 ``W`` given as raw uint16 bits [O, I]."""
    return _matmul_u16(_KIND_BF16, x, bits, out, prefetch_distance)


def matmul_f16(
    x: F32Array,
    bits: npt.NDArray[np.uint16],
    *,
    out: F32Array | None = None,
    prefetch_distance: int = DEFAULT_PREFETCH,
) -> F32Array:
    """``x [T, I] @ W.T -> [T, O]`` for IEEE half ``W`` given as raw uint16 bits [O, I]."""
    return _matmul_u16(_KIND_F16, x, bits, out, prefetch_distance)


def matmul_int8(
    x: F32Array,
    data: npt.NDArray[np.uint8],
    scales: F32Array,
    out_features: int,
    in_features: int,
    *,
    out: F32Array | None = None,
    prefetch_distance: int = DEFAULT_PREFETCH,
    lanes: int = 8,
) -> F32Array:
    """``x [T, I] @ W.T -> [T, O]`` for int8 ``W``: two's complement bytes [O * I], scales [O].

    ``lanes`` 8 or 16: the vector width (each deterministic and batch-invariant; the two sum
    in different orders)."""
    if lanes not in INT4_LANES:
        raise ValueError(f"lanes must be one of {INT4_LANES}, got {lanes}")
    n_out, n_in = int(out_features), int(in_features)
    _check_shape(n_out, n_in)
    ww = _check_weight("data", data, np.uint8, n_out * n_in)
    s = _check_weight("scales", scales, np.float32, n_out)
    if lanes == 8:
        return _matmul_cols(_KIND_I8, x, ww, s, n_out, n_in, out, prefetch_distance)
    xx = _check_x(x, n_in)
    n_tok = xx.shape[0]
    y = _check_out(out, n_tok, n_out)
    pf = _check_prefetch(prefetch_distance)
    if n_tok == 0 or n_out == 0:
        return y
    ip = (n_in + 15) // 16 * 16
    xp = _pad_rows(xx, ip)
    if n_tok == 1:
        _i8_matmul16(ww, s, n_out, n_in, xp, y, pf)
    else:
        _i8_matmul16_tiles(ww, s, n_out, n_in, xp, ip, y, pf)
    return y

"""Mixture-of-experts block in separate steps a scheduler can interleave with expert reads.

``route`` -> ``union`` (fetch each expert once per step) -> ``apply_experts`` + ``shared``.
Routed contributions are summed in ascending expert id (as transformers' loop does), then the
shared experts are added: ``out = sum_e w_e * expert_e(x) + shared(x)``. A row's result does not
depend on the other rows of the step (given batch-invariant Linear kernels).

Shape legend: T tokens, D hidden, E routed experts, K experts per token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from runtime.layers.moe_router import RouterConfig
from runtime.layers.moe_router import route as _route
from runtime.layers.swiglu import MLPWeights, swiglu
from runtime.linear import Linear
from storage.errors import ModelError

__all__ = ["MoEWeights", "apply_experts", "combine", "expert_output", "route", "shared", "union"]

F32Array = npt.NDArray[np.float32]
I64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class MoEWeights:
    """Resident part of a MoE layer: router (fp32 [E, D]), correction bias, shared experts."""

    router: Linear  # [E, D]
    correction_bias: F32Array  # [E]
    shared: MLPWeights | None
    config: RouterConfig


def route(
    w: MoEWeights, x: F32Array, logits_of: Callable[[Linear, F32Array], F32Array] | None = None
) -> tuple[I64Array, F32Array]:
    """``x`` [T, D] (post-attention normed) -> (ids [T, K], gate weights [T, K]).
    ``logits_of(router, x)``: the router's matmul (the compute's
    :meth:`~runtime.compute.ExpertCompute.router_logits`, the same bits as ``router(x)``)."""
    logits = w.router(x) if logits_of is None else logits_of(w.router, x)  # [T, E] fp32
    return _route(logits, w.correction_bias, w.config)


def union(ids: I64Array) -> list[int]:
    """Sorted unique experts over all rows of the step (each is fetched and applied once)."""
    return sorted(set(ids.ravel().tolist()))  # (np.unique's ~12 us per call: ~2 us here)


def ranked_union(ids: I64Array, gates: F32Array) -> list[int]:
    """The unique experts of ``ids`` [T, K], most likely first: by their largest gate weight
    over the rows (ties by id). A lookahead prediction is read in this order."""
    best: dict[int, float] = {}
    for e, g in zip(ids.ravel().tolist(), gates.ravel().tolist(), strict=True):
        if g > best.get(e, -np.inf):
            best[e] = g
    return sorted(best, key=lambda e: (-best[e], e))


def expert_output(
    x: F32Array,
    ids: I64Array,
    weights: F32Array,
    e: int,
    w: MLPWeights,
    mlp: Callable[[F32Array, MLPWeights], F32Array] = swiglu,
) -> tuple[npt.NDArray[np.intp], F32Array]:
    """One routed expert applied to the rows routed to it: (rows [n], weighted output [n, D]).

    Independent of every other expert, so experts can be computed in any (arrival) order.
    ``mlp`` computes the SwiGLU (the compute's choice of threads and matmul)."""
    rows, slot = np.nonzero(ids == e)  # [n], [n]
    xe = np.ascontiguousarray(x[rows])  # [n, D]
    return rows, mlp(xe, w) * weights[rows, slot][:, None]  # [n, D]


def combine(
    x: F32Array, ids: I64Array, outputs: Mapping[int, tuple[npt.NDArray[np.intp], F32Array]]
) -> F32Array:
    """Sum expert outputs in ascending expert id (a fixed order: bit-identical results whatever
    order the experts were computed in)."""
    out = np.zeros_like(x)  # [T, D]
    for e in union(ids):
        if e not in outputs:
            raise ModelError(f"expert {e} was routed but the expert source did not provide it")
        rows, ye = outputs[e]
        if rows.size == 1:  # one row (decode): basic indexing, the same adds
            out[rows[0]] += ye[0]
        else:
            out[rows] += ye  # rows are unique per expert (top-k ids are distinct)
    return out


def apply_experts(
    x: F32Array, ids: I64Array, weights: F32Array, experts: Mapping[int, MLPWeights]
) -> F32Array:
    """Weighted sum of the routed experts of each row: [T, D]."""
    outputs = {e: expert_output(x, ids, weights, e, experts[e]) for e in union(ids) if e in experts}
    return combine(x, ids, outputs)


def shared(
    w: MoEWeights, x: F32Array, mlp: Callable[[F32Array, MLPWeights], F32Array] = swiglu
) -> F32Array:
    """Shared experts' output [T, D] (zeros when the layer has none)."""
    if w.shared is None:
        return np.zeros_like(x)
    return mlp(x, w.shared)

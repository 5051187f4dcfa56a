"""MoE routers: the DeepSeek-V3 / GLM-5 one ("noaux_tc", also GLM-4.5's and MiniMax-M2's) and
the softmax top-k one (OLMoE, Qwen3-MoE, Mixtral).

Softmax (``scoring="softmax"``, as ``OlmoeTopKRouter`` / ``MixtralTopKRouter``): probabilities
``softmax(logits)`` in fp32, experts = their top ``num_experts_per_tok``, weights = those
probabilities, divided by their sum when ``norm_topk_prob`` (Mixtral always), times
``routed_scaling_factor`` (1 for these families).

Sigmoid (``scoring="sigmoid"``):

Exactly ``DeepseekV3TopkRouter.forward`` (transformers 5.24):

1. ``scores = sigmoid(logits)`` (logits fp32 from the router Linear);
2. ``choice = scores + e_score_correction_bias``;
3. group score = sum of the two largest ``choice`` values of each of ``n_group`` contiguous
   groups; keep the ``topk_group`` best groups, set the others' ``choice`` to -inf;
4. experts = top ``num_experts_per_tok`` of ``choice``;
5. weights = the UNBIASED ``scores`` of those experts, divided by their sum (+``norm_eps``:
   1e-20, 0 for MiniMax-M2) when ``norm_topk_prob``, times ``routed_scaling_factor``.

Ties: both top-k steps pick the same sets as ``torch.topk`` on CPU (see ``topk.py``), so an exact
tie is broken the reference's way. Expert ids are returned ascending within a row.

The sigmoid router runs steps 2-5 in one numba call (``_sigmoid_rows``: a decode step's router
was ~20 small numpy calls) with the float32 operations of the numpy form, :func:`route_numpy`,
and the same bits (the weight sum in numpy's own order); a step with an ambiguous row (a tie
at a boundary, a NaN) is routed by the numpy form, which alone breaks ties as torch does.

Shape legend: T tokens, E routed experts, G groups, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from numba import njit

from runtime.layers.swiglu import sigmoid
from runtime.layers.topk import _select, torch_topk_indices

__all__ = ["KERNELS", "RouterConfig", "route", "route_numpy"]

F32Array = npt.NDArray[np.float32]
I64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The router's HF config keys."""

    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring: Literal["sigmoid", "softmax"] = "sigmoid"
    norm_eps: float = 1e-20  # added to the top-k sum before normalising


def route(logits: F32Array, bias: F32Array, cfg: RouterConfig) -> tuple[I64Array, F32Array]:
    """``logits`` [T, E] fp32 -> (expert ids [T, K] ascending per row, gate weights [T, K])."""
    t, e = logits.shape
    if cfg.scoring == "sigmoid" and t and cfg.num_experts_per_tok <= e:
        # the steps below in one numba call (rows whose choice holds a tie at the boundary, or
        # a NaN, go the numpy way: only it breaks ties as the reference does)
        scores = sigmoid(logits)  # [T, E]
        ids = np.empty((t, cfg.num_experts_per_tok), np.int64)
        weights = np.empty((t, cfg.num_experts_per_tok), np.float32)
        if _sigmoid_rows(
            scores, np.ascontiguousarray(bias, dtype=np.float32), cfg.n_group, cfg.topk_group,
            cfg.norm_topk_prob, np.float32(cfg.norm_eps), np.float32(cfg.routed_scaling_factor),
            ids, weights,
        ):  # fmt: skip
            return ids, weights
    return route_numpy(logits, bias, cfg)


def route_numpy(logits: F32Array, bias: F32Array, cfg: RouterConfig) -> tuple[I64Array, F32Array]:
    """:func:`route` by numpy array operations (every scoring; ties broken as torch does)."""
    t, e = logits.shape
    if cfg.scoring == "softmax":  # no correction bias: the choice is the probabilities
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))  # [T, E]
        scores = (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)  # [T, E]
        choice = scores
    else:
        scores = sigmoid(logits)  # [T, E]
        choice = (scores + bias[None, :]).astype(np.float32)  # [T, E]
    g = cfg.n_group
    if g > 1:
        grouped = choice.reshape(t, g, e // g)  # [T, G, E/G]
        top2 = -np.partition(-grouped, 1, axis=-1)[..., :2]  # [T, G, 2] (largest first)
        group_scores = (top2[..., 0] + top2[..., 1]).astype(np.float32)  # [T, G]
        keep = torch_topk_indices(group_scores, cfg.topk_group)  # [T, topk_group]
        group_mask = np.zeros((t, g), dtype=bool)  # [T, G]
        np.put_along_axis(group_mask, keep, True, axis=1)
        expert_mask = np.repeat(group_mask, e // g, axis=1)  # [T, E]
        choice = np.where(expert_mask, choice, np.float32(-np.inf)).astype(np.float32)
    ids = np.sort(torch_topk_indices(choice, cfg.num_experts_per_tok), axis=1)  # [T, K]
    weights = scores[np.arange(t)[:, None], ids]  # [T, K] (take_along_axis, without its ~20 us)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(cfg.norm_eps))
    weights = (weights * np.float32(cfg.routed_scaling_factor)).astype(np.float32)  # [T, K]
    return ids, weights


@njit(nogil=True, cache=True)
def _sum_like_numpy(w):  # type: ignore[no-untyped-def]
    """``w.sum()`` of a short float32 row in numpy's order (``pairwise_sum``: one running sum
    below 8 values, else eight running sums combined pairwise, then the tail), so the same
    bits as :func:`route`'s numpy form (a test compares them)."""
    n = w.size
    if n < 8:
        acc = np.float32(0.0)
        for j in range(n):
            acc += w[j]
        return acc
    r = w[:8].copy()
    i = 8
    while i + 8 <= n:
        for j in range(8):
            r[j] += w[i + j]
        i += 8
    acc = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < n:
        acc += w[i]
        i += 1
    return acc


@njit(nogil=True, cache=True)
def _ascending(a):  # type: ignore[no-untyped-def]
    """``np.sort(a)`` of a short integer row (the k chosen expert ids), by insertion: numba's
    quicksort took ~1.1 s of a first run's compile for a handful of values."""
    row = a.copy()
    for i in range(1, row.size):
        v = row[i]
        j = i
        while j > 0 and row[j - 1] > v:
            row[j] = row[j - 1]
            j -= 1
        row[j] = v
    return row


@njit(nogil=True, cache=True)
def _sigmoid_rows(scores, bias, n_group, topk_group, norm, eps, scale, ids, weights):  # type: ignore[no-untyped-def]
    """:func:`route`'s sigmoid steps after the sigmoid, row by row, into ``ids`` [T, K] and
    ``weights`` [T, K]: the choice (scores + bias), the group filter, the top-k, ascending
    ids, the unbiased weights normalised and scaled, with the float32 operations of the numpy
    form. False (nothing to trust) when a row's selection is ambiguous (a tie at a boundary, a
    NaN): those go the numpy way, whose tie-breaking is the reference's."""
    n_tok, n_e = scores.shape
    k = ids.shape[1]
    per = n_e // n_group
    choice = np.empty((1, n_e), np.float32)
    gsc = np.empty((1, n_group), np.float32)
    one = np.ones(1, np.int64)
    got = np.empty((1, k), np.int64)
    keep = np.empty((1, max(topk_group, 1)), np.int64)
    tied = np.zeros(1, np.bool_)
    w = np.empty(k, np.float32)
    for t in range(n_tok):
        for j in range(n_e):
            choice[0, j] = scores[t, j] + bias[j]
        if n_group > 1:
            for g in range(n_group):
                m1 = np.float32(-np.inf)
                m2 = np.float32(-np.inf)
                for j in range(g * per, (g + 1) * per):
                    v = choice[0, j]
                    if v != v:
                        return False
                    if v > m1:
                        m2 = m1
                        m1 = v
                    elif v > m2:
                        m2 = v
                gsc[0, g] = m1 + m2
            one[0] = n_group
            if _select(gsc, topk_group, one, False, keep, tied):
                return False
            for g in range(n_group):
                kept = False
                for i in range(topk_group):
                    if keep[0, i] == g:
                        kept = True
                if not kept:
                    for j in range(g * per, (g + 1) * per):
                        choice[0, j] = np.float32(-np.inf)
        one[0] = n_e
        if _select(choice, k, one, False, got, tied):
            return False
        row = _ascending(got[0])
        for i in range(k):
            ids[t, i] = row[i]
            w[i] = scores[t, row[i]]
        if norm:
            total = _sum_like_numpy(w) + eps
            for i in range(k):
                w[i] = w[i] / total
        for i in range(k):
            weights[t, i] = w[i] * scale
    return True


#: Every compiled kernel (tests check they were built with ``nogil=True``).
KERNELS = (_sum_like_numpy, _ascending, _sigmoid_rows)

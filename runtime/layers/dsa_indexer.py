"""DeepSeek sparse attention (DSA) lightning indexer, as ``GlmMoeDsaIndexer`` computes it.

Facts (transformers 5.24):

* index head layout is ``[rope | nope]`` (the main MLA query is ``[nope | rope]``); the rope
  slice is ``qk_rope_head_dim`` wide and uses the main model's cos/sin;
* GLM-5 rotates it with *interleaved* pairs, DeepSeek-V3.2 with half split (``interleave``);
* ``q = wq_b(q_resid)`` from the MLA query residual (``q_a_layernorm`` output);
  ``k = LayerNorm(wk(x))`` with weight AND bias, eps 1e-6; one key per token (cached);
* ``score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] / sqrt(d))`` with
  ``w = weights_proj(x) / sqrt(n_heads)``; future keys are -inf;
* the ``index_topk`` best keys per query stay visible to attention (a mask on top of the causal
  one); with ``index_topk >= S`` nothing is masked. The top-k set follows ``torch.topk``'s
  tie-breaking (relu makes exact 0.0 ties common), see ``topk.py``.
* ``indexer_types[L] == "shared"`` layers run no indexer and reuse the selection of the nearest
  earlier ``"full"`` layer of the same forward.

Shape legend: T new tokens, S keys (cache + new), D hidden, Q q_lora_rank, HI index heads,
DI index_head_dim, R rope dims (of DI).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from runtime.layers.rms_norm import layer_norm
from runtime.layers.rope import apply_rope
from runtime.layers.topk import torch_topk_indices
from runtime.linear import Linear

__all__ = [
    "IndexerDims",
    "IndexerWeights",
    "index_keys",
    "index_queries",
    "index_scores",
    "select",
]

F32Array = npt.NDArray[np.float32]
BoolArray = npt.NDArray[np.bool_]

K_NORM_EPS = 1e-6  # nn.LayerNorm(head_dim, eps=1e-6) in the reference


@dataclass(frozen=True, slots=True)
class IndexerDims:
    """Indexer sizes (HF config keys ``index_n_heads``, ``index_head_dim``, ``index_topk``)."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    qk_rope_head_dim: int
    interleave: bool = True


@dataclass(frozen=True, slots=True)
class IndexerWeights:
    wq_b: Linear  # [HI * DI, Q]
    wk: Linear  # [DI, D]
    k_norm_weight: F32Array  # [DI]
    k_norm_bias: F32Array  # [DI]
    weights_proj: Linear  # [HI, D]


def index_keys(
    w: IndexerWeights, d: IndexerDims, x: F32Array, cos: F32Array, sin: F32Array
) -> F32Array:
    """Index keys of the new tokens [T, DI] (normed and roped: the rows the cache keeps)."""
    k = layer_norm(w.wk(x), w.k_norm_weight, w.k_norm_bias, K_NORM_EPS)  # [T, DI]
    r = d.qk_rope_head_dim
    k[:, :r] = apply_rope(k[:, :r], cos, sin, d.interleave)
    return k


def index_queries(
    w: IndexerWeights,
    d: IndexerDims,
    x: F32Array,
    q_resid: F32Array,
    cos: F32Array,
    sin: F32Array,
) -> tuple[F32Array, F32Array]:
    """The new rows' index queries [T, HI, DI] (roped) and head weights [T, HI] (scaled by
    ``1 / sqrt(HI)``); each row on its own."""
    t, r = x.shape[0], d.qk_rope_head_dim
    q = w.wq_b(q_resid).reshape(t, d.index_n_heads, d.index_head_dim)  # [T, HI, DI]
    q = np.concatenate([apply_rope(q[:, :, :r], cos, sin, d.interleave), q[:, :, r:]], axis=-1)
    hw = w.weights_proj(x) * np.float32(d.index_n_heads**-0.5)  # [T, HI]
    return q, hw


def index_scores(
    w: IndexerWeights,
    d: IndexerDims,
    x: F32Array,
    q_resid: F32Array,
    keys: F32Array,
    cos: F32Array,
    sin: F32Array,
    *,
    queries: tuple[F32Array, F32Array] | None = None,
) -> F32Array:
    """Scores [T, S] of every key for each new query; -inf for future keys.

    ``x`` [T, D] is the attention input (input-normed hidden), ``q_resid`` [T, Q], ``keys``
    [S, DI] all index keys including the new ones (new queries are the last T positions).
    ``queries``: :func:`index_queries` of these rows when already made (several sequences'
    rows share one projection: rows are independent, so the same bits).
    """
    t, s = x.shape[0], keys.shape[0]
    q, hw = queries if queries is not None else index_queries(w, d, x, q_resid, cos, sin)
    scale = np.float32(d.index_head_dim**-0.5)
    scores = np.full((t, s), -np.inf, dtype=np.float32)  # [T, S]; future keys stay -inf
    for i in range(t):
        # One query at a time over its causal keys only: the same products, with the same
        # shapes, as a one-token decode at this position (batch-invariant scores).
        end = s - t + i + 1
        relu = np.maximum((q[i] @ keys[:end].T) * scale, np.float32(0.0))  # [HI, S_i]
        scores[i, :end] = hw[i : i + 1] @ relu  # [1, S_i]
    return scores


def select(scores: F32Array, topk: int) -> BoolArray | None:
    """Keys kept per query [T, S] (True = visible), or None when ``topk >= S`` (no-op).

    Query i (the last T of S positions) chooses among its own causal keys only, with
    ``torch.topk``'s tie-breaking over exactly those ``S - T + i + 1`` scores: the choice a
    one-token decode at that position makes, whatever T and S are (batch-invariant). A query
    with at most ``topk`` causal keys keeps them all."""
    t, s = scores.shape
    if topk >= s:
        return None
    if t == 1:  # a decode row: all S keys are causal and S > topk (the same set, less numpy)
        keep = torch_topk_indices(scores, topk)  # [1, topk]
        one: BoolArray = np.zeros((1, s), dtype=bool)
        one[0, keep[0]] = True
        return one
    n_keys = np.arange(t) + (s - t) + 1  # [T] causal keys per query
    mask: BoolArray = np.arange(s)[None, :] < n_keys[:, None]  # [T, S] every causal key
    long = np.flatnonzero(n_keys > topk)  # queries that must choose
    if long.size:
        keep = torch_topk_indices(scores[long], topk, lengths=n_keys[long])  # [L, topk]
        chosen = np.zeros((long.size, s), dtype=bool)  # [L, S]
        np.put_along_axis(chosen, keep, True, axis=1)
        mask[long] = chosen
    return mask

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

Shape legend: T tokens, E routed experts, G groups, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from runtime.layers.swiglu import sigmoid
from runtime.layers.topk import torch_topk_indices

__all__ = ["RouterConfig", "route"]

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

"""MiniMax-M2 (``model_type: minimax_m2``): grouped-query attention, sigmoid router with bias.

Differences from the GQA stack's defaults (``MiniMaxM2Attention`` / ``MiniMaxM2TopKRouter``,
transformers 5.24): full-width q/k RMSNorm (over all heads, before the split); partial rotary
from ``partial_rotary_factor`` or the released checkpoints' ``rotary_dim``; the MoE block is
``block_sparse_moe`` (experts ``w1``/``w3``/``w2``, ``intermediate_size`` wide) with its
``e_score_correction_bias`` beside the router; routing is sigmoid, bias for the choice only,
plain top-k (no groups), weights renormalised with no epsilon and not scaled.

Shape legend: see ``runtime.models._gqa``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from runtime.models._gqa import GQAMoEConfig, GQAMoEModel

__all__ = ["MiniMaxM2", "MiniMaxM2Config"]


@dataclass(frozen=True, kw_only=True)
class MiniMaxM2Config(GQAMoEConfig):
    """MiniMax-M2 config keys."""

    scoring: ClassVar[Literal["sigmoid", "softmax"]] = "sigmoid"
    always_norm_topk: ClassVar[bool] = True


class MiniMaxM2(GQAMoEModel):
    """MiniMax-M2 decoder."""

    config_class: ClassVar[type[GQAMoEConfig]] = MiniMaxM2Config

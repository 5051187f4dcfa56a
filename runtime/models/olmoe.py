"""OLMoE (``model_type: olmoe``): grouped-query attention, full-width q/k RMSNorm, softmax top-k.

Differences from the GQA stack's defaults (``OlmoeAttention`` / ``OlmoeTopKRouter``, transformers
5.24): ``q_norm`` / ``k_norm`` normalise the whole q and k projections before the heads are split;
``clip_qkv`` (when set) clamps q, k and v; the router is softmax then top-k, renormalised only with
``norm_topk_prob`` (default false); routed experts are ``intermediate_size`` wide; every layer is
MoE; no shared experts, no correction bias.

Shape legend: see ``runtime.models._gqa``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from runtime.models._gqa import GQAMoEConfig, GQAMoEModel

__all__ = ["Olmoe", "OlmoeConfig"]


@dataclass(frozen=True, kw_only=True)
class OlmoeConfig(GQAMoEConfig):
    """OLMoE config keys."""


class Olmoe(GQAMoEModel):
    """OLMoE decoder."""

    config_class: ClassVar[type[GQAMoEConfig]] = OlmoeConfig

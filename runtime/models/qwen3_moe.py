"""Qwen3-MoE (``model_type: qwen3_moe``): grouped-query attention with per-head q/k RMSNorm.

Differences from the GQA stack's defaults (``Qwen3MoeAttention`` / ``Qwen3MoeTopKRouter``,
transformers 5.24): ``q_norm`` / ``k_norm`` (weight [head_dim]) normalise each head; the router is
softmax then top-k, renormalised with ``norm_topk_prob``; routed experts are
``moe_intermediate_size`` wide; ``mlp_only_layers`` and ``decoder_sparse_step`` choose the dense
layers (``storage.arch``); ``sliding_window`` only applies with ``use_sliding_window``, which is
refused.

Shape legend: see ``runtime.models._gqa``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from runtime.models._gqa import GQAMoEConfig, GQAMoEModel

__all__ = ["Qwen3Moe", "Qwen3MoeConfig"]


@dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(GQAMoEConfig):
    """Qwen3-MoE config keys (its sliding_window is on only with use_sliding_window:
    ``storage.arch.rotary_keys``)."""


class Qwen3Moe(GQAMoEModel):
    """Qwen3-MoE decoder."""

    config_class: ClassVar[type[GQAMoEConfig]] = Qwen3MoeConfig

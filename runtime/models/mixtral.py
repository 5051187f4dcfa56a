"""Mixtral (``model_type: mixtral``): plain grouped-query attention, softmax top-k router.

Differences from the GQA stack's defaults (``MixtralAttention`` / ``MixtralTopKRouter``,
transformers 5.24): no q/k norm and no biases; the MoE block is ``block_sparse_moe`` with experts
``w1`` (gate), ``w3`` (up), ``w2`` (down), ``intermediate_size`` wide (the naming lives in
``storage.arch.FAMILIES``); top-k weights are always renormalised; ``sliding_window`` attention
is refused.

Shape legend: see ``runtime.models._gqa``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from runtime.models._gqa import GQAMoEConfig, GQAMoEModel

__all__ = ["Mixtral", "MixtralConfig"]


@dataclass(frozen=True, kw_only=True)
class MixtralConfig(GQAMoEConfig):
    """Mixtral config keys."""

    always_norm_topk: ClassVar[bool] = True


class Mixtral(GQAMoEModel):
    """Mixtral decoder."""

    config_class: ClassVar[type[GQAMoEConfig]] = MixtralConfig

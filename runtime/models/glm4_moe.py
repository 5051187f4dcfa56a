"""GLM-4.5 / 4.6 (``model_type: glm4_moe``): grouped-query attention, DeepSeek-style sigmoid router.

Differences from the GQA stack's defaults (``Glm4MoeAttention`` / ``Glm4MoeTopkRouter``,
transformers 5.24): q/k/v carry biases with ``attention_bias`` (o_proj never); per-head q/k
RMSNorm with ``use_qk_norm``; partial rotary (``partial_rotary_factor``, 0.5 when config.json
omits it); the router is the noaux_tc one (sigmoid, ``e_score_correction_bias`` for the choice,
``n_group`` / ``topk_group``, ``norm_topk_prob`` with +1e-20, ``routed_scaling_factor``) plus
``n_shared_experts`` shared experts; the first ``first_k_dense_replace`` layers are dense. The
MTP layer (``num_nextn_predict_layers``) is kept on disk but not run: speculative drafting is
for the MLA stack.

Shape legend: see ``runtime.models._gqa``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from runtime.models._gqa import GQAMoEConfig, GQAMoEModel

__all__ = ["Glm4Moe", "Glm4MoeConfig"]


@dataclass(frozen=True, kw_only=True)
class Glm4MoeConfig(GQAMoEConfig):
    """GLM-4.5 config keys."""

    scoring: ClassVar[Literal["sigmoid", "softmax"]] = "sigmoid"
    norm_eps: ClassVar[float] = 1e-20
    norm_topk_default: ClassVar[bool] = True
    scales_routed: ClassVar[bool] = True


class Glm4Moe(GQAMoEModel):
    """GLM-4.5 decoder."""

    config_class: ClassVar[type[GQAMoEConfig]] = Glm4MoeConfig

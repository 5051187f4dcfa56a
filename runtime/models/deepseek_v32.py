"""DeepSeek-V3.2 (``model_type: deepseek_v32``): MLA + DSA lightning indexer + MoE, GLM-5's stack.

transformers (5.24) describes GLM-5's indexer as "the same as ``DeepseekV32Indexer.forward``,
but with interleaved RoPE": here the indexer's rope slice is turned with *half split* pairs
(``rotate_half``) while the main attention keeps interleaved pairs. Every layer runs its own
indexer (``layer_types`` all "indexed_attention", no shared layers); the first
``first_k_dense_replace`` layers are dense; the router is DeepSeek-V3's (``n_group`` /
``topk_group``). Everything else (DSA selection, the cache of index keys, MTP) is
:mod:`runtime.models.glm_moe_dsa`'s.

Shape legend: see ``runtime.models.glm_moe_dsa``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from runtime.models._decoder import MLAMoEConfig
from runtime.models.glm_moe_dsa import GlmMoeDsa, GlmMoeDsaConfig

__all__ = ["DeepseekV32", "DeepseekV32Config"]


@dataclass(frozen=True, kw_only=True)
class DeepseekV32Config(GlmMoeDsaConfig):
    """DeepSeek-V3.2 config keys."""

    indexer_interleave: ClassVar[bool] = False


class DeepseekV32(GlmMoeDsa):
    """DeepSeek-V3.2 decoder with DeepSeek sparse attention."""

    config_class: ClassVar[type[MLAMoEConfig]] = DeepseekV32Config

"""DeepSeek-V3 (``model_type: deepseek_v3``): MLA + MoE with group-limited routing, YaRN + MTP.

Differences from the shared stack: the first ``first_k_dense_replace`` layers are dense; rope
pairs are interleaved when ``rope_interleave`` (the default) and half split otherwise; YaRN
``mscale_all_dim`` scales the softmax (handled by ``runtime.layers.rope``). No sparse attention.

Shape legend: see ``runtime.models._decoder``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from runtime.models._decoder import MLAMoEConfig, MLAMoEModel

__all__ = ["DeepseekV3", "DeepseekV3Config"]


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Config(MLAMoEConfig):
    """DeepSeek-V3 config keys (field name = HF config key)."""

    rope_interleave: bool = True

    @classmethod
    def _parse(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        kw = super()._parse(cfg)
        if cfg.get("rope_interleave") is not None:
            kw["rope_interleave"] = bool(cfg["rope_interleave"])
        return kw

    def interleaved_rope(self) -> bool:
        return self.rope_interleave


class DeepseekV3(MLAMoEModel):
    """DeepSeek-V3 decoder (dense MLA attention)."""

    config_class: ClassVar[type[MLAMoEConfig]] = DeepseekV3Config

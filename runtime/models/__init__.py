"""Model architectures, one module per Hugging Face ``model_type``, and the loader registry.

Shape legend: see ``runtime.models._decoder``.
"""

from __future__ import annotations

from pathlib import Path

from runtime.models._decoder import DecoderStack, LogitsOut, MLAMoEConfig, MLAMoEModel
from runtime.models._gqa import GQAMoEConfig, GQAMoEModel
from runtime.models.deepseek_v3 import DeepseekV3, DeepseekV3Config
from runtime.models.deepseek_v32 import DeepseekV32
from runtime.models.glm4_moe import Glm4Moe
from runtime.models.glm_moe_dsa import GlmMoeDsa, GlmMoeDsaConfig
from runtime.models.minimax_m2 import MiniMaxM2
from runtime.models.mixtral import Mixtral
from runtime.models.olmoe import Olmoe
from runtime.models.qwen3_moe import Qwen3Moe
from runtime.weights import ContainerLike, ExpertSource
from storage.errors import ConfigError, ModelError

__all__ = [
    "ARCHITECTURES",
    "DecoderStack",
    "DeepseekV3",
    "DeepseekV3Config",
    "GQAMoEConfig",
    "GQAMoEModel",
    "GlmMoeDsa",
    "GlmMoeDsaConfig",
    "LogitsOut",
    "MLAMoEConfig",
    "MLAMoEModel",
    "Model",
    "load_model",
]

Model = DecoderStack

# One entry per HF model_type (storage.arch.FAMILIES names the same set).
ARCHITECTURES: dict[str, type[MLAMoEModel] | type[GQAMoEModel]] = {
    "glm_moe_dsa": GlmMoeDsa,
    "deepseek_v3": DeepseekV3,
    "kimi_k2": DeepseekV3,  # same layout and math (transformers maps it to deepseek_v3)
    "deepseek_v32": DeepseekV32,
    "olmoe": Olmoe,
    "qwen3_moe": Qwen3Moe,
    "mixtral": Mixtral,
    "glm4_moe": Glm4Moe,
    "minimax_m2": MiniMaxM2,
}


def load_model(container: ContainerLike, experts: ExpertSource | None = None) -> DecoderStack:
    """Build the model for ``container.config["model_type"]`` (experts default to resident)."""
    model_type = str(container.config.get("model_type"))
    cls = ARCHITECTURES.get(model_type)
    if cls is None:
        raise ModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    try:
        return cls.from_container(container, experts)
    except ConfigError as exc:
        # the model configs parse a plain dict and say "config.json: ..."; name the file
        path = getattr(container, "path", None)
        msg = str(exc)
        if path is not None and msg.startswith("config.json: "):
            raise ConfigError(f"{Path(path) / 'config.json'}: {msg[13:]}") from exc
        raise

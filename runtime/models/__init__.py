"""Model architectures, one module per Hugging Face ``model_type``, and the loader registry.

Shape legend: see ``runtime.models._decoder``.
"""

from __future__ import annotations

from runtime.models._decoder import LogitsOut, MLAMoEConfig, MLAMoEModel
from runtime.models.deepseek_v3 import DeepseekV3, DeepseekV3Config
from runtime.models.glm_moe_dsa import GlmMoeDsa, GlmMoeDsaConfig
from runtime.weights import ContainerLike, ExpertSource
from storage.errors import ModelError

__all__ = [
    "ARCHITECTURES",
    "DeepseekV3",
    "DeepseekV3Config",
    "GlmMoeDsa",
    "GlmMoeDsaConfig",
    "LogitsOut",
    "MLAMoEConfig",
    "MLAMoEModel",
    "Model",
    "load_model",
]

Model = MLAMoEModel

ARCHITECTURES: dict[str, type[MLAMoEModel]] = {
    "glm_moe_dsa": GlmMoeDsa,
    "deepseek_v3": DeepseekV3,
}


def load_model(container: ContainerLike, experts: ExpertSource | None = None) -> MLAMoEModel:
    """Build the model for ``container.config["model_type"]`` (experts default to resident)."""
    model_type = str(container.config.get("model_type"))
    cls = ARCHITECTURES.get(model_type)
    if cls is None:
        raise ModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return cls.from_container(container, experts)

"""colibri: run giant Mixture-of-Experts models on ordinary machines.

Sync::

    import colibri
    with colibri.open_model(path) as model:
        logits = model.forward(token_ids)
        ids = model.generate(prompt_ids, max_new_tokens=32, temperature=0.0)

Async (asyncio or trio)::

    async with colibri.Engine.open(path) as engine:
        async for event in engine.generate(prompt_ids, max_new_tokens=32):
            ...
"""

from colibri._config import EngineOptions, default_model_path
from colibri._engine import DoneEvent, Engine, GenerationEvent, SyncModel, TokenEvent, open_model
from storage.errors import ColibriError

__all__ = [
    "ColibriError",
    "DoneEvent",
    "Engine",
    "EngineOptions",
    "GenerationEvent",
    "SyncModel",
    "TokenEvent",
    "default_model_path",
    "open_model",
]

__version__ = "0.1.0"

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

from __future__ import annotations

import importlib

# typing is not imported at run time (~20 ms a loaded machine spends before `coli` can take
# Ctrl-C); mypy reads this name as typing.TYPE_CHECKING
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from colibri._config import EngineOptions, default_model_path
    from colibri._engine import (
        DoneEvent,
        Engine,
        GenerationEvent,
        SyncModel,
        TokenEvent,
        open_model,
    )
    from runtime.grammar import GrammarSpec
    from storage.errors import ColibriError

# Imported on first use: `import colibri` (and the `coli` command starting up) stays light, and
# the engine's imports (numpy, numba, the kernels) happen where a Ctrl-C is handled.
_WHERE = {
    "EngineOptions": "colibri._config",
    "default_model_path": "colibri._config",
    "DoneEvent": "colibri._engine",
    "Engine": "colibri._engine",
    "GenerationEvent": "colibri._engine",
    "SyncModel": "colibri._engine",
    "TokenEvent": "colibri._engine",
    "open_model": "colibri._engine",
    "GrammarSpec": "runtime.grammar",
    "ColibriError": "storage.errors",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'colibri' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "ColibriError",
    "DoneEvent",
    "Engine",
    "EngineOptions",
    "GenerationEvent",
    "GrammarSpec",
    "SyncModel",
    "TokenEvent",
    "default_model_path",
    "open_model",
]

__version__ = "0.1.0"

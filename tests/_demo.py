"""The model most tests run on: the tiny random glm_moe_dsa container in tests/data/tiny-glm
(fast, every path of the architecture), exported as COLI_MODEL by conftest so that `coli`
subprocesses use it too. The trained demo model bundled in the package stays the default of
`coli` and `colibri.open_model()` for users; tests that mean it use default_model_path()."""

from __future__ import annotations

import os
from pathlib import Path

TINY = Path(__file__).resolve().parent / "data" / "tiny-glm"


def demo_model() -> Path:
    return Path(os.environ.get("COLI_MODEL") or TINY)


def budget_for_lru(path: Path, lru_per_layer: int) -> int:
    """A RAM budget that leaves exactly ``lru_per_layer`` cache slots per layer (streaming)."""
    from runtime.budget import kv_bytes_per_token, resident_nbytes
    from runtime.experts import plan_layout
    from runtime.models import load_model
    from runtime.weights import ResidentExperts
    from storage.container import Container

    c = Container.open(path)
    model = load_model(c, ResidentExperts(c, layers=[]))
    dense = resident_nbytes(model.weights)
    ctx = min(4096, int(c.config.get("max_position_embeddings") or 4096))
    kv = kv_bytes_per_token(c.arch) * ctx
    probe = plan_layout(c, 1 << 40, top_k=c.arch.top_k)
    row = sum(probe.layer_slot_bytes(layer) for layer in c.expert_layers())  # a slot per layer
    experts = probe.slot_bytes * probe.transient_slots + row * lru_per_layer
    return dense + kv + experts + row // 2

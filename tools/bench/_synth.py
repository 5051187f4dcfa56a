"""What the streaming benchmarks share: the synthetic GLM-5-geometry model, a RAM budget that
holds a share of its experts, and dropping the page cache between runs.

Imported by ``stream.py``, ``prefill.py`` and ``cluster.py`` (run as scripts from this folder).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from storage.container import Container  # noqa: E402

__all__ = ["budget_for", "drop_caches", "ensure_synthetic"]


SYNTH_PATHS = (Path("/var/tmp/colibri-synth"), Path("/var/tmp/colibri-synth-predictable"))


def ensure_synthetic(path: Path, predictable: bool = False) -> None:
    """Build the synthetic model at ``path`` on first use (3 MoE layers x 256 experts, ~16 GiB,
    about a minute per layer) when ``path`` is one of its default places (:data:`SYNTH_PATHS`);
    ``predictable``: ``make_synthetic.py --predictable``. Any other directory must hold a model
    already: a mistyped --model wrote 16 GiB of shards wherever it pointed."""
    if (path / "config.json").exists():
        return
    if path not in SYNTH_PATHS:
        raise SystemExit(
            f"{path} holds no model (no config.json); the synthetic model is built only at its "
            f"default place ({SYNTH_PATHS[predictable]}): leave --model out, or run "
            f"tools/make_synthetic.py --out {path} first"
        )
    cmd = [sys.executable, str(ROOT / "tools" / "make_synthetic.py"), "--out", str(path)]
    subprocess.run(cmd + ["--predictable"] * predictable, check=True)


def budget_for(c: Container, path: Path, fraction: float) -> int:
    """A RAM budget: the dense part + the KV reserve (4096 tokens, or the context when
    shorter: what the engine reserves) + the transient slots the engine reserves first +
    ``fraction`` of the experts' slots (so that ``fraction`` is the share of experts the cache
    holds). (A 4096-token reserve on a 1024-token model left ~16 MB more for the cache: every
    expert of the demo model resident at any fraction.)"""
    from colibri._config import EngineOptions
    from colibri._engine import _plan
    from runtime.budget import kv_bytes_per_token, resident_nbytes

    opts = EngineOptions(model=path, ram_budget=1 << 50, learn=False)
    model, layout, _ = anyio.run(_plan, c, opts)
    assert layout is not None
    dense = resident_nbytes(model.weights)
    ctx = int(c.config.get("max_position_embeddings") or 4096)
    kv = kv_bytes_per_token(c.arch) * min(4096, ctx)
    transient = layout.transient_slots * layout.slot_bytes
    slots = sum(layout.layer_slot_bytes(x.layer) for x in c.expert_extents())  # one per expert
    return int(dense + kv + transient + fraction * slots)


def drop_caches() -> bool:
    """Drop the page cache (root only), so reads come from the disk; False when not root."""
    if os.geteuid() != 0:
        return False
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")
    return True

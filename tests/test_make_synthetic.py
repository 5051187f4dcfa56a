"""``tools/make_synthetic.py``: the synthetic GLM-5-geometry models the streaming benchmarks use.
``--predictable`` must give routing that layer L's state predicts for layer L+1 (the disk-bound
case where lookahead should pay); the default, routing it mostly does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import colibri
from runtime.experts import slot_sizes
from storage.container import Container

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two MoE layers x 8 experts, top-2, one model of each kind."""
    out = {}
    for kind in ("random", "predictable"):
        path = tmp_path_factory.mktemp(kind) / "model"
        subprocess.run(
            [sys.executable, str(ROOT / "tools" / "make_synthetic.py"), "--out", str(path),
             "--moe-layers", "2", "--experts", "8", "--top-k", "2"]
            + ["--predictable"] * (kind == "predictable"),
            check=True, capture_output=True,
        )  # fmt: skip
        out[kind] = path
    return out


def _recall(path: Path) -> dict[str, Any]:
    c = Container.open(path)
    blob, scales = slot_sizes(c)
    # the dense part with room, and the 2 x top-k transient slots: nothing cached
    budget = 400 * 2**20 + 4 * (blob + max(scales, 4096))
    with colibri.open_model(path, ram_budget=budget, learn=False, prefetch="on") as m:
        m.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, seed=5)
        st: dict[str, Any] = m.stats()["experts"]
        return st


def test_predictable_routing_is_predicted_and_random_routing_is_not(
    models: dict[str, Path],
) -> None:
    pred, rand = _recall(models["predictable"]), _recall(models["random"])
    assert pred["lookahead_routed"] > 20 and rand["lookahead_routed"] > 20
    assert pred["lookahead_recall"] >= 0.8
    assert rand["lookahead_recall"] <= 0.7
    assert pred["prefetch_used"] > 0
